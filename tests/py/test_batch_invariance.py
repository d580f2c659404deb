"""Batch invariance of the CPU kernels (VLLM_BATCH_INVARIANT): row r of a batch is bitwise the
same row computed alone, whatever else shares the call, for every op on the serving path.

The Metal kernels' counterpart (emulated) is test_batch_invariance_metal.py; the served
end-to-end check is test_serving_batch_invariance.py; gguf_matmul's every-type, every-ISA
property test is GgufCpu.BatchInvariantRowsAreBitIdentical (tests/cpp/test_gguf.cpp).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from op_harness import DTYPES, assert_same_bits
from vllm_metal import _core, ops
from vllm_metal.models.gguf_loader import GGUFCheckpoint
from vllm_metal.models.offline import smollm2_gguf


@pytest.fixture(autouse=True)
def _invariant_mode():
    previous = ops.batch_invariant()
    ops.set_batch_invariant(True)
    yield
    ops.set_batch_invariant(previous)


# ---- gguf_matmul: the case of issue 30 --------------------------------------------------------

def smollm2_tensor(name: str):
    ckpt = GGUFCheckpoint(str(smollm2_gguf()))
    w = ckpt.blocks(name)
    return w.blocks, ckpt.tensors[name].type_name, w.shape[0], w.shape[1]


@pytest.mark.parametrize("exact", [True, False], ids=["float32-sums", "int8-activations"])
def test_smollm2_ffn_up_row_alone_equals_the_row_batched(exact):
    blocks, type_name, n, k = smollm2_tensor("blk.0.ffn_up.weight")
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((33, k)).astype(np.float32))
    alone = ops.gguf_matmul(x[:1], blocks, type_name, [n, k], exact=exact)
    for m in (2, 9, 17, 25, 33):  # every row-count switch of the default path
        batched = ops.gguf_matmul(x[:m], blocks, type_name, [n, k], exact=exact)
        assert_same_bits(batched[:1], alone, f"{type_name} m={m}")
        last = ops.gguf_matmul(x[m - 1:m], blocks, type_name, [n, k], exact=exact)
        assert_same_bits(batched[m - 1:m], last, f"{type_name} m={m} last row")


# ---- attention: decode rows, prefill chunks of any split, cached prefixes ---------------------

def random_batch(rng, num_seqs, hq, hkv, d, block_size, dtype):
    """Decode rows first, then prefill chunks continuing cached contexts; a random cache."""
    decode = int(rng.integers(0, num_seqs + 1))
    q_lens = [1] * decode + [int(rng.integers(2, 40)) for _ in range(num_seqs - decode)]
    ctx_lens = [q + int(rng.integers(0, 70)) for q in q_lens]
    max_blocks = max(math.ceil(c / block_size) for c in ctx_lens)
    num_blocks = num_seqs * max_blocks + 2
    tables = rng.permutation(num_blocks)[: num_seqs * max_blocks].reshape(num_seqs, max_blocks)
    cast = lambda shape: mx.array(rng.standard_normal(shape).astype(np.float32)).astype(DTYPES[dtype])  # noqa: E731
    q = cast((sum(q_lens), hq, d))
    kc = cast((num_blocks, block_size, hkv, d))
    vc = cast((num_blocks, block_size, hkv, d))
    return q, kc, vc, tables.astype(np.int32), q_lens, ctx_lens


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("hq, hkv, d, window, softcap", [
    (9, 3, 64, 0, 0.0),     # SmolLM2
    (4, 1, 256, 24, 0.0),   # Gemma 3's local layers (sliding window)
    (8, 2, 128, 0, 30.0),   # soft-capped logits
])
def test_attention_row_alone_equals_the_row_in_any_batch(dtype, hq, hkv, d, window, softcap):
    rng = np.random.default_rng(hq * d + window)
    for trial in range(3):
        q, kc, vc, tables, q_lens, ctx_lens = random_batch(rng, 1 + trial * 3, hq, hkv, d, 16, dtype)
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        kw = dict(scale=1 / math.sqrt(d), sliding_window=window, softcap=softcap)
        out = ops.paged_attention(q, kc, vc, mx.array(tables), mx.array(np.array(ctx_lens, np.int32)),
                                  mx.array(cu), **kw)
        for s, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens)):
            # every row of the sequence as a one-token step at its position (a decode row, or
            # the last token of a chunk that ends there), and the chunk split in two
            for r in range(q_len):
                row = int(cu[s]) + r
                alone = ops.paged_attention(q[row:row + 1], kc, vc, mx.array(tables[s:s + 1]),
                                            mx.array(np.array([ctx - q_len + r + 1], np.int32)),
                                            mx.array(np.array([0, 1], np.int32)), **kw)
                assert_same_bits(out[row:row + 1], alone, f"seq {s} row {r} of {q_len}")
            if q_len > 2:
                cut = q_len // 2  # the chunk's second half, its first half already cached
                second = ops.paged_attention(q[int(cu[s]) + cut:int(cu[s + 1])], kc, vc,
                                             mx.array(tables[s:s + 1]), mx.array(np.array([ctx], np.int32)),
                                             mx.array(np.array([0, q_len - cut], np.int32)), **kw)
                assert_same_bits(out[int(cu[s]) + cut:int(cu[s + 1])], second, f"seq {s} split at {cut}")


# ---- row-wise ops ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", list(DTYPES))
def test_norms_and_rope_rows_alone_equal_the_rows_batched(dtype):
    rng = np.random.default_rng(3)
    cast = lambda a: mx.array(a.astype(np.float32)).astype(DTYPES[dtype])  # noqa: E731
    t, h = 37, 576
    x, res, w = cast(rng.standard_normal((t, h))), cast(rng.standard_normal((t, h))), cast(rng.standard_normal(h))
    qh = cast(rng.standard_normal((t, 9, 64)))
    pos = mx.array(rng.integers(0, 4096, t).astype(np.int32))
    y = ops.rms_norm(x, w, 1e-6)
    y2, r2 = ops.add_rms_norm(x, res, w, 1e-6)
    ry = ops.rope(qh, pos, is_neox=True, base=10000.0)
    for r in (0, 5, t - 1):
        assert_same_bits(y[r:r + 1], ops.rms_norm(x[r:r + 1], w, 1e-6), f"rms_norm row {r}")
        a2, b2 = ops.add_rms_norm(x[r:r + 1], res[r:r + 1], w, 1e-6)
        assert_same_bits(y2[r:r + 1], a2, f"add_rms_norm row {r}")
        assert_same_bits(r2[r:r + 1], b2, f"add_rms_norm residual row {r}")
        assert_same_bits(ry[r:r + 1], ops.rope(qh[r:r + 1], pos[r:r + 1], is_neox=True, base=10000.0),
                         f"rope row {r}")


# ---- hybrid layers: a sequence's outputs and state alone, batched, and in chunks --------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gated_delta_and_conv1d_sequence_alone_equals_batched_and_chunked(dtype):
    rng = np.random.default_rng(11)
    cast = lambda a: mx.array(a.astype(np.float32)).astype(DTYPES[dtype])  # noqa: E731
    lengths = [1, 13, 1, 29]
    t, hk, hv, dk, dv, ch, width = sum(lengths), 2, 4, 32, 32, 48, 4
    slots = np.array([3, 0, 5, 1], np.int32)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    i32 = lambda a: mx.array(np.asarray(a, np.int32))  # noqa: E731
    g = dict(q=cast(rng.standard_normal((t, hk, dk))), k=cast(rng.standard_normal((t, hk, dk))),
             v=cast(rng.standard_normal((t, hv, dv))), a=cast(rng.standard_normal((t, hv))),
             b=cast(rng.standard_normal((t, hv))))
    consts = dict(A_log=mx.array(np.log(rng.uniform(1, 16, hv)).astype(np.float32)),
                  dt_bias=mx.array(rng.standard_normal(hv).astype(np.float32)))
    state = mx.array(rng.standard_normal((6, hv, dv, dk)).astype(np.float32) * 0.5)
    x, w = cast(rng.standard_normal((t, ch))), cast(rng.standard_normal((ch, width)) * 0.5)
    conv_state = cast(rng.standard_normal((6, ch, width - 1)))

    def gdn(rows, seq_lens, seq_slots, st):
        part = {key: val[rows] for key, val in g.items()}
        return ops.gated_delta_rule(**part, **consts, state=st, cu_seqlens=i32(np.cumsum([0] + seq_lens)),
                                    slots=i32(seq_slots))

    def conv(rows, seq_lens, seq_slots, st):
        return ops.causal_conv1d(x[rows], w, None, conv_state=st,
                                 cu_seqlens=i32(np.cumsum([0] + seq_lens)), slots=i32(seq_slots))

    for op, st in ((gdn, state), (conv, conv_state)):
        y, new_state = op(slice(0, t), lengths, slots, st)
        s = 3  # the longest sequence, alone, then split into chunks carrying the state
        rows = slice(int(cu[s]), int(cu[s + 1]))
        y1, st1 = op(rows, [lengths[s]], slots[s:s + 1], st)
        assert_same_bits(y[rows], y1, f"{op.__name__} alone")
        assert_same_bits(new_state[int(slots[s])], st1[int(slots[s])], f"{op.__name__} state alone")
        cut = int(cu[s]) + 10
        ya, sta = op(slice(int(cu[s]), cut), [10], slots[s:s + 1], st)
        yb, stb = op(slice(cut, int(cu[s + 1])), [lengths[s] - 10], slots[s:s + 1], sta)
        assert_same_bits(y[rows], mx.concatenate([ya, yb]), f"{op.__name__} in two chunks")
        assert_same_bits(new_state[int(slots[s])], stb[int(slots[s])], f"{op.__name__} state in chunks")


def test_mode_switch_reaches_the_kernels():
    assert _core.batch_invariant() is True
    ops.set_batch_invariant(False)
    assert ops.batch_invariant() is False


# ---- sampling: a row's filters do not depend on what the other rows need ---------------------

def sampling_batch(temperature, top_k, top_p, vocab):
    from vllm_metal.sampling.batch import SamplingBatch

    n = len(top_p)
    f32 = lambda v: np.asarray(v, np.float32)  # noqa: E731
    return SamplingBatch(vocab_size=vocab, temperature=f32(temperature), top_k=np.asarray(top_k, np.int32),
                         top_p=f32(top_p), min_p=f32([0] * n), repetition_penalty=f32([1] * n),
                         frequency_penalty=f32([0] * n), presence_penalty=f32([0] * n),
                         uniforms=np.full(n, 0.5))


@pytest.mark.parametrize("neighbour_k", [None, 10000], ids=["top-p-only", "top-k-10000"])
def test_top_p_row_alone_equals_the_row_beside_one_that_needs_a_full_sort(neighbour_k):
    from vllm_metal.sampling import filters

    vocab, k = 49152, 50
    rng = np.random.default_rng(5)
    peaked = mx.array(rng.standard_normal((1, vocab)).astype(np.float32) * 4.0)  # narrow nucleus
    flat = mx.array(rng.standard_normal((1, vocab)).astype(np.float32) * 0.01)   # wider than 4096
    # top-p values just above the nucleus masses: there the full sort's other rounding moves
    # the cut by a token, so a row sent to it by its neighbour would differ
    top = -mx.sort(-peaked, axis=-1)[0, :k]
    before = np.cumsum(np.array(mx.exp(top - mx.logsumexp(top))), dtype=np.float32)
    kk = np.array([k], np.int32)
    split = []
    for mass in before[1:40]:
        top_p = np.nextafter(np.nextafter(mass, np.float32(1)), np.float32(1))  # 2 ulps above
        b1 = sampling_batch([1.0], [k], [top_p], vocab)
        cand, _ = filters._cut_in_candidates(peaked, b1, kk, 512, None)
        if float(cand[0, 0]) != float(filters._cut_by_sorting(peaked, b1, kk)[0, 0]):
            split.append(float(top_p))
    assert split, "no top_p where the two paths round differently: the test would not catch a regression"
    for top_p in split[:3]:
        alone, _ = filters.apply_filters(peaked, sampling_batch([1.0], [k], [top_p], vocab))
        both, _ = filters.apply_filters(
            mx.concatenate([flat, peaked]),
            sampling_batch([1.0, 1.0], [neighbour_k or vocab, k], [0.999, top_p], vocab))
        assert int(np.isfinite(np.array(both[0])).sum()) > 4096  # the neighbour took the full sort
        assert_same_bits(both[1:], alone, f"top_k={k} top_p={top_p}")


# ---- a mixture-of-experts forward ------------------------------------------------------------

# chunked prefill beside decode rows, and long chunks beside the probe's decodes: each
# expert sees other tokens in every step
MOE_SCHEDULES = ([[4, 4, 5]] + [[10, 20]] * 5, [[13]] + [[1] * 30] * 5, [[1] * 13] + [[25, 5]] * 5)


def moe_model(tmp_path, experts: str, dtype: str = "float32"):
    """A tiny Qwen3-MoE (8 experts, top-2): dense safetensors experts on ops.fused_moe, or a
    qwen3moe GGUF whose experts stay in block form on ops.fused_moe_gguf."""
    from test_models_qwen3_moe_gguf import write_gguf
    from test_models_qwen3_moe import write_checkpoint
    from vllm_metal.models import load_model

    config, _ = write_checkpoint(tmp_path / "hf", seed=0, vocab_size=320, head_dim=64)  # a Metal size
    if experts == "dense":
        return load_model(str(tmp_path / "hf"), dtype)
    return load_model(str(write_gguf(tmp_path / "hf", config, tmp_path / "moe.gguf", experts)), dtype)


def assert_moe_rows_independent_of_batch(model) -> None:
    from vllm_metal.models.testing import run_packed

    rng = np.random.default_rng(0)
    probe = rng.integers(3, 320, 13).tolist()
    others = [rng.integers(3, 320, int(n)).tolist() for n in rng.integers(3, 30, 5)]
    alone = run_packed(model, [probe], schedules=[[13]])[0]
    for schedules in MOE_SCHEDULES:
        batched = run_packed(model, [probe] + others, schedules=schedules)[0]
        assert_same_bits(batched, alone, f"schedules {schedules[0]} beside {schedules[1:]}")


@pytest.mark.parametrize("experts", ["dense", "Q4_0", "Q8_0"])
def test_moe_sequence_alone_equals_the_sequence_batched(tmp_path, experts):
    """The routed experts see a different set of tokens in each composition; a token's
    expert outputs and their weighted sum must not depend on that set."""
    assert_moe_rows_independent_of_batch(moe_model(tmp_path, experts))
