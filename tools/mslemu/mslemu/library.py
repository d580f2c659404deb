"""mslemu.library: build a .metal file with the CPU shim and dispatch its kernels on
NumPy buffers.

    lib = mslemu.Library("kernels/softmax.metal")
    lib.dispatch_threadgroups("softmax_f32", grid=(rows, 1, 1), tg=(256, 1, 1),
                              buffers=[x, y, SoftmaxArgs(cols, 1.0)])

Buffers are passed by pointer: numpy arrays (must be C-contiguous; the kernel
writes into them in place), numpy scalars / python ints+floats (boxed into a
1-element array: use np.uint32 / np.float32 etc. to choose the type), bytes,
or ctypes.Structure / ctypes arrays (for `constant Params& p [[buffer(n)]]`).

Compiled libraries are cached in $MSLEMU_CACHE_DIR (default ~/.cache/mslemu), one
directory per hash of (sources, included headers, shim, generator, compiler, flags).
A build goes to a temporary directory that is renamed into place, so concurrent
processes (pytest-xdist) building the same kernel never see a half-written library.
"""
import ctypes
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np

from . import accounting as _accounting
from . import gen, toolchain

BASE_FLAGS = ["-std=c++17", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden",
              "-Xclang", "-ffloat16-excess-precision=none",
              "-Wno-unknown-attributes", "-Wno-unused-parameter", "-Wno-duplicate-decl-specifier"]

# checked builds: the counting builds' instrumentation, calling include/mslemu/checks.h
CHECK_FLAGS = ["-DMSLEMU_CHECKS=1"] + [f for f in _accounting.FLAGS if f != "-DMSLEMU_ACCOUNTING=1"]

# error codes of the C ABI (include/mslemu/runtime.h)
E_NO_KERNEL, E_FC_SIZE, E_LAUNCH, E_KERNEL = -1, -2, -3, -4

# MSL scalar type of a function constant -> numpy dtype, to box plain Python values
_FC_DTYPES = {
    "bool": np.bool_, "char": np.int8, "int8_t": np.int8, "uchar": np.uint8, "uint8_t": np.uint8,
    "short": np.int16, "int16_t": np.int16, "ushort": np.uint16, "uint16_t": np.uint16,
    "int": np.int32, "int32_t": np.int32, "uint": np.uint32, "uint32_t": np.uint32,
    "long": np.int64, "int64_t": np.int64, "ulong": np.uint64, "uint64_t": np.uint64, "size_t": np.uint64,
    "half": np.float16, "float": np.float32,
}


class BuildError(RuntimeError):
    """clang++ rejected the generated translation unit."""


class _Launch(ctypes.Structure):
    # mirrors struct mslemu_launch in include/mslemu/runtime.h
    _fields_ = [("buffers", ctypes.POINTER(ctypes.c_void_p)),
                ("buffer_sizes", ctypes.POINTER(ctypes.c_uint64)),
                ("n_buffers", ctypes.c_uint32),
                ("tg_mem_len", ctypes.POINTER(ctypes.c_uint64)),
                ("n_tg_mem", ctypes.c_uint32),
                ("grid", ctypes.c_uint32 * 3),
                ("tg", ctypes.c_uint32 * 3),
                ("nonuniform", ctypes.c_uint32),
                ("n_workers", ctypes.c_uint32)]


class _FunctionConstant(ctypes.Structure):
    # mirrors struct mslemu_function_constant
    _fields_ = [("index", ctypes.c_char_p), ("value", ctypes.c_void_p), ("size", ctypes.c_ulong)]


