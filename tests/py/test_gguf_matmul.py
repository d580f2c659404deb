"""gguf_matmul against dequantize-then-matmul (float64), on every backend.

Shapes cross the kernel thresholds: m = 1 / 4 / 5, 8 / 9 (CPU int8 mat-vec and
Metal mat-vec limit 8), 33 (Metal 32 x 32 tile + 1); n = 1, 7, 37
(threadgroups of 4 rows and 32-column tiles, ragged); k of one and several
blocks, and odd k for the float types.
"""

import math

import mlx.core as mx
import numpy as np
import pytest

from op_harness import DTYPES, to_numpy
from test_gguf_fixtures import SUPPORTED, T, block_size, random_blocks, reference_dequantize
from vllm_metal import _core, emulation, ops

# The one tolerance table of the gguf_matmul tests (tests/cpp/test_gguf.cpp has the same).
# "float": paths that sum exact weights times x in float32 (every Metal kernel, emulated or
#   on the GPU; float weights; types without an integer kernel): max |y - ref| / max |ref|,
#   one rounding of the output in the activation dtype.
# "int8": on the CPU ("native" backend) only, INT8_TYPES round x to 8 bits per value (every
#   row count) (a float scale d = max|x| / 127 per 32, llama.cpp's scheme), an error of
#   about |w| d / sqrt(12) per output. Measured as rms(y - ref) / rms(|x_i| |w_j| / sqrt(k)),
#   the error against the size an output of those rows typically has (no accidental
#   cancellation in ref can shrink it): about 0.0052 for Gaussian x; each bound is 1.5x the
#   largest of 750 random cases here and 900 in the C++ test. The output rounding's "float"
#   bound is added.
TOLERANCE = {
    "float": {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2},
    "int8": {T.Q4_0: 0.015, T.Q4_1: 0.018, T.Q5_0: 0.015, T.Q5_1: 0.021, T.Q8_0: 0.015,
             T.Q4_K: 0.023, T.Q5_K: 0.021, T.Q6_K: 0.018, T.MXFP4: 0.015},
}
INT8_TYPES = set(TOLERANCE["int8"])


def k_values(t):
    bs = block_size(t)
    if bs == 1:
        return [13, 100]
    return [bs, 3 * bs] if bs == 32 else [bs, 2 * bs]


def check(t, m, n, k, dtype, seed, backend, lead=()):
    """backend: the `backend` fixture's name. Not ops.kernel_backend(): on the GPU ("metal")
    that stays "native", yet the Metal kernels sum in float32 like the emulated ones."""
    blocks = random_blocks(t, n, k, seed=seed)
    w = reference_dequantize(blocks, t, (n, k)).astype(np.float64)
    rng = np.random.default_rng(seed + 1)
    x = mx.array(rng.standard_normal((*lead, m, k)).astype(np.float32)).astype(DTYPES[dtype])
    y = ops.gguf_matmul(x, mx.array(blocks), t.name, [n, k])
    assert y.dtype == x.dtype and tuple(y.shape) == (*lead, m, n)
    xs = to_numpy(x).reshape(-1, k)  # [rows, k]
    ref = xs @ w.T
    got = to_numpy(y).reshape(ref.shape)
    assert np.isfinite(got).all(), "non-finite output"
    case = f"gguf_matmul({t.name},m={m},n={n},k={k},dt={dtype})"
    if backend == "native" and t in INT8_TYPES:
        typical = np.outer((xs ** 2).sum(1), (w ** 2).sum(1)) / k  # [rows, n]
        err = np.sqrt(((got - ref) ** 2).sum() / typical.sum())
        tol = TOLERANCE["int8"][t] + TOLERANCE["float"][dtype]
        assert err <= tol, f"{case}: int8 rms error {err:.3g} > {tol}"
    else:
        err = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30)
        tol = TOLERANCE["float"][dtype]
        assert err <= tol, f"{case}: relative error {err:.3g} > {tol}"


