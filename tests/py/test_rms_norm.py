"""rms_norm and add_rms_norm against a float64 NumPy reference, on both backends."""

import mlx.core as mx
import numpy as np
import pytest

from op_harness import DTYPES, assert_close, random, round_to, to_numpy
from vllm_metal import ops

# Curated shapes: one element, odd sizes, simdgroup and threadgroup boundaries
# (32, 33, 1024 threads), real hidden sizes, a long row, many short rows.
SHAPES = [
    (1, 1),
    (1, 7),
    (3, 5),
    (2, 13, 33),
    (1, 576),
    (17, 576),
    (2, 4096),
    (1, 8193),
    (300, 64),
]
EPS = 1e-5


def reference_rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def case_id(shape, dtype):
    return f"rms_norm(shape={list(shape)},dt={dtype})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rms_norm(backend, shape, dtype):
    x = random(shape, dtype, seed=1, scale=3.0)
    w = random(shape[-1:], dtype, seed=2)
    y = ops.rms_norm(x, w, EPS)
    assert y.dtype == x.dtype and y.shape == x.shape
    ref = reference_rms_norm(to_numpy(x), to_numpy(w), EPS)
    assert_close(y, ref, dtype, case_id(shape, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_add_rms_norm(backend, shape, dtype):
    x = random(shape, dtype, seed=3, scale=2.0)
    r = random(shape, dtype, seed=4, scale=2.0)
    w = random(shape[-1:], dtype, seed=5)
    y, h = ops.add_rms_norm(x, r, w, EPS)
    h_ref = round_to(to_numpy(x) + to_numpy(r), dtype)
    assert_close(h, h_ref, dtype, "new_residual")
    # the norm is of the rounded sum, i.e. of what new_residual holds
    assert_close(y, reference_rms_norm(h_ref, to_numpy(w), EPS), dtype, case_id(shape, dtype))


def test_non_contiguous_inputs(backend):
    base = random((6, 200), "float32", seed=6)
    x = base[:, ::2]  # strided rows
    xt = random((100, 6), "float32", seed=7).T  # transposed
    w = random((100,), "float32", seed=8)
    for a in (x, xt):
        assert_close(ops.rms_norm(a, w, EPS), reference_rms_norm(to_numpy(a), to_numpy(w), EPS),
                     "float32", "non-contiguous")
    y, h = ops.add_rms_norm(x, xt, w, EPS)
    assert_close(h, to_numpy(x) + to_numpy(xt), "float32", "non-contiguous residual")


def test_rows_are_independent(backend):
    # a huge row next to a tiny one: no reduction state leaks between threadgroups
    x = mx.array(np.array([[1e4] * 64, [1e-3] * 64], dtype=np.float32))
    w = mx.ones((64,))
    y = to_numpy(ops.rms_norm(x, w, 0.0))
    np.testing.assert_allclose(y, np.ones((2, 64)), rtol=1e-5)


def test_eps_dominates_zero_rows(backend):
    x = mx.zeros((2, 33))
    y = ops.rms_norm(x, mx.ones((33,)), 1e-6)
    assert np.all(to_numpy(y) == 0.0)


def test_empty_input_gives_empty_output():
    y = ops.rms_norm(mx.zeros((0, 8)), mx.ones((8,)), EPS)
    assert y.shape == (0, 8)
    y, h = ops.add_rms_norm(mx.zeros((0, 8)), mx.zeros((0, 8)), mx.ones((8,)), EPS)
    assert y.shape == h.shape == (0, 8)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ops.rms_norm(mx.zeros((2, 4), mx.int32), mx.ones((4,), mx.int32), EPS),
         r"\[rms_norm\] x must be float32, float16 or bfloat16, got int32"),
        (lambda: ops.rms_norm(mx.zeros((2, 4)), mx.ones((5,)), EPS),
         r"\[rms_norm\] weight must have shape \[4\]"),
        (lambda: ops.rms_norm(mx.zeros((2, 4)), mx.ones((4,), mx.float16), EPS),
         r"\[rms_norm\] weight must have x's dtype float32, got float16"),
        (lambda: ops.rms_norm(mx.zeros((2, 4)), mx.ones((4,)), float("nan")),
         r"\[rms_norm\] eps must be finite"),
        (lambda: ops.rms_norm(mx.array(1.0), mx.ones((1,)), EPS),
         r"\[rms_norm\] x must have at least 1 dimension"),
        (lambda: ops.add_rms_norm(mx.zeros((2, 4)), mx.zeros((3, 4)), mx.ones((4,)), EPS),
         r"\[add_rms_norm\] residual must have the shape of x"),
        (lambda: ops.add_rms_norm(mx.zeros((2, 4)), mx.zeros((2, 4), mx.float16), mx.ones((4,)), EPS),
         r"\[add_rms_norm\] residual must have x's dtype float32, got float16"),
    ],
)
def test_bad_input_raises_a_clear_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()
