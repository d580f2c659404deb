"""layer_norm (LayerNorm of x, or of x + residual) against a float64 NumPy reference and
MLX's mx.fast.layer_norm, on the CPU kernel and the emulated Metal kernel: widths that leave
the AVX2 loop a remainder (100) or none (384), rows wider than one simdgroup (1000), half
precision (the residual sum rounded to the dtype first), strided input, errors."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from op_harness import DTYPES, assert_close, random, round_to, to_numpy
from vllm_metal import _core, emulation, ops


def reference(x, weight, bias, eps, residual=None, dtype="float32"):
    h = np.asarray(x, np.float64)
    if residual is not None:
        h = round_to(h + residual, dtype)  # the sum as a separate add would store it
    mean = h.mean(-1, keepdims=True)
    var = ((h - mean) ** 2).mean(-1, keepdims=True)
    return (h - mean) / np.sqrt(var + eps) * weight + bias


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rows, hidden", [(1, 7), (5, 100), (33, 384), (2, 1000)], ids=str)
def test_matches_reference(backend, rows, hidden, dtype, residual):
    x = random((rows, hidden), dtype, seed=hidden, scale=3.0) + 0.5
    r = random((rows, hidden), dtype, seed=hidden + 1) if residual else None
    w, b = random((hidden,), dtype, seed=2), random((hidden,), dtype, seed=3)
    y = ops.layer_norm(x, w, b, eps=1e-5, residual=r)
    assert y.shape == x.shape and y.dtype == x.dtype
    want = reference(to_numpy(x), to_numpy(w), to_numpy(b), 1e-5,
                     None if r is None else to_numpy(r), dtype)
    assert_close(y, want, dtype, f"{rows}x{hidden} {dtype}")


def test_agrees_with_mlx_and_leading_axes(backend):
    x, r = random((2, 3, 384), "float32", 1), random((2, 3, 384), "float32", 2)
    w, b = random((384,), "float32", 3), random((384,), "float32", 4)
    y = ops.layer_norm(x, w, b, eps=1e-12, residual=r)
    assert_close(y, to_numpy(mx.fast.layer_norm(x + r, w, b, 1e-12)), "float32", "vs mlx")


def test_strided_input(backend):
    x = random((40, 8), "float32", 5).T  # [8, 40], not row-contiguous
    w, b = random((40,), "float32", 6), random((40,), "float32", 7)
    assert_close(ops.layer_norm(x, w, b, eps=1e-6), reference(to_numpy(x), to_numpy(w), to_numpy(b), 1e-6),
                 "float32", "transposed")


def test_empty():
    w = mx.ones((4,))
    assert ops.layer_norm(mx.zeros((0, 4)), w, w, eps=1e-5).shape == (0, 4)


def test_launches_on_numpy(rows=3, hidden=1000, dtype="float32", residual=True):
    """The planner's launch on NumPy arrays (also under the emulator's checks:
    test_metal_kernel_checks)."""
    rng = np.random.default_rng(hidden)
    np_dt = np.float16 if dtype == "float16" else np.float32
    x = (rng.standard_normal((rows, hidden)) * 2 + 1).astype(np_dt)
    r = rng.standard_normal((rows, hidden)).astype(np_dt)
    w, b = rng.standard_normal(hidden).astype(np_dt), rng.standard_normal(hidden).astype(np_dt)
    out = np.zeros_like(x)
    plan = _core.plan_layer_norm(dtype, rows, hidden, 1e-5, residual)
    emulation.run_plan(plan, [x, r, w, b, out] if residual else [x, w, b, out])
    h = (x + r).astype(np_dt) if residual else x
    want = reference(h, w.astype(np.float64), b.astype(np.float64), 1e-5)
    tol = 2e-5 if dtype == "float32" else 2e-3
    assert np.abs(out.astype(np.float64) - want).max() <= tol * max(1.0, np.abs(want).max())


def test_kernel_names_are_instantiated():
    names = {l.kernel for d in DTYPES for l in _core.plan_layer_norm(d, 2, 10, 1e-5)}
    assert names <= set(emulation.library("layer_norm").kernels)


@pytest.mark.parametrize("make, message", [
    (lambda: ops.layer_norm(mx.zeros((2, 4), mx.int32), mx.ones((4,)), mx.ones((4,)), eps=1e-5),
     r"\[layer_norm\] x must be float32, float16 or bfloat16, got int32"),
    (lambda: ops.layer_norm(mx.zeros((2, 4)), mx.ones((3,)), mx.ones((4,)), eps=1e-5),
     r"\[layer_norm\] weight must have shape \[4\] \(the last axis of x\)"),
    (lambda: ops.layer_norm(mx.zeros((2, 4)), mx.ones((4,)), mx.ones((4,), mx.float16), eps=1e-5),
     r"\[layer_norm\] bias must have x's dtype float32, got float16"),
    (lambda: ops.layer_norm(mx.zeros((2, 4)), mx.ones((4,)), mx.ones((4,)), eps=1e-5,
                            residual=mx.zeros((2, 5))),
     r"\[layer_norm\] residual must have the shape of x"),
    (lambda: ops.layer_norm(mx.zeros((2, 4)), mx.ones((4,)), mx.ones((4,)), eps=-1.0),
     r"\[layer_norm\] eps must be finite and >= 0"),
])
def test_bad_input(make, message):
    with pytest.raises(ValueError, match=message):
        make()
