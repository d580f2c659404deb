"""The CPU kernels' NEON paths, built for arm64 and run under qemu-user.

Apple Silicon runs the NEON code; this machine is x86-64. The MLX-free kernel
files and their C++ tests are cross-compiled (static) with GoogleTest from
source and executed with qemu-aarch64, so the arm64 paths are tested here.
"""

import concurrent.futures as cf
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GTEST = Path("/usr/src/googletest/googletest")
KERNELS = ["vec", "parallel", "batch_invariant", "rms_norm", "reshape_and_cache", "gguf_quants", "gguf_matmul",
           "gelu", "rope"]  # gelu: gguf_matmul's epilogue
RUNTIME = ["gguf_types", "gguf_reader"]  # MLX-free runtime files the kernels or tests use
TESTS = ["test_vec", "test_parallel", "test_cpu_kernels", "test_gguf", "test_rope_cpu"]

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64",
    reason="cross-check for x86-64 Linux hosts; arm64 hosts run the NEON paths natively in ctest",
)


@pytest.mark.slow
def test_cpu_kernels_pass_their_tests_on_arm64(tmp_path):
    cxx = shutil.which("aarch64-linux-gnu-g++")
    qemu = shutil.which("qemu-aarch64")
    assert cxx and qemu, "needs g++-aarch64-linux-gnu and qemu-user (scripts/setup installs them)"
    exe = tmp_path / "cpu_tests_arm64"
    sources = [ROOT / f"src/cpp/cpu/{k}.cpp" for k in KERNELS]
    sources += [ROOT / f"src/cpp/runtime/{r}.cpp" for r in RUNTIME]
    sources += [ROOT / f"tests/cpp/{t}.cpp" for t in TESTS]
    sources += [GTEST / "src/gtest-all.cc", GTEST / "src/gtest_main.cc"]
    flags = ["-O2", "-std=c++17", "-Wall", "-Werror", "-Wno-psabi", f"-I{ROOT / 'src/cpp'}",
             f"-I{ROOT / 'src/metal'}", f"-I{GTEST / 'include'}", f"-I{GTEST}", "-pthread"]
    objects = [tmp_path / f"{i}-{s.stem}.o" for i, s in enumerate(sources)]

    def compile_one(i: int) -> subprocess.CompletedProcess:
        return subprocess.run([cxx, *flags, "-c", str(sources[i]), "-o", str(objects[i])],
                              capture_output=True, text=True)

    # one compiler per core (the files compile independently), GoogleTest's big file first
    order = sorted(range(len(sources)), key=lambda i: "gtest-all" not in sources[i].name)
    with cf.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        compiled = dict(zip(order, pool.map(compile_one, order)))
    for i in range(len(sources)):
        assert compiled[i].returncode == 0, f"{sources[i]}:\n{compiled[i].stderr}"
    build = subprocess.run([cxx, *map(str, objects), "-pthread", "-static", "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    # GoogleTest's own sharding: one emulated process per core, together every test once
    shards = os.cpu_count() or 1

    def run_shard(i: int) -> subprocess.CompletedProcess:
        env = {**os.environ, "GTEST_TOTAL_SHARDS": str(shards), "GTEST_SHARD_INDEX": str(i)}
        return subprocess.run([qemu, str(exe)], capture_output=True, text=True, timeout=600, env=env)

    with cf.ThreadPoolExecutor(shards) as pool:
        runs = list(pool.map(run_shard, range(shards)))
    for run in runs:
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
        assert "PASSED" in run.stdout
    ran = sum(int(re.search(r"\[  PASSED  \] (\d+) test", run.stdout).group(1)) for run in runs)
    listed = subprocess.run([qemu, str(exe), "--gtest_list_tests"], capture_output=True, text=True)
    assert ran == sum(1 for line in listed.stdout.splitlines() if line.startswith("  ")), listed.stdout
