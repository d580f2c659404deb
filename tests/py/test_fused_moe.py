"""fused_moe against a float64 NumPy reference (both backends): uneven expert loads,
experts with no tokens, top-k of 1, 2 and 8, softmax and sigmoid routing, mixed
dtypes; the emulated launches' planner; the errors."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from op_harness import DTYPES, TOLERANCE, assert_close, to_numpy
from vllm_metal import _core, ops


def oai_act(g, u, alpha=1.702, limit=7.0):
    """gpt-oss's clamped SwiGLU, as transformers' GptOssExperts writes it."""
    g = np.minimum(g, limit)
    u = np.clip(u, -limit, limit)
    return (u + 1.0) * g * (1.0 / (1.0 + np.exp(-alpha * g)))


def reference(x, logits, wg, wu, wd, top_k, renormalize=True, scoring="softmax",
              activation="silu", b_gate=None, b_up=None, b_down=None):
    """float64 routing + SwiGLU experts, looping token by token (obviously right).
    Ties choose the lower expert id (a stable sort of -logits). gpt-oss: scoring
    "softmax_topk" (softmax over the chosen logits), biases, activation "swiglu_oai"."""
    t_n = x.shape[0]
    out = np.zeros_like(x)
    e_n, i_n, h_n = wg.shape
    bg = np.zeros((e_n, i_n)) if b_gate is None else b_gate
    bu = np.zeros((e_n, i_n)) if b_up is None else b_up
    bd = np.zeros((e_n, h_n)) if b_down is None else b_down
    if scoring == "softmax_topk":
        p = logits  # replaced per token below
    elif scoring == "softmax":
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
    else:
        p = 1.0 / (1.0 + np.exp(-logits))
    for t in range(t_n):
        chosen = np.argsort(-logits[t], kind="stable")[:top_k]
        if scoring == "softmax_topk":
            w = np.exp(logits[t, chosen] - logits[t, chosen].max())
            w = w / w.sum()
        else:
            w = p[t, chosen]
        if renormalize:
            w = w / w.sum()
        for e, we in zip(chosen, w):
            g = wg[e] @ x[t] + bg[e]
            u = wu[e] @ x[t] + bu[e]
            act = oai_act(g, u) if activation == "swiglu_oai" else g / (1.0 + np.exp(-g)) * u
            out[t] += we * (wd[e] @ act + bd[e])
    return out


def make(t, h, e, i, dtype, w_dtype, seed, skew=0.0):
    """Random inputs; `skew` > 0 biases the router towards low expert ids (uneven loads,
    experts that get no tokens)."""
    rng = np.random.default_rng(seed)
    cast = lambda a, d: mx.array(a.astype(np.float32)).astype(DTYPES[d])  # noqa: E731
    x = cast(rng.standard_normal((t, h)), dtype)
    logits = rng.standard_normal((t, e)) - skew * np.arange(e)
    wg = cast(rng.standard_normal((e, i, h)) / np.sqrt(h), w_dtype)
    wu = cast(rng.standard_normal((e, i, h)) / np.sqrt(h), w_dtype)
    wd = cast(rng.standard_normal((e, h, i)) / np.sqrt(i), w_dtype)
    return x, cast(logits, "float32"), wg, wu, wd


def check(x, logits, wg, wu, wd, top_k, dtype, **kw):
    out = ops.fused_moe(x, logits, wg, wu, wd, top_k=top_k, **kw)
    want = reference(*(to_numpy(a) for a in (x, logits, wg, wu, wd)), top_k, **kw)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert_close(out, want, dtype, "fused_moe")


CASES = [
    # (T, H, E, I, top_k, skew)
    (1, 64, 8, 32, 2, 0.0),      # decode
    (7, 40, 8, 24, 2, 0.8),      # uneven loads, experts with no tokens, H not a multiple of 32
    (5, 33, 6, 17, 1, 0.0),      # top-1, odd sizes
    (9, 48, 16, 20, 8, 0.3),     # top-8
]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}H{}E{}I{}k{}s{}".format(*c))
def test_matches_reference(backend, case, dtype):
    t, h, e, i, k, skew = case
    args = make(t, h, e, i, dtype, dtype, seed=t * 31 + k, skew=skew)
    check(*args, k, dtype)


@pytest.mark.parametrize("scoring,renormalize", [("softmax", False), ("sigmoid", True),
                                                 ("sigmoid", False)])
def test_routing_modes(backend, scoring, renormalize):
    args = make(6, 32, 8, 16, "float32", "float32", seed=3, skew=0.2)
    check(*args, 3, "float32", scoring=scoring, renormalize=renormalize)


@pytest.mark.parametrize("dtype,w_dtype", [("bfloat16", "float32"), ("float32", "float16")])
def test_weight_dtype_differs(backend, dtype, w_dtype):
    args = make(4, 32, 4, 16, dtype, w_dtype, seed=11)
    check(*args, 2, dtype)


def test_tied_logits_pick_lower_ids(backend):
    x, _, wg, wu, wd = make(3, 32, 6, 16, "float32", "float32", seed=5)
    logits = mx.zeros((3, 6), mx.float32)  # every expert tied: experts 0 and 1 win
    check(x, logits, wg, wu, wd, 2, "float32")


def test_no_tokens(backend):
    x, logits, wg, wu, wd = make(0, 32, 4, 16, "float32", "float32", seed=1)
    out = ops.fused_moe(x, logits, wg, wu, wd, top_k=2)
    assert out.shape == (0, 32)


def test_plan_shapes():
    plan = _core.plan_fused_moe("bfloat16", "float16", num_tokens=5, hidden=70, num_experts=8,
                                inter=33, top_k=2)
    assert [l.kernel for l in plan] == ["moe_route", "moe_gate_up_bfloat16_float16",
                                        "moe_down_float16", "moe_combine_bfloat16"]
    assert tuple(plan[1].grid) == (9, 8, 1)    # ceil(33 / 4) row blocks x experts
    assert tuple(plan[2].grid) == (18, 8, 1)   # ceil(70 / 4)
    assert tuple(plan[3].grid) == (2, 5, 1)


def test_larger_than_tolerance_error_is_caught(backend):
    """The comparison can fail: a wrong top_k gives a different result."""
    x, logits, wg, wu, wd = make(4, 32, 8, 16, "float32", "float32", seed=2)
    out = ops.fused_moe(x, logits, wg, wu, wd, top_k=2)
    wrong = reference(*(to_numpy(a) for a in (x, logits, wg, wu, wd)), 3)
    assert np.abs(to_numpy(out) - wrong).max() > TOLERANCE["float32"]


@pytest.mark.parametrize("change,match", [
    (dict(top_k=9), "top_k"),
    (dict(top_k=0), "top_k"),
    (dict(x=mx.zeros((4, 31))), "w_gate"),
    (dict(x=mx.zeros((4,))), "hidden"),
    (dict(logits=mx.zeros((3, 8))), "router_logits"),
    (dict(wd=mx.zeros((8, 16, 32))), "w_down"),
    (dict(wu=mx.zeros((8, 16, 32), mx.float16)), "dtype"),
    (dict(x=mx.zeros((4, 32), mx.int32)), "hidden"),
    (dict(scoring="relu"), "scoring"),
])
def test_bad_input(change, match):
    x, logits, wg, wu, wd = make(4, 32, 8, 16, "float32", "float32", seed=2)
    kw = dict(x=x, logits=logits, wg=wg, wu=wu, wd=wd, top_k=2, scoring="softmax")
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        ops.fused_moe(kw["x"], kw["logits"], kw["wg"], kw["wu"], kw["wd"], top_k=kw["top_k"],
                      scoring=kw["scoring"])


def launches_on_numpy(t=7, h=40, e=6, i=24, k=2, dtype="float16", gguf_type=None, seed=4):
    """The planner's launches run on NumPy arrays (emulation.run_plan: the kernel checks of
    test_metal_kernel_checks run them on the checked builds); out against the reference.
    gguf_type: experts as blocks of that type (fused_moe_gguf's plan)."""
    from vllm_metal import emulation
    from test_gguf_fixtures import random_blocks, reference_dequantize

    rng = np.random.default_rng(seed)
    np_dtype = {"float32": np.float32, "float16": np.float16}[dtype]
    x = (rng.standard_normal((t, h)) / h).astype(np_dtype)
    logits = (rng.standard_normal((t, e)) - 0.5 * np.arange(e)).astype(np.float32)
    if gguf_type is None:
        ws = [(rng.standard_normal(s) / np.sqrt(s[2])).astype(np.float32)
              for s in ((e, i, h), (e, i, h), (e, h, i))]
        arrays, dense = ws, [w.astype(np.float64) for w in ws]
        plan = _core.plan_fused_moe(dtype, "float32", num_tokens=t, hidden=h, num_experts=e,
                                    inter=i, top_k=k)
    else:
        arrays, dense = [], []
        for n, (rows, cols) in enumerate(((i, h), (i, h), (h, i))):
            b = random_blocks(gguf_type, e * rows, cols, seed + n)
            arrays.append(np.ascontiguousarray(b).reshape(-1))
            dense.append(reference_dequantize(b, gguf_type, (e * rows, cols)).astype(np.float64)
                         .reshape(e, rows, cols))
        plan = _core.plan_fused_moe_gguf(dtype, gguf_type.name, gguf_type.name, gguf_type.name,
                                         num_tokens=t, hidden=h, num_experts=e, inter=i, top_k=k)
    out = np.zeros((t, h), np_dtype)
    outputs = [out, np.zeros((t, k), np.int32), np.zeros((t, k), np.float32),
               np.zeros((t * k, i), np.float32), np.zeros((t * k, h), np.float32)]
    emulation.run_plan(plan, [x, logits, *arrays, *outputs])
    want = reference(x.astype(np.float64), logits.astype(np.float64), *dense, k)
    err = np.abs(out.astype(np.float64) - want).max() / max(np.abs(want).max(), 1e-30)
    assert err < (1e-5 if dtype == "float32" else 2e-3), err


@pytest.mark.parametrize("gguf_type", [None, "Q4_K"])
def test_launches_on_numpy(gguf_type):
    from test_gguf_fixtures import T

    if gguf_type is None:
        launches_on_numpy()
    else:
        launches_on_numpy(t=9, h=256, e=4, i=256, k=3, dtype="float32", gguf_type=T[gguf_type])


def gpt_oss_biases(e, h, i, seed, dtype="float32"):
    rng = np.random.default_rng(seed)
    return {name: mx.array(rng.standard_normal(shape).astype(np.float32)).astype(DTYPES[dtype])
            for name, shape in (("b_gate", (e, i)), ("b_up", (e, i)), ("b_down", (e, h)))}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}H{}E{}I{}k{}s{}".format(*c))