@pytest.mark.parametrize("t", SUPPORTED, ids=[t.name for t in SUPPORTED])
def test_matmul_every_type(backend, t):
    for i, (m, n) in enumerate([(1, 7), (4, 37), (5, 1), (8, 5), (9, 37), (33, 7)]):
        for k in k_values(t):
            check(t, m, n, k, "float32", seed=100 * i + k, backend=backend)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("t", [T.Q4_0, T.Q4_K, T.Q6_K, T.IQ4_XS, T.F16, T.BF16],
                         ids=lambda t: t.name)
def test_matmul_half_activations(backend, t, dtype):
    k = max(256, block_size(t))
    for m, n in [(1, 37), (8, 5), (40, 33)]:
        check(t, m, n, k, dtype, seed=7, backend=backend)


def test_matmul_batched_leading_axes(backend):
    check(T.Q8_0, 3, 9, 64, "float32", seed=3, backend=backend, lead=(2,))


def test_matmul_real_decode_shape(backend):
    # SmolLM2-135M q_proj: 576 x 576 Q4_1 (Metal emulation is slow: one row)
    check(T.Q4_1, 1, 576 if backend == "native" else 40, 576, "float32", seed=5, backend=backend)


def test_metal_backend_is_held_to_float32_sums():
    """An output with the CPU's 8-bit activation error passes as "native" and fails as
    "metal": the GPU's kernels sum in float32. Run here under the "native" kernel backend,
    as the metal fixture leaves it, so the op computes exactly that 8-bit output."""
    assert ops.kernel_backend() == "native"
    check(T.Q4_0, 4, 37, 64, "float32", seed=1, backend="native")
    with pytest.raises(AssertionError, match=r"relative error .* > 2e-05"):
        check(T.Q4_0, 4, 37, 64, "float32", seed=1, backend="metal")


@pytest.mark.slow
@pytest.mark.parametrize("t", [T.Q4_1, T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_matmul_model_shapes_native(t):
    # prefill and decode at SmolLM2 / Gemma-3 sizes on the CPU kernels
    d = 576 if block_size(t) == 32 else 512
    for m, n, k in [(1, 1536, d), (3, 640, 2048), (77, 1536, d), (512, 576, 1536)]:
        check(t, m, n, k, "float32", seed=m, backend="native")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ops.gguf_matmul(mx.zeros((2, 32), mx.int32), mx.zeros((36,), mx.uint8), "Q4_0", [2, 32]),
         r"\[gguf_matmul\] x must be float32, float16 or bfloat16, got int32"),
        (lambda: ops.gguf_matmul(mx.zeros((2, 64)), mx.zeros((36,), mx.uint8), "Q4_0", [2, 32]),
         r"\[gguf_matmul\] x must have K = 32 on its last axis, got shape \[2, 64\]"),
        (lambda: ops.gguf_matmul(mx.zeros((2, 32)), mx.zeros((36,), mx.uint8), "Q4_0", [2, 1, 32]),
         r"\[gguf_matmul\] shape must be \[N, K\], got \[2, 1, 32\]"),
        (lambda: ops.gguf_matmul(mx.zeros((2, 32)), mx.zeros((35,), mx.uint8), "Q4_0", [2, 32]),
         r"\[gguf_matmul\] blocks must hold 36 bytes for Q4_0 shape \[2, 32\], got 35"),
        (lambda: ops.gguf_matmul(mx.zeros((2, 256)), mx.zeros((66,), mx.uint8), "IQ2_XXS", [1, 256]),
         r"\[gguf_matmul\] type IQ2_XXS is not supported"),
        (lambda: ops.gguf_matmul(mx.zeros((2, 32)), mx.zeros((36,), mx.uint8), "Q4_0", [2, 32],
                                 bias=mx.zeros((3,))),
         r"\[gguf_matmul\] bias must have shape \[N\] = \[2\], got \[3\]"),
        (lambda: ops.gguf_matmul(mx.zeros((2, 32)), mx.zeros((36,), mx.uint8), "Q4_0", [2, 32],
                                 bias=mx.zeros((2,), mx.float16)),
         r"\[gguf_matmul\] bias must have x's dtype float32, got float16"),
        (lambda: ops.gguf_matmul(mx.zeros((2, 32)), mx.zeros((36,), mx.uint8), "Q4_0", [2, 32],
                                 activation="relu"),
         r"\[gguf_matmul\] activation must be 'none', 'gelu' or 'gelu_tanh', got 'relu'"),
    ],
)
def test_bad_input_raises_a_clear_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def _act(y, activation):
    if activation == "gelu":
        return 0.5 * y * (1 + _erf(y / math.sqrt(2)))
    if activation == "gelu_tanh":
        return 0.5 * y * (1 + np.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y ** 3)))
    return y


