"""The emulator exposes synchronisation and memory bugs deterministically: fibers run in
thread order until they block, MSLEMU_POISON=1 fills threadgroup memory with NaN at every
threadgroup start, and MSLEMU_STRICT=1 turns Metal UB into a failed dispatch."""
import numpy as np
import pytest


def test_missing_barrier_gives_wrong_rows(load, lenient_env):
    lib = load("buggy")
    x = np.random.default_rng(0).standard_normal((64, 1024)).astype(np.float32)
    y = np.zeros(64, np.float32)
    lib.dispatch_threadgroups("rowmax_missing_barrier", grid=(64,), tg=(256,), buffers=[x, y, np.uint32(1024)])
    # thread 0 reads partial[] before the other simdgroups wrote it
    assert (y != x.max(1)).sum() > 0


def test_vector_casts_convert_values(load, strict_env):
    """(half4) f4 converts values in MSL; in clang a C-style ext-vector cast is a bitcast."""
    lib = load("buggy")
    src = np.random.default_rng(1).standard_normal((16, 4)).astype(np.float32) * 10
    h = np.zeros((16, 4), np.float16)
    iv = np.zeros((16, 4), np.int32)
    lib.dispatch_threads("cast_semantics", threads=(16,), tg=(16,), buffers=[src, h, iv])
    assert np.array_equal(h, src.astype(np.float16))
    assert np.array_equal(iv, src.astype(np.int32) * 2)


def test_poison_reveals_read_of_unwritten_threadgroup_memory(load, monkeypatch):
    lib = load("buggy")
    x = np.random.default_rng(2).standard_normal(6 * 40).astype(np.float32)
    ref = x.reshape(6, 40).sum(1)
    y = np.zeros(6, np.float32)
    monkeypatch.delenv("MSLEMU_POISON", raising=False)
    lib.dispatch_threadgroups("sum_reads_unwritten_tg", grid=(6,), tg=(40,), buffers=[x, y])
    assert np.isfinite(y).all()  # the bug hides: stale threadgroup memory happens to be 0
    assert np.allclose(y, ref, atol=1e-5)
    monkeypatch.setenv("MSLEMU_POISON", "1")
    lib.dispatch_threadgroups("sum_reads_unwritten_tg", grid=(6,), tg=(40,), buffers=[x, y])
    assert np.isnan(y).all()


def test_strict_fails_barrier_after_return(load, monkeypatch):
    lib = load("buggy")
    d = np.zeros(64, np.float32)
    monkeypatch.delenv("MSLEMU_STRICT", raising=False)
    lib.dispatch_threadgroups("barrier_after_return", grid=(1,), tg=(64,), buffers=[d])  # UB, runs anyway
    assert (d[::2] == 1).all()
    monkeypatch.setenv("MSLEMU_STRICT", "1")
    with pytest.raises(RuntimeError, match="after some threads of the threadgroup returned"):
        lib.dispatch_threadgroups("barrier_after_return", grid=(1,), tg=(64,), buffers=[d])


def test_strict_fails_divergent_barrier(load, monkeypatch):
    lib = load("buggy")
    d = np.zeros(2 * 48, np.float32)
    monkeypatch.delenv("MSLEMU_STRICT", raising=False)
    lib.dispatch_threadgroups("divergent_barrier", grid=(2,), tg=(48,), buffers=[d])
    monkeypatch.setenv("MSLEMU_STRICT", "1")
    with pytest.raises(RuntimeError, match="different threadgroup_barrier call sites"):
        lib.dispatch_threadgroups("divergent_barrier", grid=(2,), tg=(48,), buffers=[d])


def test_strict_fails_threadgroup_memory_over_32k(load, monkeypatch):
    lib = load("buggy")
    d = np.zeros(32, np.float32)
    monkeypatch.delenv("MSLEMU_STRICT", raising=False)
    lib.dispatch_threadgroups("threadgroup_memory_too_large", grid=(1,), tg=(32,), buffers=[d])
    assert (d == 1).all()
    monkeypatch.setenv("MSLEMU_STRICT", "1")
    with pytest.raises(RuntimeError, match="over the 32768-byte limit"):
        lib.dispatch_threadgroups("threadgroup_memory_too_large", grid=(1,), tg=(32,), buffers=[d])
    # dynamic [[threadgroup(i)]] lengths are checked before anything runs
    x = np.ones((1, 64), np.float16)
    with pytest.raises(RuntimeError, match="threadgroup memory lengths total"):
        load("softmax").dispatch_threadgroups("softmax_f16x4", grid=(1,), tg=(64,),
                                              buffers=[x, np.zeros_like(x), np.zeros(2, np.uint32)],
                                              threadgroup_memory=[40000])


def test_failed_dispatch_leaves_process_usable(load, strict_env):
    """A kernel failure returns an error; the next dispatch of the same library works."""
    lib = load("buggy")
    with pytest.raises(RuntimeError, match=r"\[\[buffer\(0\)\]\] which was not bound"):
        lib.dispatch_threadgroups("barrier_after_return", grid=(4,), tg=(32,), buffers=[])
    src = np.ones((4, 4), np.float32)
    h = np.zeros((4, 4), np.float16)
    iv = np.zeros((4, 4), np.int32)
    lib.dispatch_threads("cast_semantics", threads=(4,), tg=(4,), buffers=[src, h, iv])
    assert (iv == 2).all()