def test_gpt_oss_variant_matches_reference(backend, case, dtype):
    """gpt-oss: router softmax over the chosen k, expert biases, clamped SwiGLU. Weights
    scaled up so gate/up values cross the clamp at 7."""
    t, h, e, i, k, skew = case
    x, logits, wg, wu, wd = make(t, h, e, i, dtype, dtype, seed=t * 17 + k, skew=skew)
    wg, wu = wg * 6, wu * 6
    biases = gpt_oss_biases(e, h, i, seed=k)
    kw = dict(scoring="softmax_topk", renormalize=False, activation="swiglu_oai", **biases)
    out = ops.fused_moe(x, logits, wg, wu, wd, top_k=k, **kw)
    np_kw = dict(kw, **{n: to_numpy(b) for n, b in biases.items()})
    want = reference(*(to_numpy(a) for a in (x, logits, wg, wu, wd)), k, **np_kw)
    # the clamp is reached (else the test would not see it)
    gate = np.einsum("eih,th->tei", to_numpy(wg), to_numpy(x))
    assert (gate > 7).any()
    assert_close(out, want, dtype, "fused_moe gpt-oss")


@pytest.mark.parametrize("activation,biased,scoring", [
    ("swiglu_oai", False, "softmax"), ("silu", True, "softmax"), ("silu", False, "softmax_topk")])
