"""fused_moe against a float64 NumPy reference (both backends): uneven expert loads,
experts with no tokens, top-k of 1, 2 and 8, softmax and sigmoid routing, mixed
dtypes; the emulated launches' planner; the errors."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from op_harness import DTYPES, TOLERANCE, assert_close, to_numpy
from vllm_metal import _core, ops


def reference(x, logits, wg, wu, wd, top_k, renormalize=True, scoring="softmax"):
    """float64 routing + SwiGLU experts, looping token by token (obviously right).
    Ties choose the lower expert id (a stable sort of -logits)."""
    t_n = x.shape[0]
    out = np.zeros_like(x)
    if scoring == "softmax":
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
    else:
        p = 1.0 / (1.0 + np.exp(-logits))
    for t in range(t_n):
        chosen = np.argsort(-logits[t], kind="stable")[:top_k]
        w = p[t, chosen]
        if renormalize:
            w = w / w.sum()
        for e, we in zip(chosen, w):
            g = wg[e] @ x[t]
            u = wu[e] @ x[t]
            out[t] += we * (wd[e] @ (g / (1.0 + np.exp(-g)) * u))
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
