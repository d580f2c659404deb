"""mrope against a float64 NumPy reference written the HF way (Qwen2-VL sections,
Qwen3-VL interleave) on both backends; equal to rope for text positions; the errors."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import hybrid_reference as ref
from op_harness import DTYPES, assert_close, random, to_numpy
from vllm_metal import _core, emulation, ops

CASES = [
    # (tokens, heads, head_size, rotary_dim, sections, interleaved, base)
    (5, 2, 128, 128, (16, 24, 24), False, 1e6),       # Qwen2-VL
    (7, 3, 128, 128, (24, 20, 20), True, 5e6),        # Qwen3-VL
    (4, 2, 256, 64, (11, 11, 10), True, 1e7),         # Qwen3.5: partial 0.25
    (3, 1, 80, 40, (6, 7, 7), False, 10000.0),        # partial, uneven sections
    (1, 4, 64, 64, (32, 0, 0), True, 10000.0),        # one stream only
]


def case_id(c):
    t, h, d, rot, sec, inter, base = c
    return f"mrope(t={t},h={h},d={d},rot={rot},sec={list(sec)},{'inter' if inter else 'sect'})"


def positions(t, seed, dtype=np.int64):
    rng = np.random.default_rng(seed)
    p = rng.integers(0, 70000, size=(3, t))
    p[:, -1] = [100000, 3, 0]
    return p.astype(dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(backend, case, dtype):
    t, h, d, rot, sec, inter, base = case
    x = random((t, h, d), dtype, seed=t * d, scale=2.0)
    p = positions(t, seed=h)
    y = ops.mrope(x, mx.array(p), sections=sec, interleaved=inter, rotary_dim=rot, base=base)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, ref.mrope(to_numpy(x), p, sec, inter, rot, base), dtype, case_id(case))


@pytest.mark.parametrize("interleaved", [False, True])
def test_text_positions_equal_rope(backend, interleaved):
    x = random((6, 2, 128), "float32", seed=1)
    p = np.arange(100, 106)
    y = ops.mrope(x, mx.array(np.stack([p, p, p]).astype(np.int32)), sections=(11, 11, 10),
                  interleaved=interleaved, rotary_dim=64, base=1e7)
    expect = ops.rope(x, mx.array(p), rotary_dim=64, base=1e7)
    assert mx.array_equal(y, expect).item()


def test_int32_and_int64_positions_agree(backend):
    x = random((4, 2, 64), "bfloat16", seed=2)
    p = positions(4, seed=3)
    a = ops.mrope(x, mx.array(p), sections=(8, 12, 12), interleaved=True)
    b = ops.mrope(x, mx.array(p.astype(np.int32)), sections=(8, 12, 12), interleaved=True)
    assert mx.array_equal(a, b).item()


def test_layouts_differ():
    # the two layouts must not collapse into one another (guards the reference too)
    x = random((2, 1, 64), "float32", seed=4)
    p = mx.array(positions(2, seed=5))
    a = ops.mrope(x, p, sections=(10, 11, 11), interleaved=False)
    b = ops.mrope(x, p, sections=(10, 11, 11), interleaved=True)
    assert not mx.allclose(a, b).item()


def test_kernel_names_are_instantiated():
    names = {l.kernel for d in DTYPES for pd in ("int32", "int64") for l in
             _core.plan_mrope(d, pd, 3, 2, 64, sections=(8, 12, 12))}
    assert names <= set(emulation.library("mrope").kernels)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ops.mrope(mx.zeros((2, 1, 8), mx.int32), mx.zeros((3, 2), mx.int32), sections=(2, 1, 1)),
         r"\[mrope\] x must be float32, float16 or bfloat16, got int32"),
        (lambda: ops.mrope(mx.zeros((2, 8)), mx.zeros((3, 2), mx.int32), sections=(2, 1, 1)),
         r"x must be \[num_tokens, num_heads, head_size\]"),
        (lambda: ops.mrope(mx.zeros((2, 1, 8)), mx.zeros((2,), mx.int32), sections=(2, 1, 1)),
         r"positions must be \[3, 2\] \(temporal, height, width per token\), got \[2\]"),
        (lambda: ops.mrope(mx.zeros((2, 1, 8)), mx.zeros((3, 2)), sections=(2, 1, 1)),
         r"positions must be int32 or int64, got float32"),
        (lambda: ops.mrope(mx.zeros((2, 1, 8)), mx.zeros((3, 2), mx.int32), sections=(2, 2, 1)),
         r"sections must be 3 non-negative counts summing to rotary_dim / 2 = 4, got \[2, 2, 1\]"),
        (lambda: ops.mrope(mx.zeros((2, 1, 8)), mx.zeros((3, 2), mx.int32), sections=(1, 1, 1),
                           rotary_dim=7),
         r"rotary_dim must be even and in \[2, head_size=8\], got 7"),
    ],
)
def test_bad_input_raises_a_clear_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()
