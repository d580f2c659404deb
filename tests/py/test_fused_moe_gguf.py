"""fused_moe_gguf (experts as GGUF blocks, llama.cpp's ffn_*_exps layout) against the
float64 reference of test_fused_moe on the gguf package's dequantization: every type
gguf_matmul takes (float32 sums: exact on the CPU, always on Metal), 8-bit activations
within gguf_matmul's error, mixed types per tensor, the planner, the errors."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from op_harness import DTYPES, assert_close, to_numpy
from test_fused_moe import reference
from test_gguf_fixtures import SUPPORTED, T, block_size, random_blocks, reference_dequantize
from vllm_metal import _core, ops


def experts(t: T, e: int, rows: int, cols: int, seed: int):
    """(uint8 blocks [E * rows, row_bytes], float64 [E, rows, cols] they decode to)."""
    blocks = random_blocks(t, e * rows, cols, seed)
    w = reference_dequantize(blocks, t, (e * rows, cols)).astype(np.float64)
    # random blocks have O(1) weights; scale the reference instead of the bytes
    return blocks, w.reshape(e, rows, cols)


def make(types, t_n, h, e, i, dtype, seed, skew=0.3):
    rng = np.random.default_rng(seed)
    # random K-quant blocks decode to O(10) weights: small x keeps float16 outputs finite
    x = mx.array(rng.standard_normal((t_n, h)).astype(np.float32) / h).astype(DTYPES[dtype])
    logits = mx.array((rng.standard_normal((t_n, e)) - skew * np.arange(e)).astype(np.float32))
    gb, gw = experts(types[0], e, i, h, seed + 1)
    ub, uw = experts(types[1], e, i, h, seed + 2)
    db, dw = experts(types[2], e, h, i, seed + 3)
    return x, logits, (gb, gw), (ub, uw), (db, dw)


def run(types, x, logits, g, u, d, i, top_k, **kw):
    return ops.fused_moe_gguf(x, logits, mx.array(g[0]), types[0].name, mx.array(u[0]),
                              types[1].name, mx.array(d[0]), types[2].name, inter=i,
                              top_k=top_k, **kw)


def relative_error(got, want):
    return float(np.abs(to_numpy(got) - want).max() / max(np.abs(want).max(), 1e-30))


def size_for(t: T) -> int:
    bs = block_size(t)
    return 64 if bs <= 32 else bs


@pytest.mark.parametrize("t", SUPPORTED, ids=[t.name for t in SUPPORTED])
def test_every_type_matches_reference(backend, t):
    h = i = size_for(t)
    types = (t, t, t)
    x, logits, g, u, d = make(types, 5, h, 6, i, "float32", seed=int(t))
    out = run(types, x, logits, g, u, d, i, 2, exact=True)
    want = reference(to_numpy(x), to_numpy(logits), g[1], u[1], d[1], 2)
    err = relative_error(out, want)
    assert err < 1e-4, f"{t.name}: relative error {err:.3g}"


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_mixed_types_uneven_loads(backend, dtype):
    # Qwen3-MoE Q4_K_M files: gate/up Q4_K, down Q6_K
    types = (T.Q4_K, T.Q4_K, T.Q6_K)
    x, logits, g, u, d = make(types, 11, 256, 8, 256, dtype, seed=7, skew=1.0)
    out = run(types, x, logits, g, u, d, 256, 3, exact=True)
    want = reference(to_numpy(x), to_numpy(logits), g[1], u[1], d[1], 3)
    assert out.dtype == x.dtype
    tol = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    assert relative_error(out, want) < tol


def test_int8_activations_close():
    """The default (exact=False) CPU path rounds activations like gguf_matmul: close to the
    float reference, not equal."""
    types = (T.Q8_0, T.Q4_0, T.Q8_0)
    x, logits, g, u, d = make(types, 6, 64, 4, 64, "float32", seed=3)
    want = reference(to_numpy(x), to_numpy(logits), g[1], u[1], d[1], 2)
    assert relative_error(run(types, x, logits, g, u, d, 64, 2), want) < 3e-2


def test_matches_dense_op_on_dense_types(backend):
    """F32 experts through the GGUF path equal the dense op on the same weights."""
    types = (T.F32, T.F32, T.F32)
    x, logits, g, u, d = make(types, 4, 40, 5, 24, "float32", seed=9)
    dense = ops.fused_moe(x, logits, *(mx.array(w[1].astype(np.float32)) for w in (g, u, d)),
                          top_k=2)
    assert_close(run(types, x, logits, g, u, d, 24, 2, exact=True), to_numpy(dense), "float32")


def test_plan():
    plan = _core.plan_fused_moe_gguf("float16", "Q4_K", "Q4_K", "Q6_K", num_tokens=3, hidden=256,
                                     num_experts=8, inter=512, top_k=2)
    assert [(l.source, l.kernel) for l in plan] == [
        ("moe", "moe_route"), ("moe_gguf", "moe_gguf_gate_up_float16"),
        ("moe_gguf", "moe_gguf_down"), ("moe", "moe_combine_float16")]


def test_bad_input():
    types = (T.Q8_0, T.Q8_0, T.Q8_0)
    x, logits, g, u, d = make(types, 2, 64, 4, 64, "float32", seed=1)
    with pytest.raises(ValueError, match="top_k"):
        run(types, x, logits, g, u, d, 64, 5)
    with pytest.raises(ValueError, match="down must hold"):
        run(types, x, logits, g, u, (d[0][:-1], d[1]), 64, 2)
    with pytest.raises(ValueError, match="gate must hold"):
        run(types, x, logits, g, u, d, 48, 2)
    with pytest.raises(ValueError, match="multiple of the Q8_0 block size"):
        run(types, x[:, :40], logits, g, u, d, 64, 2)
    with pytest.raises(ValueError, match="router_logits"):
        run(types, x, logits[:1], g, u, d, 64, 2)
    with pytest.raises(ValueError, match="unknown GGML type"):
        ops.fused_moe_gguf(x, logits, mx.array(g[0]), "Q9_9", mx.array(u[0]), "Q8_0",
                           mx.array(d[0]), "Q8_0", inter=64, top_k=2)
    with pytest.raises(ValueError, match="not supported"):
        ops.fused_moe_gguf(x, logits, mx.array(g[0]), "IQ1_S", mx.array(u[0]), "Q8_0",
                           mx.array(d[0]), "Q8_0", inter=64, top_k=2)


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_gpt_oss_variant_matches_reference(backend, top_k):
    """gpt-oss's routing (softmax over the chosen k), expert biases and clamped SwiGLU
    with block experts; x scaled so gate/up values cross the clamp at 7."""
    types = (T.Q8_0, T.Q4_K, T.Q8_0)
    x, logits, g, u, d = make(types, 7, 256, 6, 256, "float32", seed=20 + top_k, skew=0.5)
    x = x * 200
    rng = np.random.default_rng(top_k)
    biases = {n: rng.standard_normal(s).astype(np.float32)
              for n, s in (("b_gate", (6, 256)), ("b_up", (6, 256)), ("b_down", (6, 256)))}
    kw = dict(scoring="softmax_topk", renormalize=False, activation="swiglu_oai")
    out = run(types, x, logits, g, u, d, 256, top_k, exact=True, **kw,
              **{n: mx.array(b) for n, b in biases.items()})
    want = reference(to_numpy(x), to_numpy(logits), g[1], u[1], d[1], top_k, **kw, **biases)
    gate = np.einsum("eih,th->tei", g[1], to_numpy(x))
    assert (gate > 7).any() and (gate < 7).any()
    assert relative_error(out, want) < 1e-4
