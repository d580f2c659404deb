"""Schedule fuzzing (MSLEMU_SCHEDULE=seed): another fiber order every pass, shuffled
threadgroups and, in checked builds, preemption at shared-memory accesses.  Order-dependent
kernels give other results; correct kernels stay bit-identical."""
import numpy as np
import pytest

import mslemu

SEEDS = (1, 2, 3, 4, 5)


def run_last_writer(lib, monkeypatch, seed):
    monkeypatch.setenv("MSLEMU_SCHEDULE", str(seed))
    y = np.zeros(8, np.uint32)
    lib.dispatch_threadgroups("tg_last_writer", (8,), (64,), [y], workers=1)
    return y


def test_fiber_order_changes_with_the_seed_and_is_reproducible(load, monkeypatch):
    lib = load("checked")
    assert run_last_writer(lib, monkeypatch, 0).tolist() == [63] * 8  # in order: the last thread wins
    runs = {s: run_last_writer(lib, monkeypatch, s) for s in SEEDS}
    assert all(((r >= 0) & (r < 64)).all() for r in runs.values())
    assert len({tuple(r) for r in runs.values()}) > 1
    assert any((r != 63).any() for r in runs.values())
    assert np.array_equal(run_last_writer(lib, monkeypatch, 3), runs[3])


def test_threadgroup_order_changes_with_the_seed(load, monkeypatch):
    lib = load("checked")
    orders = []
    for seed in (0,) + SEEDS:
        monkeypatch.setenv("MSLEMU_SCHEDULE", str(seed))
        counter, order = np.zeros(1, np.uint32), np.zeros(64, np.uint32)
        lib.dispatch_threadgroups("arrival_order", (8,), (8,), [counter, order], workers=1)
        assert sorted(order.tolist()) == list(range(64))
        orders.append(order // 8)  # threadgroup of each arrival
    assert orders[0].tolist() == sorted(orders[0].tolist())
    assert any(o.tolist() != sorted(o.tolist()) for o in orders[1:])


def test_checked_builds_preempt_between_shared_accesses(monkeypatch):
    lib = mslemu.Library(mslemu.ROOT + "/kernels/checked.metal", checks=True)

    def gaps(seed):
        monkeypatch.setenv("MSLEMU_SCHEDULE", str(seed))
        counter, t = np.zeros(1, np.uint32), np.zeros((64, 2), np.uint32)
        lib.dispatch_threadgroups("two_tickets", (1,), (64,), [counter, t, np.ones(64, np.uint32)])
        assert sorted(t.ravel().tolist()) == list(range(128))
        return int((t[:, 1] != t[:, 0] + 1).sum())

    assert gaps(0) == 0  # a fiber runs from one barrier to the next unless preempted
    assert sum(gaps(s) for s in SEEDS) > 0


def test_the_race_behind_a_schedule_dependent_result_is_reported(monkeypatch):
    lib = mslemu.Library(mslemu.ROOT + "/kernels/checked.metal", checks=True)
    monkeypatch.setenv("MSLEMU_SCHEDULE", "1")
    with pytest.raises(RuntimeError, match=r"race in kernel `tg_last_writer`.* writes `last`"):
        lib.dispatch_threadgroups("tg_last_writer", (2,), (64,), [np.zeros(2, np.uint32)])


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_sample_kernels_are_bit_identical_under_fuzzed_schedules(seed, monkeypatch):
    lib = mslemu.Library(mslemu.ROOT + "/kernels/softmax.metal", checks=True)
    x = np.random.default_rng(0).standard_normal((5, 300)).astype(np.float32)
    args = np.array([(300, 1.0)], dtype=[("ncols", np.uint32), ("scale", np.float32)])  # SoftmaxArgs
    outs = []
    for s in (0, seed):
        monkeypatch.setenv("MSLEMU_SCHEDULE", str(s))
        y = np.zeros_like(x)
        lib.dispatch_threadgroups("softmax_f32", (5,), (64,), [x, y, args])
        outs.append(y)
    assert outs[0].tobytes() == outs[1].tobytes()
    ref = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(outs[0], ref / ref.sum(1, keepdims=True), rtol=1e-5)
