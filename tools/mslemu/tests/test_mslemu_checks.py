"""Checked builds (include/mslemu/checks.h): races and out-of-bounds accesses fail the
dispatch with a message naming kernel, buffer or variable, offset and threads."""
import mmap

import numpy as np
import pytest

import mslemu


@pytest.fixture(scope="module")
def lib():
    return mslemu.Library(mslemu.ROOT + "/kernels/checked.metal", checks=True)


def dispatch(lib, name, grid, tg, buffers, **kw):
    lib.dispatch_threadgroups(name, grid, tg, buffers, **kw)


def test_missing_barrier_is_a_race_naming_variable_and_threads(lib):
    x = np.arange(128, dtype=np.float32)
    y = np.zeros(2, np.float32)
    with pytest.raises(RuntimeError, match=r"threadgroup memory race in kernel `tg_sum`, threadgroup 0,0,0: "
                                           r"thread 1 .* writes `part` .* byte offset 4 .* which thread 0 .* read"):
        dispatch(lib, "tg_sum", (2,), (64,), [x, y, np.uint32(0)])
    dispatch(lib, "tg_sum", (2,), (64,), [x, y, np.uint32(1)])
    assert y.tolist() == [x[:64].sum(), x[64:].sum()]


@pytest.mark.parametrize("mode", [2, 3], ids=["mem_none", "mem_device"])
def test_barrier_without_mem_threadgroup_does_not_order_threadgroup_memory(lib, mode):
    x = np.arange(128, dtype=np.float32)
    with pytest.raises(RuntimeError, match=r"thread 0 .* reads `part` .* which thread 1 .* wrote"):
        dispatch(lib, "tg_sum", (2,), (64,), [x, np.zeros(2, np.float32), np.uint32(mode)])


def test_simdgroup_barrier_orders_lanes_of_one_simdgroup(lib):
    y = np.zeros(32, np.float32)
    dispatch(lib, "simd_rotate", (1,), (32,), [y, np.uint32(1)])
    assert y.tolist() == [float((t + 1) % 32) for t in range(32)]
    for mode in (0, 2):  # no barrier; a simdgroup_barrier without mem_threadgroup
        with pytest.raises(RuntimeError, match="threadgroup memory race in kernel `simd_rotate`"):
            dispatch(lib, "simd_rotate", (1,), (32,), [y, np.uint32(mode)])


def test_write_after_another_threads_read_is_a_race(lib):
    with pytest.raises(RuntimeError, match=r"thread 1 .* writes `v` .* byte offset 0 .* which thread 0 .* read"):
        dispatch(lib, "tg_write_after_read", (1,), (32,), [np.zeros(32, np.float32)])


@pytest.mark.parametrize("shift, where", [(1, r"byte offset 64 \(4-byte access: index 16\), thread 7 .* "
                                              r"of threadgroup 1,0,0"),
                                          (-1, r"byte offset -4 \(4-byte access: index -1\), thread 0 .* "
                                               r"of threadgroup 0,0,0")])
def test_out_of_bounds_device_read(lib, shift, where):
    x = np.arange(16, dtype=np.float32)
    y = np.zeros(16, np.float32)
    with pytest.raises(RuntimeError, match=r"out-of-bounds device read in kernel `shifted_copy`: "
                                           r"\[\[buffer\(0\)\]\] \(64 bytes\) at " + where):
        lib.dispatch_threads("shifted_copy", (16,), (8,), [x, y, np.int32(shift)])
    lib.dispatch_threads("shifted_copy", (16,), (8,), [x, y, np.int32(0)])
    assert np.array_equal(x, y)


def test_out_of_bounds_write_never_reaches_host_memory(lib):
    backing = np.full(48, 7.0, np.float32)
    y = backing[16:32]
    with pytest.raises(RuntimeError, match=r"out-of-bounds device write in kernel `shifted_store`: "
                                           r"\[\[buffer\(0\)\]\] \(64 bytes\) at byte offset 64"):
        lib.dispatch_threads("shifted_store", (16,), (8,), [y, np.int32(1)])
    assert (backing[:16] == 7).all() and (backing[32:] == 7).all()


def test_out_of_bounds_threadgroup_accesses(lib):
    y = np.zeros(32, np.float32)
    with pytest.raises(RuntimeError, match=r"out-of-bounds threadgroup write in kernel `tg_overflow`: byte offset 64 "
                                           r"\(4-byte access\) is past the 64 bytes of threadgroup variables"):
        dispatch(lib, "tg_overflow", (1,), (32,), [y])
    with pytest.raises(RuntimeError, match=r"out-of-bounds threadgroup write in kernel `dyn_tg_overflow`: "
                                           r"\[\[threadgroup\(0\)\]\] \(64 bytes\) at byte offset 64"):
        dispatch(lib, "dyn_tg_overflow", (1,), (32,), [y], threadgroup_memory=[64])
    dispatch(lib, "dyn_tg_overflow", (1,), (32,), [y], threadgroup_memory=[128])
    assert (y == 1).all()


def test_device_write_write_race(lib):
    y = np.zeros(64, np.uint32)
    lib.dispatch_threads("scatter", (64,), (32,), [y, np.uint32(64)])
    assert y.tolist() == list(range(64))
    with pytest.raises(RuntimeError, match=r"device memory race in kernel `scatter`: \[\[buffer\(0\)\]\] byte offset 0 "
                                           r"is written by thread 0 of threadgroup 0,0,0 and by thread 16 of "
                                           r"threadgroup 0,0,0"):
        lib.dispatch_threads("scatter", (64,), (32,), [y, np.uint32(16)])
    with pytest.raises(RuntimeError, match=r"thread 0 of threadgroup 0,0,0 and by thread 0 of threadgroup 1,0,0$"):
        lib.dispatch_threads("scatter", (64,), (32,), [y, np.uint32(32)])


def test_atomics_are_not_races(lib):
    counter = np.zeros(1, np.uint32)
    order = np.zeros(96, np.uint32)
    lib.dispatch_threads("arrival_order", (96,), (32,), [counter, order])
    assert counter[0] == 96 and sorted(order.tolist()) == list(range(96))


def test_aliased_bindings_share_one_copy(lib, load):
    plain = load("checked")
    results = []
    for L in (lib, plain):
        a = np.arange(17, dtype=np.float32)
        L.dispatch_threads("shifted_copy", (16,), (16,), [a[1:], a[:-1], np.int32(0)])
        results.append(a)
    assert np.array_equal(results[0], results[1])
    assert results[0].tolist() == list(range(1, 17)) + [16]


def test_normal_builds_do_not_check(load):
    plain = load("checked")
    assert not plain.checks
    x = np.arange(128, dtype=np.float32)
    plain.dispatch_threadgroups("tg_sum", (2,), (64,), [x, np.zeros(2, np.float32), np.uint32(0)])


def test_env_selects_checked_builds(monkeypatch):
    monkeypatch.setenv("MSLEMU_CHECKS", "1")
    assert mslemu.Library(mslemu.ROOT + "/kernels/checked.metal").checks
    assert not mslemu.Library(mslemu.ROOT + "/kernels/checked.metal", checks=False).checks


def test_read_only_inputs_are_not_written_back(lib):
    """Only buffers the kernel wrote are copied back: an input may be read-only memory
    (a write there would kill the process)."""
    mem = mmap.mmap(-1, 64, prot=mmap.PROT_READ)  # zeros, read-only pages
    x = np.frombuffer(mem, np.float32)
    y = np.ones(16, np.float32)
    lib.dispatch_threads("shifted_copy", (16,), (8,), [x, y, np.int32(0)])
    assert (y == 0).all()
