"""mslemu.accounting: per-launch counts of a counting build (Library(..., accounting=True)).

A counting build compiles the kernel with clang's address-sanitizer instrumentation in
callback mode (every load and store the optimised code performs calls the runtime) and
-DMSLEMU_ACCOUNTING (barriers, simd-group operations, simdgroup-matrix work).  It is a
separate cached build, so ordinary emulated runs pay nothing.  See include/mslemu/abi.h.
"""
import ctypes
import dataclasses

MAX_BUFFERS = 32

# instrument every access through a call; no stack/global poisoning, no runtime library
FLAGS = ["-DMSLEMU_ACCOUNTING=1", "-fsanitize=address", "-fno-sanitize-address-use-after-scope",
         "-mllvm", "-asan-instrumentation-with-call-threshold=0",
         "-mllvm", "-asan-stack=0", "-mllvm", "-asan-globals=0"]


class _BufferCounts(ctypes.Structure):
    # mirrors mslemu_buffer_counts
    _fields_ = [(n, ctypes.c_uint64) for n in ("read", "written", "read_unique", "written_unique",
                                               "read_tg_unique", "written_tg_unique", "read_simd",
                                               "written_simd", "lane_loads", "lane_load_slots")]


class _Counts(ctypes.Structure):
    # mirrors mslemu_counts
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "threads", "threadgroups", "simdgroups", "threadgroup_memory", "threadgroup_read",
        "threadgroup_written", "barriers", "simd_ops", "matrix_loads", "matrix_stores", "matrix_macs")] + [
        ("n_buffers", ctypes.c_uint32), ("pad_", ctypes.c_uint32),
        ("buffers", _BufferCounts * MAX_BUFFERS), ("uneven_simdgroups", ctypes.c_uint64)]


@dataclasses.dataclass
class BufferCounts:
    """Bytes through one [[buffer(i)]]: every access of every thread, distinct bytes over
    the launch, and distinct bytes per threadgroup summed over threadgroups."""
    read: int = 0
    written: int = 0
    read_unique: int = 0
    written_unique: int = 0
    read_tg_unique: int = 0
    written_tg_unique: int = 0
    read_simd: int = 0        # like read/written, a simdgroup's broadcast load counted once
    written_simd: int = 0
    lane_loads: int = 0       # loads (not bytes) summed over lanes
    lane_load_slots: int = 0  # per simdgroup 32 x its busiest lane's loads, summed

    def __iadd__(self, o):
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(o, f.name))
        return self


@dataclasses.dataclass
class LaunchCounts:
    """What one dispatch did.  `device` sums the buffers not listed in `excluded` (the
    host fills that with the setBytes args struct, which is not device memory)."""
    kernel: str
    threads: int
    threadgroups: int
    simdgroups: int
    threadgroup_memory: int      # bytes per threadgroup (largest)
    threadgroup_read: int
    threadgroup_written: int
    barriers: int                # threadgroup_barrier calls, all threads
    simd_ops: int                # simd collectives + simdgroup_barrier, all threads
    matrix_loads: int            # simdgroup_load, per simdgroup
    matrix_stores: int
    matrix_macs: int             # simdgroup matrix multiply-accumulates (scalar MACs)
    buffers: dict                # [[buffer(i)]] -> BufferCounts
    uneven_simdgroups: int = 0   # simdgroups whose lanes did not all load a buffer equally often
    excluded: tuple = ()         # buffer indices left out of `device` (set by the host)
    slots: dict = dataclasses.field(default_factory=dict)  # [[buffer(i)]] -> host array (host's)

    @property
    def device(self):
        total = BufferCounts()
        for i, b in self.buffers.items():
            if i not in self.excluded:
                total += b
        return total

    @property
    def lane_use(self):
        """Lane utilisation over the buffers in `device`: loads summed over lanes / (32 x the
        busiest lane's loads, per simdgroup and buffer). 1.0: no lane idled while a sibling
        loaded; a lane that sits out one of 2 passes over a buffer costs 1/64."""
        d = self.device
        return d.lane_loads / d.lane_load_slots if d.lane_load_slots else 1.0

    @property
    def barriers_per_thread(self):
        return self.barriers / max(1, self.threads)

    @property
    def simd_ops_per_thread(self):
        return self.simd_ops / max(1, self.threads)


def read_counts(lib, kernel, n_buffers):
    """The last dispatch of `lib` (a ctypes CDLL of a counting build)."""
    p = lib.mslemu_last_counts()
    if not p:
        raise RuntimeError("[mslemu] this library was not built with accounting=True")
    c = ctypes.cast(p, ctypes.POINTER(_Counts)).contents
    bufs = {}
    for i in range(min(n_buffers, c.n_buffers, MAX_BUFFERS)):
        b = c.buffers[i]
        bufs[i] = BufferCounts(*(getattr(b, f) for f, _ in _BufferCounts._fields_))
    scalars = [getattr(c, f) for f, _ in _Counts._fields_[:11]]
    return LaunchCounts(kernel, *scalars, bufs, uneven_simdgroups=c.uneven_simdgroups)
