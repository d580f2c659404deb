"""Metal kernels on a Linux CPU, through the MSL emulator (tools/mslemu).

``load_all()`` builds every ``src/metal/*.metal`` with the emulator (cached
under ~/.cache/mslemu) and registers it with the C++ core, after which ops in
the 'emulated' backend run their Metal kernels. ``run_plan`` executes a
planner's launches directly on NumPy arrays, for kernel tests; with
``counts=[]`` it runs the counting builds and appends one
``mslemu.accounting.LaunchCounts`` per launch (bytes per buffer, barriers,
simd-group work), for traffic budgets and the roofline report.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

_PACKAGE_DIR = Path(__file__).resolve().parent
_REPO_DIR = _PACKAGE_DIR.parents[1]


def metal_source_dir() -> Path:
    """src/metal of a source checkout (editable installs), else the packaged copy."""
    for d in (_REPO_DIR / "src" / "metal", _PACKAGE_DIR / "_metal"):
        if d.is_dir() and any(d.glob("*.metal")):
            return d
    raise FileNotFoundError("no Metal kernel sources found (src/metal or vllm_metal/_metal)")


def _mslemu_root() -> Path:
    for d in (_REPO_DIR / "tools" / "mslemu", _PACKAGE_DIR / "_mslemu"):
        if (d / "mslemu" / "__init__.py").is_file():
            return d
    raise FileNotFoundError("the MSL emulator (tools/mslemu) is not available")


def mslemu_module():
    """The emulator package (tools/mslemu/mslemu), imported from its root."""
    root = str(_mslemu_root())
    if root not in sys.path:
        sys.path.insert(0, root)
    import mslemu

    return mslemu


def kernel_sources() -> list[str]:
    """Stems of all .metal files, e.g. ['reshape_and_cache', 'rms_norm']."""
    return sorted(p.stem for p in metal_source_dir().glob("*.metal"))


@functools.lru_cache(maxsize=None)
def library(source: str):
    """The emulator build of src/metal/<source>.metal (an mslemu.Library)."""
    path = metal_source_dir() / f"{source}.metal"
    if not path.is_file():
        raise FileNotFoundError(f"no kernel source {path}")
    return mslemu_module().Library(str(path))


@functools.lru_cache(maxsize=None)
def counting_library(source: str):
    """The counting build of src/metal/<source>.metal (slower; see mslemu.accounting)."""
    path = metal_source_dir() / f"{source}.metal"
    if not path.is_file():
        raise FileNotFoundError(f"no kernel source {path}")
    return mslemu_module().Library(str(path), accounting=True)


def load(source: str) -> None:
    from vllm_metal import _core

    if not _core.has_emulated_library(source):
        _core.register_emulated_library(source, library(source).so_path)


@functools.lru_cache(maxsize=None)
def build_all() -> None:
    """Builds (or finds in the cache) the emulator library of every kernel source, sharing
    the work with other processes doing the same: a source whose build lock another process
    holds is left to it and waited for at the end. On a cold cache, processes that load at
    once (pytest workers, servers started together) would otherwise each compile all ~17
    sources at the same time, tens of seconds each. A lock is one file per source in the
    cache directory; builds land in the cache atomically whether or not it is held."""
    import fcntl

    root = Path(mslemu_module().default_cache_dir())
    root.mkdir(parents=True, exist_ok=True)
    busy = []
    for source in kernel_sources():
        lock = open(root / f".{source}.build-lock", "w")  # closing it releases the lock
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            busy.append((source, lock))
            continue
        with lock:
            library(source)
    for source, lock in busy:
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the other process's build is in the cache now
            library(source)


def load_all() -> None:
    build_all()
    for source in kernel_sources():
        load(source)


def run_plan(plan: Sequence, arrays: Sequence[np.ndarray], counts: list | None = None) -> None:
    """Executes launches from a ``_core.plan_*`` planner on NumPy arrays.

    ``arrays[slot]`` backs ``BufferBinding.array_slot``; outputs are written in
    place, so they must be C-contiguous and writable. With a ``counts`` list,
    each launch's LaunchCounts is appended to it; its ``device`` totals leave
    out the args struct (setBytes, not device memory) and ``slots`` maps
    [[buffer(i)]] -> array slot.
    """
    for launch in plan:
        lib = library(launch.source) if counts is None else counting_library(launch.source)
        for c in launch.constants:
            lib.set_function_constant(c.index, _constant_value(c))
        buffers: dict[int, object] = {}
        for b in launch.buffers:
            a = arrays[b.array_slot]
            if not a.flags["C_CONTIGUOUS"]:
                raise ValueError(f"array slot {b.array_slot} must be C-contiguous")
            view = a.reshape(-1).view(np.uint8)[b.byte_offset :]
            buffers[b.index] = view
        if launch.args:
            buffers[launch.args_index] = bytes(launch.args)
        record = lib.dispatch_threadgroups(
            launch.kernel,
            grid=tuple(launch.grid),
            tg=tuple(launch.threadgroup),
            buffers=buffers,
            threadgroup_memory=list(launch.threadgroup_memory),
        )
        if counts is not None:
            record.excluded = (launch.args_index,) if launch.args else ()
            record.slots = {b.index: b.array_slot for b in launch.buffers}
            counts.append(record)


def _constant_value(c):
    bits = np.array([c.bits], dtype=np.uint32)
    return {
        "bool": np.bool_(c.bits != 0),
        "int32": bits.view(np.int32)[0],
        "uint32": bits[0],
        "float32": bits.view(np.float32)[0],
    }[c.type]


def emulator_available() -> bool:
    try:
        mslemu_module().find_cxx()
        return True
    except Exception:
        return False


