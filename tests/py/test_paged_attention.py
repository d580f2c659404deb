"""paged_attention against the gather-and-softmax reference, CPU and emulated Metal."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from op_harness import DTYPES, TOLERANCE, to_numpy
from paged_attention_reference import paged_attention_reference
from vllm_metal import ops


def make_batch(q_lens, ctx_lens, hq, hkv, d, block_size, dtype, seed, extra_blocks=3):
    """A packed batch: random cache, shuffled block tables, contexts ending in the chunks."""
    rng = np.random.default_rng(seed)
    num_seqs = len(q_lens)
    blocks_per_seq = [math.ceil(c / block_size) for c in ctx_lens]
    max_blocks = max(1, max(blocks_per_seq))
    num_blocks = sum(blocks_per_seq) + extra_blocks
    ids = rng.permutation(num_blocks)
    tables = np.zeros((num_seqs, max_blocks), np.int32)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = ids[used:used + n]
        used += n
    t = sum(q_lens)
    f32 = lambda shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    q = mx.array(f32((t, hq, d))).astype(DTYPES[dtype])
    kc = mx.array(f32((num_blocks, block_size, hkv, d))).astype(DTYPES[dtype])
    vc = mx.array(f32((num_blocks, block_size, hkv, d))).astype(DTYPES[dtype])
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return q, kc, vc, tables, np.array(ctx_lens, np.int32), cu


def run_case(q_lens, ctx_lens, hq, hkv, d, block_size, dtype, seed=0, window=0, softcap=0.0,
             with_sinks=False):
    q, kc, vc, tables, seq_lens, cu = make_batch(q_lens, ctx_lens, hq, hkv, d, block_size, dtype, seed)
    scale = 1.0 / math.sqrt(d)
    sinks = np.random.default_rng(seed + 1).standard_normal(hq).astype(np.float32) if with_sinks else None
    out = ops.paged_attention(
        q, kc, vc, mx.array(tables), mx.array(seq_lens), mx.array(cu), scale=scale,
        sliding_window=window, softcap=softcap, sinks=None if sinks is None else mx.array(sinks))
    ref = paged_attention_reference(to_numpy(q), to_numpy(kc), to_numpy(vc), tables, seq_lens, cu,
                                    scale, window, softcap, sinks)
    got = to_numpy(out)
    assert np.isfinite(got).all()
    err = np.abs(got - ref).max()
    assert err <= 2 * TOLERANCE[dtype], f"max error {err:.3g} ({dtype})"


def case_id(c):
    return "q{}_ctx{}_h{}/{}_d{}_bs{}".format(*c)


# (q_lens, ctx_lens, Hq, Hkv, D, block size): decode only, prefill only, mixed
# batches, chunked prefill continuing a cached context, block-boundary
# contexts (B-1, B, B+1), every head size, GQA ratios 1, 3, 4, 8, 16.
CASES = [
    ([1], [1], 4, 4, 64, 16),
    ([1, 1, 1], [15, 16, 17], 9, 3, 64, 16),
    ([1, 1], [300, 7], 8, 1, 128, 32),
    ([5], [5], 4, 2, 80, 8),
    ([13], [40], 6, 2, 96, 16),  # chunk continuing 27 cached tokens
    ([1, 1, 9, 3], [33, 64, 9, 100], 16, 1, 64, 16),
    ([1, 17], [1, 17], 2, 2, 256, 8),
    ([1, 8, 8], [200, 8, 16], 4, 4, 128, 16),
    ([1, 1, 6], [40, 9, 6], 4, 2, 48, 16),   # llama2.c-style models
    ([1, 11], [77, 30], 4, 1, 120, 16),      # H2O-Danube3-4B
    ([1, 9], [33, 20], 2, 1, 512, 8),        # prefill stages K/V in two 256-dim halves
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(backend, case, dtype):
    run_case(*case, dtype, seed=sum(case[1]))


@pytest.mark.parametrize("window", [1, 5, 16, 1000])
def test_sliding_window(backend, window):
    run_case([1, 1, 20], [50, 8, 30], 8, 2, 64, 16, "float32", seed=3, window=window)


def test_softcap(backend):
    run_case([1, 9], [70, 9], 4, 2, 128, 16, "float16", seed=4, softcap=5.0)


def test_sinks(backend):
    run_case([1, 1, 12], [40, 1, 12], 8, 4, 64, 16, "float32", seed=5, with_sinks=True)


def test_all_features_together(backend):
    run_case([1, 6], [600, 30], 8, 2, 64, 16, "bfloat16", seed=6, window=24, softcap=30.0,
             with_sinks=True)


@pytest.mark.slow
@pytest.mark.parametrize("ctx", [1025, 3000])
def test_long_context_decode_uses_split_kv(backend, ctx):
    # few rows and a long context: the Metal planner splits the keys
    run_case([1, 1], [ctx, 40], 8, 2, 64, 16, "float16", seed=7, window=0)


@pytest.mark.slow
def test_many_sequences(backend):
    rng = np.random.default_rng(8)
    n = 64
    q_lens = [1] * 48 + list(rng.integers(1, 20, size=n - 48))
    ctx_lens = [int(rng.integers(1, 400)) for _ in range(48)] + [int(x + rng.integers(0, 50)) for x in q_lens[48:]]
    run_case(q_lens, ctx_lens, 4, 2, 64, 16, "float16", seed=8)


def test_split_kv_plan_choice():
    from vllm_metal import _core

    plan = _core.plan_paged_attention("float16", 2, 2, 8, 2, 64, 16, 300, 200, num_decode_seqs=2,
                                      max_seq_len=3000, max_query_len=1)
    assert [l.kernel for l in plan] == ["paged_attention_decode_float16_d64",
                                        "paged_attention_reduce_float16_d64"]
    assert plan[0].grid[2] == math.ceil(3000 / 512)
    # many rows fill the GPU without splitting
    plan = _core.plan_paged_attention("float16", 256, 256, 8, 2, 64, 16, 3000, 200,
                                      num_decode_seqs=256, max_seq_len=3000, max_query_len=1)
    assert [l.kernel for l in plan] == ["paged_attention_decode_float16_d64"]
    # mixed batches: decode then prefill, prefill grid over query tiles
    plan = _core.plan_paged_attention("bfloat16", 21, 3, 8, 2, 128, 16, 30, 20, num_decode_seqs=1,
                                      max_seq_len=100, max_query_len=17)
    assert [l.kernel for l in plan] == ["paged_attention_decode_bfloat16_d128",
                                        "paged_attention_prefill_bfloat16_d128"]
    assert list(plan[1].grid) == [3, 8, 2]


def test_lazy_metadata_needs_hints_and_is_checked_at_eval():
    q, kc, vc, tables, seq_lens, cu = make_batch([1, 4], [10, 4], 4, 2, 64, 16, "float32", 9)
    lazy = mx.array(seq_lens) + 0
    with pytest.raises(ValueError, match="planning hints"):
        ops.paged_attention(q, kc, vc, mx.array(tables), lazy, mx.array(cu), scale=0.1)
    bad = mx.array(seq_lens) * 100  # beyond the block table, known only at eval
    out = ops.paged_attention(q, kc, vc, mx.array(tables), bad, mx.array(cu), scale=0.1,
                              num_decode_seqs=1, max_seq_len=1000, max_query_len=4)
    with pytest.raises(RuntimeError, match=r"seq_lens\[0\] = 1000 is beyond the block table"):
        mx.eval(out)


def _valid():
    q, kc, vc, tables, seq_lens, cu = make_batch([1, 3], [5, 3], 4, 2, 64, 16, "float32", 10)
    return dict(q=q, key_cache=kc, value_cache=vc, block_tables=mx.array(tables),
                seq_lens=mx.array(seq_lens), cu_seqlens_q=mx.array(cu)), tables, seq_lens, cu


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a, t, s, c: a.update(block_tables=mx.array(np.where(t == t[0, 0], 999, t).astype(np.int32))),
         r"block_tables\[0, 0\] = 999 is outside the cache's"),
        (lambda a, t, s, c: a.update(seq_lens=mx.array(np.array([5, 40], np.int32))),
         r"seq_lens\[1\] = 40 is beyond the block table"),
        (lambda a, t, s, c: a.update(seq_lens=mx.array(np.array([5, 2], np.int32))),
         r"seq_lens\[1\] = 2 is shorter than its 3 new tokens"),
        (lambda a, t, s, c: a.update(cu_seqlens_q=mx.array(np.array([0, 1, 3], np.int32))),
         r"cu_seqlens_q\[-1\] must equal the number of query tokens 4"),
        (lambda a, t, s, c: a.update(key_cache=a["key_cache"][:, :, :1], value_cache=a["value_cache"][:, :, :1]),
         None),  # fine: GQA 4:1
        (lambda a, t, s, c: a.update(key_cache=a["key_cache"][..., :32], value_cache=a["value_cache"][..., :32]),
         r"head size mismatch: q has 64, the cache 32"),
        (lambda a, t, s, c: a.update(q=a["q"][:, :3]), r"q heads \(3\) must be a multiple of kv heads \(2\)"),
        (lambda a, t, s, c: a.update(seq_lens=mx.array(s.astype(np.int64))), r"seq_lens must be int32, got int64"),
        (lambda a, t, s, c: a.update(key_cache=a["key_cache"].astype(mx.float16)), r"caches must have q's dtype"),
    ],
)
def test_bad_metadata_raises_a_clear_error(change, message):
    args, tables, seq_lens, cu = _valid()
    change(args, tables, seq_lens, cu)
    if message is None:
        mx.eval(ops.paged_attention(**args, scale=0.1))
        return
    with pytest.raises(ValueError, match=message):
        ops.paged_attention(**args, scale=0.1)


def test_sinks_must_match_heads():
    args, *_ = _valid()
    with pytest.raises(ValueError, match=r"sinks must be float32 \[4\]"):
        ops.paged_attention(**args, scale=0.1, sinks=mx.zeros((3,)))


def test_split_kv_launches_on_numpy_with_many_partitions():
    """The decode + reduce launches with tiny partitions, on NumPy buffers, guard-checked."""
    from vllm_metal import _core, emulation

    q, kc, vc, tables, seq_lens, cu = make_batch([1, 1, 1], [70, 3, 33], 8, 2, 64, 8, "float32", 11)
    qn, kcn, vcn = (np.array(a) for a in (q, kc, vc))
    parts_size = 16
    plan = _core.plan_paged_attention("float32", 3, 3, 8, 2, 64, 8, kcn.shape[0], tables.shape[1],
                                      num_decode_seqs=3, max_seq_len=70, max_query_len=1,
                                      scale=0.125, partition_size=parts_size)
    assert [l.kernel for l in plan][-1] == "paged_attention_reduce_float32_d64"
    parts = plan[0].grid[2]
    assert parts == 5
    guard = np.full(64, 7.0, np.float32)
    out = np.zeros(3 * 8 * 64 + 128, np.float32)
    out[:64] = guard
    out[-64:] = guard
    scratch = [np.zeros((3, 8, parts, 64), np.float32), np.zeros((3, 8, parts), np.float32),
               np.zeros((3, 8, parts), np.float32)]
    emulation.run_plan(plan, [qn, kcn, vcn, tables, seq_lens, cu, np.zeros(1, np.float32),
                              out[64:-64], *scratch])
    ref = paged_attention_reference(qn.astype(np.float64), kcn, vcn, tables, seq_lens, cu, 0.125)
    np.testing.assert_allclose(out[64:-64].reshape(3, 8, 64), ref, atol=1e-5)
    assert (out[:64] == guard).all() and (out[-64:] == guard).all()


def test_every_metal_head_size_is_tested():
    from vllm_metal import _core

    assert set(_core.metal_attention_head_sizes()) <= {c[4] for c in CASES}


@pytest.mark.parametrize("d, metal, problem", [
    (40, False, ""),
    (40, True, "the Metal kernels support head sizes 48, 64, 80, 96, 120, 128, 256, 512, got 40"),
    (100, False, "head size must be a multiple of 8 up to 512, got 100"),
    (576, True, "head size must be a multiple of 8 up to 512, got 576"),
    (512, True, ""),
])
def test_head_size_problem_names_the_rule(d, metal, problem):
    from vllm_metal import _core

    assert _core.paged_attention_head_size_problem(d, metal=metal) == problem
