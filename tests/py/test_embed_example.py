"""examples/embed: a C++ program finds the installed package with
find_package(VllmMetal), links vllm_metal::core without Python, and runs ops."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_metal.cmake_dir import cmake_dir

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "embed"


@pytest.mark.slow
def test_embed_example_builds_and_runs(tmp_path):
    venv_cmake = Path(sys.executable).parent / "cmake"
    cmake = str(venv_cmake) if venv_cmake.exists() else shutil.which("cmake")
    assert cmake, "cmake is required (pip install cmake)"
    assert (cmake_dir() / "VllmMetalConfig.cmake").is_file()
    build = tmp_path / "build"
    for cmd in (
        [cmake, "-S", str(EXAMPLE), "-B", str(build), f"-DVllmMetal_DIR={cmake_dir()}",
         "-DCMAKE_BUILD_TYPE=Release"],
        [cmake, "--build", str(build), "-j2"],
    ):
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}\n{r.stderr}"
    run = subprocess.run([str(build / "embed_demo")], capture_output=True, text=True, env={})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "cache ok" in run.stdout
