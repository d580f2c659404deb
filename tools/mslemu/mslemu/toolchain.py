"""mslemu.toolchain: where mslemu lives and which compiler it uses (no heavy imports)."""
import functools
import os
import re
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tools/mslemu
INCLUDE_DIR = os.path.join(ROOT, "include")
STUB_DIR = os.path.join(INCLUDE_DIR, "stub")
MIN_CLANG_MAJOR = 19


def _clang_major(cxx):
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"clang version (\d+)", out)
    return int(m.group(1)) if m else None


@functools.lru_cache(maxsize=None)
def _find_cxx(env_cxx, path_env):
    if env_cxx:
        return env_cxx
    c = shutil.which("clang++-%d" % MIN_CLANG_MAJOR, path=path_env)
    if c:
        return c
    c = shutil.which("clang++", path=path_env)
    if c and (_clang_major(c) or 0) >= MIN_CLANG_MAJOR:
        return c
    raise RuntimeError(
        "mslemu needs clang++ >= %d (ext_vector_type, _Float16, __bf16): install the Debian/Ubuntu package "
        "clang-%d (apt-get install clang-%d) or point MSLEMU_CXX at a clang++ binary"
        % (MIN_CLANG_MAJOR, MIN_CLANG_MAJOR, MIN_CLANG_MAJOR))


def find_cxx():
    """The C++ compiler: $MSLEMU_CXX, else clang++-19, else a clang++ whose major version is >= 19."""
    return _find_cxx(os.environ.get("MSLEMU_CXX", ""), os.environ.get("PATH", os.defpath))


def define_flags(defines):
    """{"N": 4} / ["N=4", "-DM"] -> ["-DN=4", "-DM"]."""
    if not defines:
        return []
    if isinstance(defines, dict):
        return ["-D%s" % k if v is None else "-D%s=%s" % (k, v) for k, v in defines.items()]
    if isinstance(defines, str):
        defines = [defines]
    return [d if d.startswith("-D") else "-D" + d for d in defines]
