"""The thread pool's and the batch packer's C++ tests under ThreadSanitizer.

As test_runtime_sanitizers.py (ASan + UBSan) does for the runtime: the sources and the
GoogleTest files are rebuilt with g++ -fsanitize=thread and run; any report fails the
test. cpu/parallel.cpp runs every kernel's parallel_for on the spinning pool of
cpu/gguf_pool.h (atomics, a mutex, a condition variable); test_parallel.cpp drives it
from one caller, nested, and from four concurrent callers. The packer is used from the
engine thread only; its tests run under TSan for its allocations and containers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GTEST = Path("/usr/src/googletest/googletest")
CXX = shutil.which("g++")
FLAGS = ["-std=c++17", "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=thread", "-mavx2", "-mfma",
         "-Wall", "-Wextra", "-Wno-unused-parameter"]
INCLUDES = [f"-I{ROOT / 'src/cpp'}", f"-I{GTEST / 'include'}", f"-I{GTEST}"]
# test file -> the sources it links
SUITES = {
    "test_parallel.cpp": ["src/cpp/cpu/parallel.cpp"],
    "test_batch_packer.cpp": [str(p.relative_to(ROOT)) for p in sorted((ROOT / "src/cpp/runtime").glob("*.cpp"))],
}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CXX is None or not (GTEST / "src/gtest-all.cc").exists(),
                       reason="needs g++ and GoogleTest sources (libgtest-dev)"),
]


def compile_object(src: Path, out: Path) -> None:
    r = subprocess.run([CXX, *FLAGS, *INCLUDES, "-c", str(src), "-o", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, f"compiling {src.name}:\n{r.stderr[-4000:]}"


@pytest.fixture(scope="module")
def objects(tmp_path_factory) -> dict[str, Path]:
    build = tmp_path_factory.mktemp("tsan")
    sources = {GTEST / "src/gtest-all.cc", GTEST / "src/gtest_main.cc"}
    for test, libs in SUITES.items():
        sources |= {ROOT / "tests/cpp" / test, *(ROOT / s for s in libs)}
    sources = sorted(sources)
    outs = [build / f"{s.parent.name}_{s.stem}.o" for s in sources]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        list(pool.map(compile_object, sources, outs))
    return {str(s): o for s, o in zip(sources, outs)}


@pytest.mark.parametrize("test_file", sorted(SUITES), ids=[Path(t).stem for t in sorted(SUITES)])
def test_runs_clean_under_thread_sanitizer(objects, test_file, tmp_path):
    exe = tmp_path / Path(test_file).stem
    objs = [objects[str(GTEST / "src/gtest-all.cc")], objects[str(GTEST / "src/gtest_main.cc")],
            objects[str(ROOT / "tests/cpp" / test_file)], *(objects[str(ROOT / s)] for s in SUITES[test_file])]
    link = subprocess.run([CXX, *FLAGS, *map(str, objs), "-pthread", "-o", str(exe)],
                          capture_output=True, text=True)
    assert link.returncode == 0, link.stderr[-4000:]
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1")
    # setarch -R: TSan's shadow mapping needs the ASLR layout it expects on newer kernels
    cmd = [str(exe)]
    if shutil.which("setarch"):
        cmd = ["setarch", os.uname().machine, "-R", *cmd]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    report = run.stdout[-3000:] + run.stderr[-6000:]
    assert run.returncode == 0, report
    assert "WARNING: ThreadSanitizer" not in run.stderr, report
    assert "[  PASSED  ]" in run.stdout, report
