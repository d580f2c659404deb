"""varlen_attention (encoder attention over packed variable-length sequences, contiguous
q/k/v, and any view of them) against a float64 NumPy reference on both backends; bidirectional and causal, with and
without a sliding window (|i - j| < window: Gemma 3's bidirectional sliding layers); a
sequence's rows unaffected by its neighbours; against MLX's own scaled_dot_product_attention;
the errors."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from op_harness import DTYPES, assert_close, to_numpy
from vllm_metal import _core, emulation, ops

CASES = [
    # (lengths, num_q_heads, num_kv_heads, head_size)
    ((1,), 1, 1, 8),                 # one row
    ((5, 1, 13), 4, 4, 32),          # BERT-like: heads = kv heads
    ((3, 0, 9, 2), 6, 2, 20),        # grouped heads, an empty sequence, head_size not /32
    ((17, 33), 2, 1, 64),            # rows past a (causal) query tile
    ((150, 7), 2, 2, 40),            # rows past a bidirectional tile; 16 + 16 + 8 dims
    ((4,), 2, 2, 256),               # the widest head
]


def case_id(c):
    lengths, hq, hkv, d = c
    return f"len={list(lengths)},hq={hq},hkv={hkv},d={d}"


def cu_of(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def reference(q, k, v, cu, scale, causal, window=0):
    """float64 softmax(scale q k^T) v per sequence, per head; window > 0: keys |i - j| < window."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    t, hq, d = q.shape
    group = hq // k.shape[1]
    out = np.zeros((t, hq, d))
    for s, e in zip(cu[:-1], cu[1:]):
        if s == e:
            continue
        for h in range(hq):
            scores = scale * q[s:e, h] @ k[s:e, h // group].T
            if causal:
                scores = np.where(np.tril(np.ones_like(scores, bool)), scores, -np.inf)
            if window:
                i, j = np.indices(scores.shape)
                scores = np.where(np.abs(i - j) < window, scores, -np.inf)
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[s:e, h] = (p / p.sum(axis=1, keepdims=True)) @ v[s:e, h // group]
    return out


def make(lengths, hq, hkv, d, dtype, seed):
    rng = np.random.default_rng(seed)
    t = sum(lengths)
    cast = lambda a: mx.array(a.astype(np.float32)).astype(DTYPES[dtype])  # noqa: E731
    q = cast(rng.standard_normal((t, hq, d)) * 1.5)
    k = cast(rng.standard_normal((t, hkv, d)))
    v = cast(rng.standard_normal((t, hkv, d)))
    return q, k, v


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(backend, case, dtype, causal):
    lengths, hq, hkv, d = case
    q, k, v = make(lengths, hq, hkv, d, dtype, seed=d + hq)
    cu = cu_of(lengths)
    scale = d ** -0.5
    out = ops.varlen_attention(q, k, v, cu_seqlens=mx.array(cu), scale=scale, causal=causal)
    assert out.dtype == q.dtype and out.shape == q.shape
    want = reference(to_numpy(q), to_numpy(k), to_numpy(v), cu, scale, causal)
    assert_close(out, want, dtype, case_id(case))


WINDOW_CASES = [
    # (lengths, num_q_heads, num_kv_heads, head_size, window)
    ((9,), 2, 2, 16, 1),              # each row sees itself only
    ((40, 3, 70), 4, 2, 32, 5),       # windows inside query tiles and across them
    ((33, 12), 2, 1, 20, 16),         # head_size not /8 (the generic CPU tile)
    ((6, 10), 2, 2, 8, 64),           # window longer than every sequence: no effect
]


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: case_id(c[:4]) + f",w={c[4]}")
def test_sliding_window_matches_reference(backend, case, dtype, causal):
    lengths, hq, hkv, d, window = case
    q, k, v = make(lengths, hq, hkv, d, dtype, seed=d + window)
    cu = cu_of(lengths)
    out = ops.varlen_attention(q, k, v, cu_seqlens=mx.array(cu), scale=d ** -0.5, causal=causal,
                               window=window)
    want = reference(to_numpy(q), to_numpy(k), to_numpy(v), cu, d ** -0.5, causal, window)
    assert_close(out, want, dtype, f"window {window}")
    if window < max(lengths):  # the window changed something
        full = reference(to_numpy(q), to_numpy(k), to_numpy(v), cu, d ** -0.5, causal)
        assert not np.allclose(to_numpy(out).astype(np.float64), full, atol=1e-2)


def test_bidirectional_rows_see_later_keys(backend):
    # the first row of a sequence differs between causal and bidirectional; the last agrees
    q, k, v = make((6,), 2, 2, 16, "float32", seed=3)
    cu = mx.array(cu_of((6,)))
    bi = ops.varlen_attention(q, k, v, cu_seqlens=cu, scale=0.25)
    ca = ops.varlen_attention(q, k, v, cu_seqlens=cu, scale=0.25, causal=True)
    assert not np.allclose(to_numpy(bi[0]), to_numpy(ca[0]))
    np.testing.assert_allclose(to_numpy(bi[-1]), to_numpy(ca[-1]), rtol=1e-5, atol=1e-6)


def test_a_sequence_alone_equals_it_in_a_batch(backend):
    lengths = (7, 3, 12)
    q, k, v = make(lengths, 4, 4, 32, "float32", seed=5)
    batch = ops.varlen_attention(q, k, v, cu_seqlens=mx.array(cu_of(lengths)), scale=0.2)
    alone = ops.varlen_attention(q[7:10], k[7:10], v[7:10], cu_seqlens=mx.array(cu_of((3,))),
                                 scale=0.2)
    np.testing.assert_allclose(to_numpy(batch[7:10]), to_numpy(alone), rtol=1e-6, atol=1e-6)


def test_matches_mlx_sdpa():
    # MLX's fused attention, [B, H, L, D], one sequence without a mask
    q, k, v = make((11,), 3, 3, 32, "float32", seed=8)
    out = ops.varlen_attention(q, k, v, cu_seqlens=mx.array(cu_of((11,))), scale=0.3)
    t = lambda a: a.transpose(1, 0, 2)[None]  # noqa: E731
    want = mx.fast.scaled_dot_product_attention(t(q), t(k), t(v), scale=0.3)
    assert_close(out, to_numpy(want[0].transpose(1, 0, 2)), "float32", "vs mx sdpa")


def test_strided_inputs(backend):
    # q, k, v sliced out of one fused projection (not row-contiguous)
    rng = np.random.default_rng(2)
    qkv = mx.array(rng.standard_normal((9, 3, 2, 16)).astype(np.float32))
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    cu = cu_of((4, 5))
    out = ops.varlen_attention(q, k, v, cu_seqlens=mx.array(cu), scale=0.25)
    assert_close(out, reference(to_numpy(q), to_numpy(k), to_numpy(v), cu, 0.25, False),
                 "float32", "strided")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_layout_gives_the_dense_inputs_result(backend, dtype):
    # the CPU kernel reads token rows in place when each token's heads are dense (slices of a
    # fused [T, 3, H, D] projection) and gathers other layouts first; same sums either way
    rng = np.random.default_rng(4)
    lengths, h, d = (3, 20, 1), 4, 40  # a tail of 8 dims; a 1-row sequence
    t = sum(lengths)
    cu = mx.array(cu_of(lengths))
    fused = mx.array(rng.standard_normal((t, 3, h, d)).astype(np.float32)).astype(DTYPES[dtype])
    dense = [mx.array(to_numpy(fused[:, i])).astype(DTYPES[dtype]) for i in range(3)]
    want = to_numpy(ops.varlen_attention(*dense, cu_seqlens=cu, scale=0.2))
    heads_apart = fused.transpose(0, 2, 1, 3)  # [T, H, 3, D]: a token's heads 3 D apart
    layouts = {
        "fused projection slices": [fused[:, i] for i in range(3)],
        "heads not dense": [heads_apart[:, :, i] for i in range(3)],
        "tokens reversed twice": [a[::-1][::-1] for a in dense],
        "head-major transposed": [mx.contiguous(a.transpose(1, 0, 2)).transpose(1, 0, 2) for a in dense],
    }
    for name, (q, k, v) in layouts.items():
        got = to_numpy(ops.varlen_attention(q, k, v, cu_seqlens=cu, scale=0.2))
        np.testing.assert_array_equal(got, want, err_msg=name)
    # tokens in reverse (a negative token stride, if MLX keeps the view) against dense copies
    backwards = [a[::-1] for a in dense]
    copies = [mx.array(to_numpy(a)).astype(DTYPES[dtype]) for a in backwards]
    np.testing.assert_array_equal(to_numpy(ops.varlen_attention(*backwards, cu_seqlens=cu, scale=0.2)),
                                  to_numpy(ops.varlen_attention(*copies, cu_seqlens=cu, scale=0.2)))


def test_kernel_names_are_instantiated():
    heads = _core.varlen_attention_tiled_head_sizes()
    assert {32, 64, 128, 256} <= set(heads)  # the BERT family's heads and Gemma 3's
    names = {l.kernel for dt in DTYPES for d in [*heads, 40] for l in
             _core.plan_varlen_attention(dt, 10, 2, 4, 2, d, 0.1)}
    assert {n for n in names if "tiled" in n} and {n for n in names if "tiled" not in n}
    assert names <= set(emulation.library("varlen_attention").kernels)


def test_tiled_grid_covers_the_longest_sequence():
    # 8 query rows a simdgroup: (tiles of the longest sequence, q heads, sequences)
    (tiled,) = _core.plan_varlen_attention("float16", 30, 3, 4, 2, 64, 0.1, max_seq_len=17)
    assert "tiled" in tiled.kernel and list(tiled.grid) == [3, 4, 3]
    (unknown,) = _core.plan_varlen_attention("float16", 30, 3, 4, 2, 64, 0.1)
    assert list(unknown.grid) == [4, 4, 3]  # without the longest: any row could be one sequence's
    (simd,) = _core.plan_varlen_attention("float16", 30, 3, 4, 2, 40, 0.1, max_seq_len=17)
    assert "tiled" not in simd.kernel and list(simd.grid) == [30, 4, 1]


def _bad(**override):
    q, k, v = make((2, 1), 2, 1, 8, "float32", seed=4)
    kw = dict(q=q, k=k, v=v, cu_seqlens=mx.array([0, 2, 3], mx.int32), scale=0.5)
    kw.update(override)
    return lambda: ops.varlen_attention(**kw)


@pytest.mark.parametrize(
    "make_call, message",
    [
        (_bad(q=mx.zeros((3, 2, 8), mx.int32)), r"\[varlen_attention\] q must be float32, float16 or bfloat16, got int32"),
        (_bad(q=mx.zeros((3, 16))), r"q must be \[num_tokens, num_q_heads, head_size\], got \[3, 16\]"),
        (_bad(k=mx.zeros((3, 1, 8), mx.float16)), r"k must have q's dtype float32, got float16"),
        (_bad(v=mx.zeros((4, 1, 8))), r"v must be \[3, num_kv_heads, 8\]"),
        (_bad(k=mx.zeros((3, 3, 8)), v=mx.zeros((3, 3, 8))), r"num_q_heads 2 must be a positive multiple of num_kv_heads 3"),
        (_bad(q=mx.zeros((3, 2, 300)), k=mx.zeros((3, 1, 300)), v=mx.zeros((3, 1, 300))), r"head_size must be in \[1, 256\], got 300"),
        (_bad(cu_seqlens=mx.array([0, 2, 3], mx.int64)), r"cu_seqlens must be int32, got int64"),
        (_bad(cu_seqlens=mx.array([1, 2, 3], mx.int32)), r"cu_seqlens\[0\] must be 0, got 1"),
        (_bad(cu_seqlens=mx.array([0, 3, 2], mx.int32)), r"cu_seqlens must be non-decreasing"),
        (_bad(cu_seqlens=mx.array([0, 2, 4], mx.int32)), r"cu_seqlens\[-1\] must be the number of rows 3, got 4"),
        (_bad(cu_seqlens=mx.array([0], mx.int32)), r"cu_seqlens must be \[num_seqs \+ 1\]"),
        (_bad(scale=float("nan")), r"scale must be finite"),
        (_bad(window=-1), r"window must be 0 \(none\) or a positive key distance, got -1"),
    ],
)
def test_bad_input_raises_a_clear_error(make_call, message):
    with pytest.raises(ValueError, match=message):
        make_call()


def launches_on_numpy(causal=False, window=0, d=40):
    """The planner's launches run directly on NumPy arrays (also under the emulator's race and
    bounds checks: test_metal_kernel_checks); nothing is written outside the output."""
    from test_hybrid_launches import guarded, guards_intact

    # an empty sequence; d = 40: two 32-dim chunks of the simd kernel; the tiled kernel's
    # rows past a tile (10 = 8 + 2) and a one-row sequence
    lengths, hq, hkv = (3, 0, 10, 1), 4, 2
    q, k, v = (to_numpy(a).astype(np.float32) for a in make(lengths, hq, hkv, d, "float32", seed=6))
    cu = cu_of(lengths)
    out, back = guarded(q.shape, np.float32)
    plan = _core.plan_varlen_attention("float32", q.shape[0], len(lengths), hq, hkv, d, 0.2,
                                       causal, window, max_seq_len=max(lengths))
    assert ("tiled" in plan[0].kernel) == (d in _core.varlen_attention_tiled_head_sizes())
    emulation.run_plan(plan, [q, k, v, cu, out])
    assert guards_intact(back)
    np.testing.assert_allclose(out, reference(q, k, v, cu, 0.2, causal, window), atol=2e-5,
                               rtol=2e-5)


@pytest.mark.parametrize("window", [0, 3], ids=["no window", "window"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("d", [40, 32], ids=["simd kernel", "tiled kernel"])
def test_launches_on_numpy(d, causal, window):
    launches_on_numpy(causal, window, d)


def test_tiled_kernel_reads_each_key_once_per_eight_rows():
    # counted in the emulator: a 64-row sequence is 8 tiles, each loading the sequence's 64
    # keys and values once (the simd kernel loads them once per row: 8x as much)
    length, d = 64, 32
    q, k, v = (to_numpy(a).astype(np.float32) for a in make((length,), 1, 1, d, "float32", seed=9))
    cu = cu_of((length,))
    (launch,) = _core.plan_varlen_attention("float32", length, 1, 1, 1, d, 0.2, max_seq_len=length)
    assert "tiled" in launch.kernel
    out, counts = np.zeros_like(q), []
    emulation.run_plan([launch], [q, k, v, cu, out], counts=counts)
    np.testing.assert_allclose(out, reference(q, k, v, cu, 0.2, False), atol=2e-5, rtol=2e-5)
    tiles = length // 8
    for slot in (1, 2):  # k, v
        assert counts[0].buffers[slot].read == tiles * length * d * 4
    assert counts[0].buffers[0].read == length * d * 4  # each query once
