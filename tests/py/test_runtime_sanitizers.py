"""The runtime's C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer.

src/cpp/runtime is plain C++17 (no MLX, no Python), so its sources and every
GoogleTest file that includes only runtime headers are rebuilt here with g++
-fsanitize=address,undefined -fno-sanitize-recover=all (GoogleTest from its
sources in /usr/src/googletest) and run; any report fails the test. One case per
test file, so a finding names its file.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GTEST = Path("/usr/src/googletest/googletest")
RUNTIME_SOURCES = sorted((ROOT / "src/cpp/runtime").glob("*.cpp"))
CXX = shutil.which("g++")
# -O0: a quarter of -O1's compile time, and the tests run in milliseconds either way.
FLAGS = ["-std=c++17", "-O0", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
         "-fno-sanitize-recover=all", "-Wall", "-Wextra", "-Wno-unused-parameter"]
INCLUDES = [f"-I{ROOT / 'src/cpp'}", f"-I{GTEST / 'include'}", f"-I{GTEST}"]


def runtime_only_tests() -> list[Path]:
    """tests/cpp files whose project includes are all runtime/ headers."""
    found = []
    for path in sorted((ROOT / "tests/cpp").glob("test_*.cpp")):
        includes = re.findall(r'#include\s+"([^"]+)"', path.read_text())
        if includes and all(inc.startswith("runtime/") for inc in includes):
            found.append(path)
    return found


TESTS = runtime_only_tests()

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CXX is None or not (GTEST / "src/gtest-all.cc").exists(),
                       reason="needs g++ and GoogleTest sources (libgtest-dev)"),
]


def compile_object(src: Path, out: Path) -> None:
    result = subprocess.run([CXX, *FLAGS, *INCLUDES, "-c", str(src), "-o", str(out)],
                            capture_output=True, text=True)
    assert result.returncode == 0, f"compiling {src.name}:\n{result.stderr[-4000:]}"


@pytest.fixture(scope="module")
def objects(tmp_path_factory) -> dict[str, Path]:
    """GoogleTest, the runtime sources and the test files, compiled once (in
    parallel) with the sanitizers; keyed by source file name."""
    build = tmp_path_factory.mktemp("asan")
    sources = [GTEST / "src/gtest-all.cc", GTEST / "src/gtest_main.cc", *RUNTIME_SOURCES, *TESTS]
    outs = [build / f"{src.stem}.o" for src in sources]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        list(pool.map(compile_object, sources, outs))
    return {src.name: out for src, out in zip(sources, outs)}


def test_the_block_pool_and_geometry_tests_are_covered():
    names = {t.name for t in TESTS}
    assert {"test_block_pool.cpp", "test_kv_geometry.cpp"} <= names


@pytest.mark.parametrize("test_file", TESTS, ids=[t.stem for t in TESTS])
def test_runtime_tests_pass_under_asan_ubsan(objects, test_file, tmp_path):
    exe = tmp_path / test_file.stem
    tests = {t.name for t in TESTS}
    libs = [str(o) for name, o in objects.items() if name not in tests]
    link = subprocess.run([CXX, *FLAGS, str(objects[test_file.name]), *libs, "-pthread", "-o", str(exe)],
                          capture_output=True, text=True)
    assert link.returncode == 0, link.stderr[-4000:]
    env = dict(os.environ,
               ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:strict_string_checks=1:detect_stack_use_after_return=1",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600, env=env)
    report = run.stdout[-3000:] + run.stderr[-6000:]
    assert run.returncode == 0, report
    assert "ERROR: AddressSanitizer" not in run.stderr and "runtime error:" not in run.stderr, report
    assert "[  PASSED  ]" in run.stdout, report
