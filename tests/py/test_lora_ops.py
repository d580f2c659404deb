"""lora_apply (per-row LoRA delta on a linear's output) against a float64 NumPy
reference on the CPU kernel and the emulated Metal kernel: mixed slots and
no-adapter rows, awkward sizes, every float dtype; the errors."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from op_harness import DTYPES, assert_close, to_numpy
from vllm_metal import _core, ops

CASES = [
    # (rows, in, out, rank, slots, row_slot pattern)
    (1, 8, 8, 1, 1, [0]),                          # decode, rank 1
    (5, 37, 13, 8, 3, [2, -1, 0, 2, 1]),           # mixed slots and a base row, odd sizes
    (7, 64, 300, 16, 2, [-1, 1, 1, 0, -1, 0, 1]),  # out > one threadgroup of columns
    (3, 130, 5, 40, 4, [3, 3, 3]),                 # rank > one simdgroup pass
]


def case_id(c):
    t, i, o, r, s, _ = c
    return f"lora(t={t},in={i},out={o},r={r},slots={s})"


def reference(y, x, a, b, scale, row_slot):
    out = y.copy()
    for t, s in enumerate(row_slot):
        if s >= 0:
            out[t] += b[s] @ (scale[s] * (a[s] @ x[t]))
    return out


def make(t, i, o, r, s, dtype, seed):
    rng = np.random.default_rng(seed)
    cast = lambda v: mx.array(v.astype(np.float32)).astype(DTYPES[dtype])  # noqa: E731
    y = cast(rng.standard_normal((t, o)))
    x = cast(rng.standard_normal((t, i)))
    a = cast(rng.standard_normal((s, r, i)) / np.sqrt(i))
    b = cast(rng.standard_normal((s, o, r)) / np.sqrt(r))
    scale = mx.array(rng.uniform(0.25, 2.0, s).astype(np.float32))
    return y, x, a, b, scale


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(backend, case, dtype):
    t, i, o, r, s, slots = case
    y, x, a, b, scale = make(t, i, o, r, s, dtype, seed=i + o)
    row_slot = mx.array(np.array(slots, np.int32))
    out = ops.lora_apply(y, x, lora_a=a, lora_b=b, scale=scale, row_slot=row_slot)
    want = reference(to_numpy(y), to_numpy(x), to_numpy(a), to_numpy(b),
                     np.array(scale, np.float64), slots)
    assert out.dtype == y.dtype
    assert_close(out, want, dtype, case_id(case))
    # rows without an adapter are the base output, bit for bit
    base = [k for k, v in enumerate(slots) if v < 0]
    if base:
        assert np.array_equal(to_numpy(out)[base], to_numpy(y)[base])


def test_zero_padded_rank_equals_the_small_adapter(backend):
    # an adapter of rank 3 in a rank-8 slot (zeros past 3) gives the rank-3 result
    y, x, a, b, scale = make(4, 20, 11, 3, 2, "float32", seed=5)
    a8 = mx.concatenate([a, mx.zeros((2, 5, 20))], axis=1)
    b8 = mx.concatenate([b, mx.zeros((2, 11, 5))], axis=2)
    rs = mx.array(np.array([1, 0, -1, 1], np.int32))
    small = ops.lora_apply(y, x, lora_a=a, lora_b=b, scale=scale, row_slot=rs)
    padded = ops.lora_apply(y, x, lora_a=a8, lora_b=b8, scale=scale, row_slot=rs)
    assert_close(padded, to_numpy(small), "float32", "padded rank")


def test_no_adapter_rows_return_y(backend):
    y, x, a, b, scale = make(3, 8, 8, 2, 1, "float16", seed=2)
    out = ops.lora_apply(y, x, lora_a=a, lora_b=b, scale=scale,
                         row_slot=mx.array(np.full(3, -1, np.int32)))
    assert np.array_equal(to_numpy(out), to_numpy(y))


def test_planner_covers_every_column_and_row():
    (launch,) = _core.plan_lora_apply("bfloat16", 5, 37, 300, 8, 3)
    assert launch.source == "lora" and launch.kernel == "lora_apply_bfloat16"
    assert launch.grid[0] * launch.threadgroup[0] >= 300 and launch.grid[1] == 5


@pytest.mark.parametrize("bad, message", [
    (dict(row_slot=np.array([0, 3], np.int32)), "row_slot\\[1\\] = 3 is out of range"),
    (dict(row_slot=np.array([-2, 0], np.int32)), "row_slot\\[0\\] = -2 is out of range"),
    (dict(row_slot=np.array([0, 0], np.int64)), "row_slot must be int32"),
    (dict(row_slot=np.array([0], np.int32)), "row_slot must be int32 \\[2\\]"),
    (dict(x=np.zeros((2, 9), np.float32)), "lora_a must be \\[num_slots, rank, 9\\]"),
    (dict(x=np.zeros((3, 8), np.float32)), "x must be \\[2, in\\]"),
    (dict(b=np.zeros((3, 6, 4), np.float32)), "lora_b must be \\[3, 5, 4\\]"),
    (dict(a=np.zeros((3, 4, 8), np.float16)), "lora_a must have y's dtype float32"),
    (dict(scale=np.ones(3, np.float16)), "scale must be float32 \\[3\\]"),
    (dict(scale=np.ones(2, np.float32)), "scale must be float32 \\[3\\]"),
    (dict(a=np.zeros((3, 600, 8), np.float32), b=np.zeros((3, 5, 600), np.float32)),
     "rank must be in \\[1, 512\\]"),
])
def test_bad_input_is_a_value_error(bad, message):
    args = dict(y=np.zeros((2, 5), np.float32), x=np.zeros((2, 8), np.float32),
                a=np.zeros((3, 4, 8), np.float32), b=np.zeros((3, 5, 4), np.float32),
                scale=np.ones(3, np.float32), row_slot=np.array([0, -1], np.int32))
    args.update(bad)
    m = {k: mx.array(v) for k, v in args.items()}
    with pytest.raises(ValueError, match=message):
        ops.lora_apply(m["y"], m["x"], lora_a=m["a"], lora_b=m["b"], scale=m["scale"],
                       row_slot=m["row_slot"])


def test_launches_on_numpy(rows=5, in_dim=37, out_dim=140, rank=9, slots=3):
    """The planned launch on NumPy buffers through the emulator (also run under the
    emulator's race/out-of-bounds checks by test_metal_kernel_checks)."""
    from vllm_metal import emulation

    rng = np.random.default_rng(7)
    y = rng.standard_normal((rows, out_dim)).astype(np.float32)
    x = rng.standard_normal((rows, in_dim)).astype(np.float32)
    a = rng.standard_normal((slots, rank, in_dim)).astype(np.float32)
    b = rng.standard_normal((slots, out_dim, rank)).astype(np.float32)
    scale = rng.uniform(0.5, 2, slots).astype(np.float32)
    row_slot = np.array([2, -1, 0, 1, 2][:rows], np.int32)
    out = np.full((rows, out_dim), np.nan, np.float32)
    emulation.run_plan(_core.plan_lora_apply("float32", rows, in_dim, out_dim, rank, slots),
                       [y, x, a, b, scale, row_slot, out])
    want = reference(y.astype(np.float64), x.astype(np.float64), a.astype(np.float64),
                     b.astype(np.float64), scale.astype(np.float64), row_slot)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
