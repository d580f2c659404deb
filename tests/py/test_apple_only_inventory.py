"""The code no Linux test runs: found by scanning, kept small, listed in docs, read by a compiler.

Apple-only code is whole files under src/cpp/metal/ plus the branches guarded by
VLLM_METAL_HAS_METAL / __APPLE__ (C++) and if(APPLE) / if(VLLM_METAL_HAS_METAL) (CMake).
docs/kernels.md lists each file ("Apple-only code" section); every C++ line of it is
type-checked here (tools/apple_check, or the aarch64 cross syntax check below).
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 300  # lines of code only a Mac runs (DESIGN: "a few dozen lines of encoder code")
DOC = ROOT / "docs" / "kernels.md"

sys.path.insert(0, str(ROOT / "tools" / "apple_check"))
import check_host_code  # noqa: E402

CPP_OPEN = re.compile(r"^\s*#\s*(?:ifdef\s+VLLM_METAL_HAS_METAL|if\s+defined\(__APPLE__\))")
CMAKE_OPEN = re.compile(r"^\s*if\s*\(\s*(?:APPLE|VLLM_METAL_HAS_METAL)\s*\)", re.I)


def _cpp_regions(lines):
    """(first, last) 1-based line ranges of the Apple branch of each #if (to #else/#elif/#endif)."""
    out = []
    for i, line in enumerate(lines):
        if not CPP_OPEN.match(line):
            continue
        depth = 0
        for j in range(i + 1, len(lines)):
            t = lines[j].strip()
            if re.match(r"#\s*if", t):
                depth += 1
            elif re.match(r"#\s*endif", t) and depth:
                depth -= 1
            elif depth == 0 and re.match(r"#\s*(else|elif|endif)", t):
                out.append((i + 1, j + 1))
                break
    return out


def _cmake_regions(lines):
    out = []
    for i, line in enumerate(lines):
        if not CMAKE_OPEN.match(line):
            continue
        depth = 0
        for j in range(i + 1, len(lines)):
            t = lines[j].strip().lower()
            if re.match(r"if\s*\(", t):
                depth += 1
            elif re.match(r"endif\s*\(", t) and depth:
                depth -= 1
            elif depth == 0 and re.match(r"(else|elseif|endif)\s*\(", t):
                out.append((i + 1, j + 1))
                break
    return out


def apple_only_code():
    """{path relative to the repo: lines only a Mac compiles or runs}."""
    found = {}
    for p in sorted((ROOT / "src" / "cpp" / "metal").rglob("*")):
        if p.is_file():
            found[p.relative_to(ROOT).as_posix()] = len(p.read_text().splitlines())
    for p in sorted((ROOT / "src").rglob("*")):
        if p.suffix in (".cpp", ".h", ".mm") and "metal" not in p.relative_to(ROOT / "src").parts[:2]:
            regions = _cpp_regions(p.read_text().splitlines())
            if regions:
                found[p.relative_to(ROOT).as_posix()] = sum(b - a - 1 for a, b in regions)
    cm = ROOT / "CMakeLists.txt"
    regions = _cmake_regions(cm.read_text().splitlines())
    found["CMakeLists.txt"] = sum(b - a - 1 for a, b in regions)
    return found


def test_apple_only_code_is_small():
    found = apple_only_code()
    total = sum(found.values())
    assert "src/cpp/metal/encoder.cpp" in found
    assert total <= LIMIT, f"{total} lines only a Mac runs (limit {LIMIT}): {found}"


def test_every_apple_only_file_is_listed_in_docs():
    section = DOC.read_text().split("## Apple-only code", 1)
    assert len(section) == 2, "docs/kernels.md has no '## Apple-only code' section"
    text = section[1].split("\n## ", 1)[0]
    missing = [p for p in apple_only_code() if f"`{p}`" not in text]
    assert not missing, f"docs/kernels.md 'Apple-only code' does not list {missing}"


def test_scanner_finds_apple_branches():
    # the scanner itself: an #ifdef branch up to #else, nested #if skipped, CMake if/else
    src = ["a", "#ifdef VLLM_METAL_HAS_METAL", "x", "#if Y", "z", "#endif", "y", "#else", "b", "#endif"]
    assert _cpp_regions(src) == [(2, 8)]
    cm = ["if(APPLE)", "  set(A 1)", "  if(B)", "  endif()", "else()", "endif()"]
    assert _cmake_regions(cm) == [(1, 5)]


def test_cpp_files_with_apple_code_are_compiled_by_a_check():
    """encoder.cpp and kernel_primitive.cpp: tools/apple_check (test_apple_host_code.py);
    any other file: the aarch64 cross syntax check below."""
    checked = {p.relative_to(ROOT).as_posix() for p in check_host_code.default_sources()}
    others = [p for p in apple_only_code() if p.startswith("src/") and p not in checked]
    for p in others:
        assert p in CROSS_CHECKED, f"{p} has Apple-only C++ no check compiles; add it here"


# Files whose Apple branch is plain C++ (no Apple headers): parsed for arm64 with __APPLE__.
CROSS_CHECKED = ["src/cpp/cpu/gguf_matmul.cpp"]


@pytest.mark.parametrize("path", CROSS_CHECKED)
def test_apple_branches_of_cpu_code_type_check(path):
    cxx = shutil.which("clang++-19") or shutil.which("clang++")
    if not cxx or not Path("/usr/aarch64-linux-gnu/include").is_dir():
        pytest.skip("needs clang and the aarch64 cross headers (g++-aarch64-linux-gnu)")
    cmd = [cxx, "--target=aarch64-linux-gnu", "-std=c++17", "-fsyntax-only", "-D__APPLE__=1",
           "-Wall", "-Wextra", "-Werror", "-I", str(ROOT / "src" / "cpp"), "-I", str(ROOT / "src" / "metal"),
           str(ROOT / path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
