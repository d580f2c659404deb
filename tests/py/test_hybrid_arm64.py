"""The hybrid-model CPU kernels' NEON paths (gated delta, causal conv1d, mrope), built for
arm64 and run under qemu-user against tests/cpp/test_hybrid_cpu.cpp's naive loops."""

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GTEST = Path("/usr/src/googletest/googletest")
KERNELS = ["vec", "parallel", "rope", "gated_delta", "causal_conv1d", "mrope"]

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64",
    reason="cross-check for x86-64 Linux hosts; arm64 hosts run the NEON paths natively in ctest",
)


@pytest.mark.slow
def test_hybrid_cpu_kernels_pass_on_arm64(tmp_path):
    cxx = shutil.which("aarch64-linux-gnu-g++")
    qemu = shutil.which("qemu-aarch64")
    assert cxx and qemu, "needs g++-aarch64-linux-gnu and qemu-user (scripts/setup installs them)"
    exe = tmp_path / "hybrid_tests_arm64"
    sources = [ROOT / f"src/cpp/cpu/{k}.cpp" for k in KERNELS]
    sources += [ROOT / "tests/cpp/test_hybrid_cpu.cpp", GTEST / "src/gtest-all.cc",
                GTEST / "src/gtest_main.cc"]
    build = subprocess.run(
        [cxx, "-O2", "-std=c++17", "-Wall", "-Werror", "-Wno-psabi", f"-I{ROOT / 'src/cpp'}",
         f"-I{ROOT / 'src/metal'}", f"-I{GTEST / 'include'}", f"-I{GTEST}",
         *map(str, sources), "-pthread", "-static", "-o", str(exe)],
        capture_output=True, text=True,
    )
    assert build.returncode == 0, build.stderr
    run = subprocess.run([qemu, str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "PASSED" in run.stdout