def test_gpt_oss_options_one_at_a_time(backend, activation, biased, scoring):
    x, logits, wg, wu, wd = make(6, 32, 8, 16, "float32", "float32", seed=8, skew=0.3)
    biases = gpt_oss_biases(8, 32, 16, seed=9) if biased else {}
    kw = dict(scoring=scoring, activation=activation, renormalize=False, **biases)
    out = ops.fused_moe(x, logits, wg * 4, wu * 4, wd, top_k=3, **kw)
    np_kw = dict(kw, **{n: to_numpy(b) for n, b in biases.items()})
    want = reference(*(to_numpy(a) for a in (x, logits, wg * 4, wu * 4, wd)), 3, **np_kw)
    plain = reference(*(to_numpy(a) for a in (x, logits, wg * 4, wu * 4, wd)), 3,
                      renormalize=False)
    assert np.abs(want - plain).max() > 1e-2  # the option changes the result
    assert_close(out, want, "float32", "fused_moe option")


@pytest.mark.parametrize("change,match", [
    (dict(activation="gelu"), "activation"),
    (dict(b_gate=mx.zeros((8, 16))), "all together"),
    (dict(b_gate=mx.zeros((8, 15)), b_up=mx.zeros((8, 16)), b_down=mx.zeros((8, 32))), "b_gate"),
    (dict(b_gate=mx.zeros((8, 16)), b_up=mx.zeros((8, 16)), b_down=mx.zeros((8, 16))), "b_down"),
])
def test_gpt_oss_bad_input(change, match):
    x, logits, wg, wu, wd = make(4, 32, 8, 16, "float32", "float32", seed=2)
    with pytest.raises(ValueError, match=match):
        ops.fused_moe(x, logits, wg, wu, wd, top_k=2, **change)


