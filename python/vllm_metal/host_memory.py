"""Freed host memory kept for reuse (Linux, glibc) rather than handed back to the kernel.

MLX's CPU backend gets each array's buffer from malloc and frees it when the array goes:
an encoder forward at 32 x 512 tokens allocates and frees dozens of buffers of 25-100 MB.
glibc serves blocks that large with mmap and munmaps them on free (its threshold rises
to at most 32 MB), and trims the heap's free top past 128 KB, so every step faults its
buffers in again, each page zeroed by the kernel: 0.6 s of kernel time a 32 x 512
MiniLM forward, ~14 % of its CPU time (docs/benchmarks.md). With both thresholds
raised, freed blocks stay in the heap and the next step reuses them; the process keeps
its peak footprint (+270 MB at 32 x 512) instead of returning it between steps.

macOS has no mallopt and MLX's Metal allocator keeps its own buffer cache: a no-op there,
as under another C library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# the largest value mallopt takes (an int); no buffer of a step comes near it
_KEEP = 2**31 - 1


def keep_freed_memory() -> bool:
    """Raises glibc's mmap and trim thresholds for this process; True if it did."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    kept_mapped = bool(mallopt(_M_MMAP_THRESHOLD, _KEEP))  # a glibc may refuse so high a value
    kept_trimmed = bool(mallopt(_M_TRIM_THRESHOLD, _KEEP))
    return kept_mapped and kept_trimmed
