"""The hybrid ops' Metal launches executed on NumPy arrays (emulator), with guard values
around every output: results equal the NumPy references and nothing outside the outputs
(nor the slots not in the batch) is written."""

from __future__ import annotations

import numpy as np
import pytest

import hybrid_reference as ref
from vllm_metal import _core, emulation

GUARD = 64
SENTINEL = 12345.0


def guarded(shape, dtype, fill=None):
    """(view, backing): a C-contiguous view with GUARD sentinel elements each side."""
    n = int(np.prod(shape))
    backing = np.full(n + 2 * GUARD, SENTINEL, dtype=dtype)
    view = backing[GUARD:GUARD + n].reshape(shape)
    if fill is not None:
        view[...] = fill
    return view, backing


def guards_intact(backing):
    return np.all(backing[:GUARD] == SENTINEL) and np.all(backing[-GUARD:] == SENTINEL)


@pytest.mark.parametrize("copy_state", [True, False], ids=["copy", "inplace"])
def test_gated_delta_launches(copy_state):
    rng = np.random.default_rng(1)
    lengths, hk, hv, dk, dv, num_slots = (3, 1, 0, 5), 2, 4, 40, 6, 6  # dv 6: a partial group
    cu = ref.cu_seqlens_of(lengths)
    t, n = int(cu[-1]), len(lengths)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    q, k, v, a, b = f(t, hk, dk), f(t, hk, dk), f(t, hv, dv), f(t, hv), f(t, hv)
    A_log, dt_bias = np.log(rng.uniform(1, 8, hv)).astype(np.float32), f(hv)
    slots = np.array([4, 0, 2, 5], np.int32)
    has_init = np.array([1, 0, 1, 1], np.int32)
    state_in = f(num_slots, hv, dv, dk)
    y, y_back = guarded((t, hv, dv), np.float32)
    if copy_state:
        state_out, s_back = guarded(state_in.shape, np.float32)
    else:
        state_out, s_back = guarded(state_in.shape, np.float32, fill=state_in)
    plan = _core.plan_gated_delta("float32", n, num_slots, hk, hv, dk, dv, copy_state=copy_state)
    assert len(plan) == (2 if copy_state else 1)
    emulation.run_plan(plan, [q, k, v, a, b, A_log, dt_bias, cu, slots, has_init, state_in, y,
                              state_out])
    assert guards_intact(y_back) and guards_intact(s_back)
    y_ref, s_ref = ref.gated_delta(q, k, v, a, b, A_log, dt_bias, state_in, cu, slots, has_init)
    np.testing.assert_allclose(y, y_ref, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(state_out, s_ref, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(state_out[[1, 3]], state_in[[1, 3]])  # untouched slots


def test_causal_conv1d_launches():
    rng = np.random.default_rng(2)
    lengths, c, kw, num_slots = (2, 0, 9), 133, 4, 5  # 133: a partial threadgroup
    cu = ref.cu_seqlens_of(lengths)
    t, n = int(cu[-1]), len(lengths)
    x = rng.standard_normal((t, c)).astype(np.float32)
    w = rng.standard_normal((c, kw)).astype(np.float32)
    bias = rng.standard_normal(c).astype(np.float32)
    slots = np.array([3, 1, 0], np.int32)
    has_init = np.array([1, 1, 0], np.int32)
    state_in = rng.standard_normal((num_slots, c, kw - 1)).astype(np.float32)
    out, o_back = guarded((t, c), np.float32)
    state_out, s_back = guarded(state_in.shape, np.float32)
    plan = _core.plan_causal_conv1d("float32", n, num_slots, c, kw, copy_state=True)
    emulation.run_plan(plan, [x, bias, w, cu, slots, has_init, state_in, out, state_out])
    assert guards_intact(o_back) and guards_intact(s_back)
    out_ref, s_ref = ref.causal_conv1d(x, w, bias, state_in, cu, slots, has_init)
    np.testing.assert_allclose(out, out_ref, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(state_out, s_ref, atol=0, rtol=0)
    np.testing.assert_array_equal(state_out[[2, 4]], state_in[[2, 4]])


@pytest.mark.parametrize("interleaved", [False, True], ids=["sectioned", "interleaved"])
def test_mrope_launches(interleaved):
    rng = np.random.default_rng(3)
    t, h, d, rot, sections = 4, 3, 96, 48, (8, 8, 8)
    x = rng.standard_normal((t, h, d)).astype(np.float32)
    positions = rng.integers(0, 50000, size=(3, t)).astype(np.int64)
    table, _ = _core.rope_turn_table(rot)
    out, back = guarded(x.shape, np.float32)
    plan = _core.plan_mrope("float32", "int64", t, h, d, sections=sections,
                            interleaved=interleaved, rotary_dim=rot)
    emulation.run_plan(plan, [x, positions, np.array(table), out])
    assert guards_intact(back)
    np.testing.assert_allclose(out, ref.mrope(x, positions, sections, interleaved, rot),
                               atol=2e-5, rtol=2e-5)


def test_plan_geometry():
    copy, main = _core.plan_gated_delta("bfloat16", 3, 7, 2, 6, 128, 13, copy_state=True)
    assert copy.kernel == "gated_delta_copy_state" and list(copy.grid) == [-(-7 * 6 * 13 * 128 // 256), 1, 1]
    assert main.kernel == "gated_delta_recurrent_bfloat16"
    assert list(main.grid) == [3 * 6, 4, 1] and list(main.threadgroup) == [32, 4, 1]  # 13 rows / 4
    assert not main.threadgroup_memory
    (conv,) = _core.plan_causal_conv1d("float16", 5, 9, 300, 4)
    assert conv.kernel == "causal_conv1d_float16"
    assert list(conv.grid) == [3, 5, 1] and list(conv.threadgroup) == [128, 1, 1]
    (small,) = _core.plan_causal_conv1d("float32", 2, 2, 7, 2)
    assert list(small.threadgroup) == [7, 1, 1]
    (mr,) = _core.plan_mrope("float32", "int32", 9, 4, 256, sections=(11, 11, 10), rotary_dim=64)
    assert mr.kernel == "mrope_float32_int32"
    assert list(mr.grid) == [9, 1, 1] and list(mr.threadgroup) == [32, 4, 1]