def test_gpt_oss_launches_on_numpy():
    """The planner with biases (inputs 5-7, outputs shifted to 8-12) run on NumPy arrays."""
    from vllm_metal import emulation

    t, h, e, i, k = 5, 40, 6, 24, 2
    rng = np.random.default_rng(12)
    x = rng.standard_normal((t, h)).astype(np.float32)
    logits = rng.standard_normal((t, e)).astype(np.float32)
    ws = [(3 * rng.standard_normal(s) / np.sqrt(s[2])).astype(np.float32)
          for s in ((e, i, h), (e, i, h), (e, h, i))]
    bs = [rng.standard_normal(s).astype(np.float32) for s in ((e, i), (e, i), (e, h))]
    plan = _core.plan_fused_moe("float32", "float32", num_tokens=t, hidden=h, num_experts=e,
                                inter=i, top_k=k, renormalize=False, topk_softmax=True,
                                oai_act=True, bias=True)
    out = np.zeros((t, h), np.float32)
    outputs = [out, np.zeros((t, k), np.int32), np.zeros((t, k), np.float32),
               np.zeros((t * k, i), np.float32), np.zeros((t * k, h), np.float32)]
    emulation.run_plan(plan, [x, logits, *ws, *bs, *outputs])
    want = reference(x.astype(np.float64), logits.astype(np.float64), *ws, k, renormalize=False,
                     scoring="softmax_topk", activation="swiglu_oai", b_gate=bs[0], b_up=bs[1],
                     b_down=bs[2])
    err = np.abs(out - want).max() / np.abs(want).max()
    assert err < 1e-5, err
