"""Counting builds (Library(..., accounting=True)): exact counts on kernels with known traffic."""
import numpy as np
import pytest


@pytest.fixture
def counted(load):
    return load("counted", accounting=True)


def test_every_load_counts_and_unique_counts_once(counted, strict_env):
    n = 100
    x, y = np.arange(n, dtype=np.float32), np.zeros(n, np.float32)
    c = counted.dispatch_threads("neighbours", (n,), (32,), [x, y, np.uint32(n)])
    np.testing.assert_array_equal(y, x + np.roll(x, -1))
    assert (c.threads, c.threadgroups, c.simdgroups) == (n, 4, 4)
    bx, by = c.buffers[0], c.buffers[1]
    assert (bx.read, bx.read_unique, bx.written) == (2 * 4 * n, 4 * n, 0)
    # each threadgroup also reads the first float of the next one (the last wraps to x[0])
    assert bx.read_tg_unique == 4 * n + 4 * 4
    assert (by.written, by.written_unique, by.read) == (4 * n, 4 * n, 0)
    c.excluded = (2,)
    assert c.device.read == 2 * 4 * n and c.device.written == 4 * n


def test_simdgroup_matrix_work_counts_once_per_simdgroup(counted, strict_env):
    a = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((8, 8)).astype(np.float32)
    out = np.zeros((8, 8), np.float32)
    c = counted.dispatch_threadgroups("matmul8", (1,), (32,), [a, b, out])
    np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-5)
    assert (c.matrix_loads, c.matrix_stores, c.matrix_macs) == (2, 1, 512)
    assert c.buffers[0].read == 256 and c.buffers[1].read == 256  # not 32 lanes x 256
    assert c.buffers[2].written == 256


def test_barriers_simd_ops_and_threadgroup_memory(counted, strict_env):
    x = np.ones(3 * 64, np.float32)
    out = np.zeros(3, np.float32)
    c = counted.dispatch_threadgroups("tg_sum", (3,), (64,), [x, out])
    np.testing.assert_array_equal(out, [64, 64, 64])
    assert c.barriers_per_thread == 2 and c.simd_ops_per_thread == 1
    assert c.threadgroup_memory == 128  # float[32]
    assert c.threadgroup_written == 3 * 2 * 4  # two simdgroup leaders per threadgroup
    assert c.threadgroup_read == 3 * 2 * 4


def test_normal_builds_return_no_counts(load):
    lib = load("counted")
    x, y = np.ones(4, np.float32), np.zeros(4, np.float32)
    assert lib.dispatch_threads("neighbours", (4,), (4,), [x, y, np.uint32(4)]) is None
    assert lib._lib.mslemu_last_counts() is None


def test_simdgroup_broadcasts_count_once_per_simdgroup(counted, strict_env):
    # `n` is read by every thread: 4 bytes per lane in total, 4 bytes per simdgroup as a
    # broadcast; x[i] and y[i] are distinct per lane, so broadcast and total agree.
    n = 100
    x, y = np.arange(n, dtype=np.float32), np.zeros(n, np.float32)
    c = counted.dispatch_threads("neighbours", (n,), (32,), [x, y, np.uint32(n)])
    assert c.buffers[2].read == 4 * n
    assert c.buffers[2].read_simd == 4 * 4  # 4 simdgroups
    assert c.buffers[0].read_simd == c.buffers[0].read
    assert c.buffers[1].written_simd == c.buffers[1].written


@pytest.mark.parametrize("n, idle", [(64, False), (36, True), (40, True), (96, False)])
def test_lane_use_finds_idle_lanes(counted, strict_env, n, idle):
    x, out = np.arange(n, dtype=np.float32), np.zeros(1, np.float32)
    c = counted.dispatch_threadgroups("strided_sum", (1,), (32,), [x, out, np.uint32(n)])
    assert out[0] == x.sum()
    # lane l loads x[l], x[l + 32], ...: lanes past n % 32 sit out the last pass
    passes = -(-n // 32)
    bx, bn = c.buffers[0], c.buffers[2]
    assert (bx.lane_loads, bx.lane_load_slots) == (n, 32 * passes)
    assert bn.lane_loads == bn.lane_load_slots == 32  # every lane loads n once
    assert (c.lane_use < 1.0) == idle and c.uneven_simdgroups == int(idle)
    assert c.lane_use == pytest.approx((32 + n) / (32 * (1 + passes)))
    c.excluded = (2,)  # a host leaves out its args struct: x alone
    assert c.lane_use == pytest.approx(n / (32 * passes))


def test_lane_use_counts_lanes_missing_from_a_partial_simdgroup(counted, strict_env):
    # 100 threads in threadgroups of 32: the last simdgroup has 4 lanes, 28 idle
    n = 100
    x, y = np.arange(n, dtype=np.float32), np.zeros(n, np.float32)
    c = counted.dispatch_threads("neighbours", (n,), (32,), [x, y, np.uint32(n)])
    bx = c.buffers[0]
    assert bx.lane_loads == 2 * n and bx.lane_load_slots == 4 * 32 * 2
    assert c.lane_use == pytest.approx(100 / 128) and c.uneven_simdgroups == 1