def default_cache_dir():
    """Root of the build cache: $MSLEMU_CACHE_DIR, default ~/.cache/mslemu."""
    return os.environ.get("MSLEMU_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "mslemu")


def _dims(d, what):
    d = tuple(int(x) for x in (d if isinstance(d, (tuple, list)) else (d,)))
    if not 1 <= len(d) <= 3:
        raise ValueError("%s must have 1 to 3 dimensions, got %r" % (what, d))
    if any(x < 1 or x >= 1 << 32 for x in d):
        raise ValueError("%s dimensions must be in [1, 2**32), got %r (skip empty dispatches)" % (what, d))
    return (d + (1, 1, 1))[:3]


@functools.lru_cache(maxsize=None)
def _compiler_id(cxx):
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError("cannot run the C++ compiler %r: %s" % (cxx, e)) from None


def _deps(path, include_dirs, seen=None):
    """Headers a .metal file includes, found the way the preprocessor would: "x" next to
    the including file, then in include_dirs; <x> in include_dirs (system headers and
    the <metal_*> stubs are not followed).  Includes in inactive #if branches are
    counted too, which only makes the cache key more conservative."""
    seen = set() if seen is None else seen
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    for m in re.finditer(r'^\s*#\s*include\s*([<"])([^">]+)[">]', text, re.M):
        dirs = ([os.path.dirname(path)] if m.group(1) == '"' else []) + list(include_dirs)
        for d in dirs:
            c = os.path.abspath(os.path.join(d, m.group(2)))
            if os.path.isfile(c):
                if c not in seen:
                    seen.add(c)
                    _deps(c, include_dirs, seen)
                break
    return seen


def _tool_files():
    files = []
    for dirpath, _, names in os.walk(gen.INCLUDE_DIR):
        files += [os.path.join(dirpath, n) for n in names]
    return sorted(files) + [os.path.abspath(gen.__file__), os.path.abspath(toolchain.__file__)]


def _box_buffer(b):
    """-> (object to keep alive, address, size in bytes); (None, None, 0) for an unbound slot."""
    if b is None:
        return None, None, 0
    if isinstance(b, (ctypes.Structure, ctypes.Union, ctypes.Array)):
        return b, ctypes.addressof(b), ctypes.sizeof(b)
    if isinstance(b, (bytes, bytearray)):
        a = np.frombuffer(bytearray(b), dtype=np.uint8)
    elif isinstance(b, np.ndarray):
        if not b.flags["C_CONTIGUOUS"]:
            raise ValueError("buffer arrays must be C-contiguous (kernel writes in place)")
        a = b
    elif isinstance(b, (np.generic, int, float)):
        a = np.array([b])
    else:
        raise TypeError("unsupported buffer type %r" % type(b))
    return a, a.ctypes.data, a.nbytes


class Library:
    """One compiled .metal file.  Attributes: metal_path, so_path, meta
    ({"kernels": {host name: [(kind, index or builtin), ...]}, "function_constants": [...]}),
    kernels (sorted host names).

    accounting=True builds a separate, slower counting variant: every dispatch then runs
    on one worker thread and returns an mslemu.accounting.LaunchCounts record.
    checks=True builds the checked variant (include/mslemu/checks.h): out-of-bounds
    accesses, threadgroup-memory races and device write-write races fail the dispatch;
    the default is $MSLEMU_CHECKS (when not counting)."""

    def __init__(self, metal_path, include_dirs=(), defines=None, *, opt="-O2", extra_flags=(), cxx=None,
                 cache_dir=None, accounting=False, checks=None):
        self.metal_path = os.path.abspath(metal_path)
        if not os.path.isfile(self.metal_path):
            raise FileNotFoundError(self.metal_path)
        cxx = cxx or gen.find_cxx()
        include_dirs = [os.path.abspath(d) for d in include_dirs]
        defs = gen.define_flags(defines)
        flags = BASE_FLAGS + [opt, "-I", gen.INCLUDE_DIR, "-I", os.path.dirname(self.metal_path)] + list(extra_flags)
        self.accounting = bool(accounting)
        if checks is None:
            checks = not self.accounting and os.environ.get("MSLEMU_CHECKS", "0") not in ("", "0")
        if checks and self.accounting:
            raise ValueError("a build either counts (accounting=True) or checks (checks=True), not both")
        self.checks = bool(checks)
        if self.accounting:
            flags += _accounting.FLAGS
        if self.checks:
            flags += CHECK_FLAGS
        key = hashlib.sha256()
        for p in [self.metal_path] + sorted(_deps(self.metal_path, include_dirs)) + _tool_files():
            key.update(p.encode() + b"\0")
            with open(p, "rb") as f:
                key.update(f.read())
        key.update("\0".join([cxx, _compiler_id(cxx)] + flags + defs + include_dirs).encode())
        name = "%s.%s" % (os.path.basename(self.metal_path), key.hexdigest()[:20])
        root = cache_dir or default_cache_dir()
        self.build_dir = os.path.join(root, name)
        self.so_path = os.path.join(self.build_dir, "kernels.so")
        if not os.path.exists(self.so_path):
            self._build(root, name, include_dirs, defs, flags, cxx)
        with open(os.path.join(self.build_dir, "kernels.json")) as f:
            self.meta = json.load(f)
        self._fc_types = {fc["index"]: fc["type"] for fc in self.meta["function_constants"]}
        # Loading the same path twice returns the same handle: Library objects of one
        # build share its function-constant values.
        self._lib = ctypes.CDLL(self.so_path)
        L = self._lib
        L.mslemu_dispatch.argtypes = [ctypes.c_char_p, ctypes.POINTER(_Launch)]
        L.mslemu_dispatch.restype = ctypes.c_int
        L.mslemu_dispatch_fc.argtypes = [ctypes.c_char_p, ctypes.POINTER(_Launch),
                                         ctypes.POINTER(_FunctionConstant), ctypes.c_uint32]
        L.mslemu_dispatch_fc.restype = ctypes.c_int
        L.mslemu_set_function_constant.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_ulong]
        L.mslemu_set_function_constant.restype = ctypes.c_int
        L.mslemu_kernel_name.argtypes = [ctypes.c_int]
        L.mslemu_kernel_name.restype = ctypes.c_char_p
        L.mslemu_last_error.argtypes = []
        L.mslemu_last_error.restype = ctypes.c_char_p
        L.mslemu_last_counts.argtypes = []
        L.mslemu_last_counts.restype = ctypes.c_void_p

    def _build(self, root, name, include_dirs, defs, flags, cxx):
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=name + ".tmp-", dir=root)
        try:
            glue, _ = gen.generate(self.metal_path, tmp, include_dirs, defs, cxx)
            cmd = [cxx] + flags + [glue, "-o", os.path.join(tmp, "kernels.so")]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise BuildError("[mslemu] compiling %s failed:\n%s\n%s" % (self.metal_path, " ".join(cmd), r.stderr))
            for attempt in range(2):
                try:
                    os.rename(tmp, self.build_dir)  # atomic; fails if the directory exists
                    return
                except OSError:
                    if os.path.exists(self.so_path):
                        return  # another process finished the same build first
                    if attempt == 0 and os.path.isdir(self.build_dir):
                        # an incomplete entry (someone deleted files by hand): move it aside
                        trash = tempfile.mkdtemp(prefix=name + ".stale-", dir=root)
                        try:
                            os.rename(self.build_dir, os.path.join(trash, "x"))
                        except OSError:
                            pass
                        shutil.rmtree(trash, ignore_errors=True)
                    else:
                        raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    @property
    def kernels(self):
        return sorted(self.meta["kernels"])

    def _last_error(self):
        return (self._lib.mslemu_last_error() or b"").decode(errors="replace")

    def _fc_value(self, index, value):
        if isinstance(value, (np.ndarray, np.generic)):
            return np.ascontiguousarray(value)
        dt = _FC_DTYPES.get(self._fc_types.get(str(index), ""))
        return np.ascontiguousarray(np.asarray(value, dtype=dt))

    def _check_fc_result(self, r, index):
        if r == E_NO_KERNEL:
            raise KeyError("no [[function_constant(%s)]] in %s (have %s)"
                           % (index, self.metal_path, sorted(self._fc_types)))
        if r:
            raise ValueError("[mslemu] function constant %s: %s" % (index, self._last_error()))

    def set_function_constant(self, index, value):
        """Set [[function_constant(index)]] for later dispatches.  Plain Python values are
        converted to the constant's declared type; numpy values must have its exact size."""
        arr = self._fc_value(index, value)
        r = self._lib.mslemu_set_function_constant(str(index).encode(), arr.ctypes.data, arr.nbytes)
        self._check_fc_result(r, index)

    def _launch(self, name, grid, tg, buffers, threadgroup_memory, nonuniform, workers, function_constants):
        if name not in self.meta["kernels"]:
            raise KeyError("no kernel %r in %s (have %s)" % (name, self.metal_path, self.kernels))
        if isinstance(buffers, dict):
            n = max(buffers) + 1 if buffers else 0
            blist = [buffers.get(i) for i in range(n)]
        else:
            blist = list(buffers)
        keep, ptrs, sizes = [], [], []
        for b in blist:
            obj, ptr, size = _box_buffer(b)
            keep.append(obj)
            ptrs.append(ptr)
            sizes.append(size)
        tgm = [int(x) for x in (threadgroup_memory or [])]
        L = _Launch()
        bufarr = (ctypes.c_void_p * max(1, len(ptrs)))(*ptrs)
        szarr = (ctypes.c_uint64 * max(1, len(sizes)))(*sizes)
        tgarr = (ctypes.c_uint64 * max(1, len(tgm)))(*tgm)
        L.buffers, L.buffer_sizes, L.n_buffers = bufarr, szarr, len(ptrs)
        L.tg_mem_len, L.n_tg_mem = tgarr, len(tgm)
        L.grid[:] = _dims(grid, "threads" if nonuniform else "grid")
        L.tg[:] = _dims(tg, "tg")
        L.nonuniform = 1 if nonuniform else 0
        L.n_workers = workers
        if function_constants:
            vals = [(str(i), self._fc_value(i, v)) for i, v in function_constants.items()]
            fcs = (_FunctionConstant * len(vals))(
                *[_FunctionConstant(i.encode(), a.ctypes.data, a.nbytes) for i, a in vals])
            r = self._lib.mslemu_dispatch_fc(name.encode(), ctypes.byref(L), fcs, len(vals))
            if r == E_NO_KERNEL:
                raise KeyError("[mslemu] %s (have %s)" % (self._last_error(), sorted(self._fc_types)))
            if r == E_FC_SIZE:
                raise ValueError("[mslemu] %s" % self._last_error())
        else:
            r = self._lib.mslemu_dispatch(name.encode(), ctypes.byref(L))
        if r:
            raise RuntimeError("[mslemu] dispatch of %s failed (%d): %s" % (name, r, self._last_error()))
        if self.accounting:
            return _accounting.read_counts(self._lib, name, len(ptrs))
        return None

    def dispatch_threadgroups(self, name, grid, tg, buffers, threadgroup_memory=None, workers=0,
                              function_constants=None):
        """MTLComputeCommandEncoder.dispatchThreadgroups(grid, threadsPerThreadgroup: tg).
        function_constants={index: value} sets them and dispatches atomically (thread-safe).
        Returns a LaunchCounts record in a counting build (accounting=True), else None."""
        return self._launch(name, grid, tg, buffers, threadgroup_memory, False, workers, function_constants)

    def dispatch_threads(self, name, threads, tg, buffers, threadgroup_memory=None, workers=0,
                         function_constants=None):
        """MTLComputeCommandEncoder.dispatchThreads(threads, threadsPerThreadgroup: tg) (non-uniform)."""
        return self._launch(name, threads, tg, buffers, threadgroup_memory, True, workers, function_constants)