_erf = np.vectorize(math.erf)


@pytest.mark.parametrize("activation", ["none", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("t, exact", [(T.F32, True), (T.Q8_0, False), (T.Q8_0, True)],
                         ids=["F32", "Q8_0", "Q8_0-exact"])
def test_epilogue_bias_and_gelu(backend, t, exact, dtype, activation):
    """act(x @ W^T + bias) in one call against the plain call's output, bias added and GELU
    taken in float64 (so every path's epilogue is checked on its own sums: mat-vec rows,
    the CPU's float tiles and integer panels, the Metal tile); F32 also against x @ W^T."""
    n, k = 37, 64
    blocks = random_blocks(t, n, k, seed=11)
    rng = np.random.default_rng(12)
    bias = mx.array(rng.standard_normal(n).astype(np.float32)).astype(DTYPES[dtype])
    rows = (4, 9, 33, 300) if backend == "native" else (4, 33)
    for m in rows:
        x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(DTYPES[dtype])
        plain = to_numpy(ops.gguf_matmul(x, mx.array(blocks), t.name, [n, k], exact=exact))
        got = ops.gguf_matmul(x, mx.array(blocks), t.name, [n, k], exact=exact, bias=bias,
                              activation=activation)
        assert got.dtype == x.dtype and tuple(got.shape) == (m, n)
        want = _act(plain + to_numpy(bias), activation)
        if t == T.F32:
            w = reference_dequantize(blocks, t, (n, k)).astype(np.float64)
            want_dense = _act(to_numpy(x) @ w.T + to_numpy(bias), activation)
            err = np.abs(to_numpy(got) - want_dense).max() / np.abs(want_dense).max()
            assert err <= TOLERANCE["float"][dtype], f"m={m}: {err:.3g} against x @ W^T"
        # the fused result rounds once where the plain call rounded before the bias
        err = np.abs(to_numpy(got) - want).max() / np.abs(want).max()
        assert err <= 2 * TOLERANCE["float"][dtype], f"{t.name} m={m} {dtype}: {err:.3g}"


def test_epilogue_launches_on_numpy():
    """The planner's launches with a bias and GELU on NumPy arrays: the mat-vec kernel (4
    rows) and the tile kernel (33 rows: a partial second tile); also under the emulator's
    checks (test_metal_kernel_checks)."""
    n, k = 37, 64
    blocks = random_blocks(T.Q8_0, n, k, seed=3)
    w = reference_dequantize(blocks, T.Q8_0, (n, k)).astype(np.float64)
    rng = np.random.default_rng(4)
    bias = rng.standard_normal(n).astype(np.float32)
    for m, activation in ((4, "gelu"), (33, "gelu_tanh")):
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = np.zeros((m, n), np.float32)
        plan = _core.plan_gguf_matmul("Q8_0", "float32", m, n, k, bias=True, activation=activation)
        emulation.run_plan(plan, [x, blocks, bias, y])
        want = _act(x.astype(np.float64) @ w.T + bias, activation)
        assert np.abs(y - want).max() <= 2e-5 * np.abs(want).max(), (m, activation)


def test_epilogue_with_k_zero():
    y = ops.gguf_matmul(mx.zeros((2, 0)), mx.zeros((0,), mx.uint8), "F32", [3, 0],
                        bias=mx.array([-1.0, 0.0, 2.0]), activation="gelu")
    np.testing.assert_allclose(to_numpy(y), np.tile(_act(np.array([-1.0, 0.0, 2.0]), "gelu"), (2, 1)),
                               rtol=1e-6, atol=1e-7)


def test_empty_inputs_give_empty_output():
    assert ops.gguf_matmul(mx.zeros((0, 32)), mx.zeros((36,), mx.uint8), "Q4_0", [2, 32]).shape == (0, 2)


def test_plans_choose_matvec_up_to_8_rows():
    (l,) = _core.plan_gguf_matmul("Q4_K", "float16", 8, 100, 512)
    # k = 512: 32 lanes per row, 4 rows per lane, 2 simdgroups = 8 weight rows per threadgroup
    assert _core.gguf_matvec_shape(512) == (32, 4, 16)
    assert l.kernel == "gguf_matvec_q4_k_float16" and list(l.grid) == [13, 1, 1]
    assert list(l.threadgroup) == [64, 1, 1] and len(l.args) == 56
    # buffer 4 (the epilogue's bias) bound to the weights when there is no bias
    assert [(b.index, b.array_slot) for b in l.buffers] == [(0, 1), (1, 0), (2, 2), (4, 1)]
    (l,) = _core.plan_gguf_matmul("Q4_K", "float16", 8, 100, 512, bias=True, activation="gelu")
    assert [(b.index, b.array_slot) for b in l.buffers] == [(0, 1), (1, 0), (2, 3), (4, 2)]
    (l,) = _core.plan_gguf_matmul("Q4_K", "float16", 9, 100, 512)
    assert l.kernel == "gguf_matmul_q4_k_float16" and list(l.grid) == [4, 1, 1]
    assert list(l.threadgroup) == [128, 1, 1] and len(l.args) == 56
    (l,) = _core.plan_gguf_dequantize("IQ3_S", "bfloat16", 3, 512)
    assert l.kernel == "gguf_dequantize_iq3_s_bfloat16" and l.grid[0] * 256 >= 3 * 32


@pytest.mark.parametrize("t, k", [(T.F32, 1100), (T.F16, 544), (T.BF16, 96), (T.Q4_K, 768)],
                         ids=["F32-3-chunks", "F16-3-chunks", "BF16", "Q4_K-decoded-exact"])
def test_prefill_tiles_of_many_rows_native(t, k):
    """Calls of 64 rows and more on the CPU: where the table has weight panels (AVX-512) the
    weights are laid out as 32-column panels and x is read in place, 12 rows a kernel call;
    elsewhere 16-row x panels. Held to float64 x @ W^T, with ragged last panels (n = 33,
    100), ragged row groups and blocks (77, 140, 300 rows), several chunks of k, and the
    fused bias + GELU; and a row's output is bitwise the same whichever call and place in
    it the row has (the prefill's promise: results do not depend on the batch)."""
    rng = np.random.default_rng(k)
    exact = t == T.Q4_K  # float sums of the decoded weights, not the 8-bit activation path
    for n in (33, 100):
        blocks = random_blocks(t, n, k, seed=n)
        w = reference_dequantize(blocks, t, (n, k)).astype(np.float64)
        bias = rng.standard_normal(n).astype(np.float32)
        x = rng.standard_normal((300, k)).astype(np.float32)
        outs = {}
        for m in (64, 77, 140, 300):
            rows = x[300 - m:]  # the last rows: each sits at another place in each call
            got = to_numpy(ops.gguf_matmul(mx.array(rows), mx.array(blocks), t.name, [n, k], exact=exact,
                                           bias=mx.array(bias), activation="gelu"))
            want = _act(rows.astype(np.float64) @ w.T + bias, "gelu")
            err = np.abs(got - want).max() / np.abs(want).max()
            assert err <= TOLERANCE["float"]["float32"], f"{t.name} m={m} n={n}: {err:.3g}"
            outs[m] = got
        for m in (64, 77, 140):
            np.testing.assert_array_equal(outs[m], outs[300][300 - m:], err_msg=f"{t.name} m={m} n={n}")
