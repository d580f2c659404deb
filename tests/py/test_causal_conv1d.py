"""causal_conv1d against a float64 NumPy reference (both backends), against mlx's own
depthwise conv1d as mlx-lm's Qwen3.5 GatedDeltaNet applies it, chunks shorter than K-1,
state across chunked-prefill steps, donation, the errors."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import hybrid_reference as ref
from op_harness import DTYPES, assert_close, to_numpy
from vllm_metal import _core, emulation, ops

CASES = [
    # (lengths, channels, width, bias)
    ((1, 1, 1), 8, 4, True),          # decode
    ((5, 2, 1, 13), 37, 4, False),    # chunks shorter than K-1, odd channels
    ((3, 0, 7), 130, 2, True),        # width 2, an empty sequence, > 128 channels
    ((9,), 5, 8, True),               # the widest kernel
]


def case_id(c):
    lengths, ch, w, bias = c
    return f"conv(len={list(lengths)},c={ch},k={w},{'bias' if bias else 'nobias'})"


def make(lengths, channels, width, bias, dtype, seed, num_slots=None):
    rng = np.random.default_rng(seed)
    n = len(lengths)
    num_slots = num_slots or n + 2
    cast = lambda x: mx.array(x.astype(np.float32)).astype(DTYPES[dtype])  # noqa: E731
    x = cast(rng.standard_normal((sum(lengths), channels)))
    w = cast(rng.standard_normal((channels, width)) * 0.5)
    b = cast(rng.standard_normal(channels)) if bias else None
    state = cast(rng.standard_normal((num_slots, channels, width - 1)))
    slots = rng.permutation(num_slots)[:n].astype(np.int32)
    has_init = (np.arange(n) % 2 == 0).astype(np.int32)
    return x, w, b, state, slots, has_init


def run(x, w, b, state, lengths, slots, has_init=None, **kw):
    return ops.causal_conv1d(x, w, b, conv_state=state,
                             cu_seqlens=ref.i32(ref.cu_seqlens_of(lengths)),
                             slots=ref.i32(slots),
                             has_initial_state=None if has_init is None else ref.i32(has_init),
                             **kw)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(backend, case, dtype):
    lengths, ch, width, bias = case
    x, w, b, state, slots, has_init = make(lengths, ch, width, bias, dtype, seed=ch)
    out, new_state = run(x, w, b, state, lengths, slots, has_init)
    out_ref, s_ref = ref.causal_conv1d(to_numpy(x), to_numpy(w), None if b is None else to_numpy(b),
                                       to_numpy(state), ref.cu_seqlens_of(lengths), slots,
                                       has_init)
    assert out.dtype == x.dtype and new_state.dtype == x.dtype
    assert_close(out, out_ref, dtype, case_id(case) + " out")
    assert_close(new_state, s_ref, dtype, case_id(case) + " state")


def test_without_silu(backend):
    x, w, b, state, slots, _ = make((4, 2), 6, 3, True, "float32", seed=1)
    out, _ = run(x, w, b, state, (4, 2), slots, silu=False)
    out_ref, _ = ref.causal_conv1d(to_numpy(x), to_numpy(w), to_numpy(b), to_numpy(state),
                                   ref.cu_seqlens_of((4, 2)), slots, silu=False)
    assert_close(out, out_ref, "float32", "no silu")


def test_silu_at_large_magnitudes(backend):
    # pre-activations far into both tails (the CPU's vector exp clamps its argument)
    x, w, b, state, slots, _ = make((5, 4), 19, 4, True, "float32", seed=6)
    x, w = x * 40.0, w * 2.0
    out, _ = run(x, w, b, state, (5, 4), slots)
    out_ref, _ = ref.causal_conv1d(to_numpy(x), to_numpy(w), to_numpy(b), to_numpy(state),
                                   ref.cu_seqlens_of((5, 4)), slots)
    assert np.abs(to_numpy(x)).max() > 90
    assert_close(out, out_ref, "float32", "large |x|")


def test_matches_mlx_depthwise_conv_as_in_mlx_lm():
    # mlx-lm Qwen3.5: conv_input = concat([conv_state [B, K-1, C], qkv]), then
    # silu(nn.Conv1d(groups=C, padding=0)) and the new state = conv_input[:, -(K-1):]
    c, k, length = 12, 4, 7
    x, w, _, state, _, _ = make((length,), c, k, False, "float32", seed=9, num_slots=1)
    conv_in = mx.concatenate([state.transpose(0, 2, 1), x[None]], axis=1)  # [1, K-1+L, C]
    y = mx.conv1d(conv_in, w[:, :, None], groups=c)  # weight [C_out, K, C_in / groups]
    y_ref = y * mx.sigmoid(y)
    out, new_state = run(x, w, None, state, (length,), [0])
    assert_close(out, to_numpy(y_ref[0]), "float32", "vs mx.conv1d")
    assert_close(new_state, to_numpy(conv_in[:, -(k - 1):].transpose(0, 2, 1)), "float32",
                 "state vs mlx-lm")


@pytest.mark.parametrize("steps", [(1,) * 13, (2, 7, 1, 3), (13,)],
                         ids=["one-by-one", "short-chunks", "whole"])
def test_state_across_chunked_prefill_equals_one_prefill(backend, steps):
    ch, width = 10, 4
    x, w, b, state, _, _ = make((13,), ch, width, True, "float16", seed=2, num_slots=2)
    out_one, s_one = run(x, w, b, state, (13,), [1], [0])
    outs, st, start = [], state, 0
    for i, step in enumerate(steps):
        out, st = run(x[start:start + step], w, b, st, (step,), [1], [int(i > 0)])
        outs.append(out)
        start += step
    assert mx.array_equal(mx.concatenate(outs), out_one).item()
    assert mx.array_equal(st, s_one).item()


def test_state_is_copied_unless_inplace(backend):
    x, w, b, state, slots, _ = make((3, 2), 64, 4, True, "float32", seed=3, num_slots=256)
    before = np.array(state)
    out1, s1 = run(x, w, b, state, (3, 2), slots)
    mx.eval(out1, s1)
    np.testing.assert_array_equal(np.array(state), before)  # the old state is intact
    old = state * 1.0
    mx.eval(old)
    mx.reset_peak_memory()
    active = mx.get_active_memory()
    out2, s2 = run(x, w, b, old, (3, 2), slots, inplace=True)
    mx.eval(out2, s2)
    assert mx.get_peak_memory() - active < old.nbytes / 2  # no second state buffer
    assert mx.array_equal(out1, out2).item() and mx.array_equal(s1, s2).item()
    assert mx.array_equal(old, s2).item()


def test_kernel_names_are_instantiated():
    names = {l.kernel for d in DTYPES for l in
             _core.plan_causal_conv1d(d, 3, 5, 64, 4, copy_state=True)}
    assert names <= set(emulation.library("causal_conv1d").kernels)


def _bad(**override):
    x, w, b, state, slots, _ = make((2, 1), 4, 3, True, "float32", seed=4)
    kw = dict(x=x, weight=w, bias=b, conv_state=state, cu_seqlens=ref.i32([0, 2, 3]),
              slots=ref.i32(slots))
    kw.update(override)
    return lambda: ops.causal_conv1d(**kw)


@pytest.mark.parametrize(
    "make_call, message",
    [
        (_bad(x=mx.zeros((3, 4), mx.int32)), r"\[causal_conv1d\] x must be float32, float16 or bfloat16, got int32"),
        (_bad(x=mx.zeros((3, 4, 1))), r"x must be \[num_tokens, channels\], got \[3, 4, 1\]"),
        (_bad(weight=mx.zeros((4, 9))), r"weight must be \[4, width\] with width in \[2, 8\], got \[4, 9\]"),
        (_bad(weight=mx.zeros((4, 3), mx.float16)), r"weight must have x's dtype float32, got float16"),
        (_bad(bias=mx.zeros((5,))), r"bias must be \[4\], got \[5\]"),
        (_bad(conv_state=mx.zeros((4, 4, 3))), r"conv_state must be \[num_slots, 4, 2\], got \[4, 4, 3\]"),
        (_bad(slots=ref.i32([0, 4])), r"slots\[1\] = 4 is out of range for a state of 4 slots"),
        (_bad(cu_seqlens=ref.i32([1, 2, 3])), r"cu_seqlens\[0\] must be 0, got 1"),
        (_bad(cu_seqlens=mx.array([0, 2, 3])[None]), r"cu_seqlens must be \[num_seqs \+ 1\]|cu_seqlens must be int32"),
        (_bad(has_initial_state=mx.zeros((3,), mx.int32)), r"has_initial_state must be \[2\], got \[3\]"),
    ],
)
def test_bad_input_raises_a_clear_error(make_call, message):
    with pytest.raises(ValueError, match=message):
        make_call()
