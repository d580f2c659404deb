"""host_memory.keep_freed_memory: a large freed block stays in the process for reuse
(glibc), where by default glibc unmaps it on free. Each case runs in a fresh interpreter:
the setting is process-wide."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Allocates 96 MB with libc's malloc, writes every page, frees it, and prints how much of
# it the process still holds (resident set before the free minus after, in MB, negated).
_PROBE = """
import ctypes, ctypes.util, os, sys
if sys.argv[1] == "keep":
    from vllm_metal.host_memory import keep_freed_memory
    assert keep_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * page
n = 96 << 20
p = libc.malloc(n)
ctypes.memset(p, 1, n)
touched = rss()
libc.free(p)
print((n - (touched - rss())) / (1 << 20))
"""


def _held_after_free(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt (Linux only)")
def test_a_freed_large_block_is_kept_only_when_asked():
    assert _held_after_free("default") < 8  # glibc hands the 96 MB back on free (munmap)
    assert _held_after_free("keep") > 88  # kept in the heap for the next step's buffers
