"""Batch invariance of the Metal kernels (issue 30), in the emulator and, on a Mac, on the GPU.

With ``ops.set_batch_invariant(True)`` every kernel on the serving path must give a row a
result that does not depend on how many other rows share the call or where they sit:
row r of a random batch equals the same row computed alone (or in another batch, at
another position), bit for bit. For attention "row" means a query token: its output must
not depend on the batch, on how chunked prefill split its prompt, on whether its prefix
came from the cache, or on whether it was sent as a decode row or inside a prefill chunk.
Three tests show that the same checks fail with the switch off (gguf_matmul and attention
pick their summation order from the batch there), so they can catch the bug. The last test
runs a whole tiny GGUF model: a sequence's logits packed with others equal its logits alone.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np
import pytest

import hybrid_reference as hyb
from op_harness import DTYPES, assert_close, assert_same_bits, bits, metal_available, to_numpy
from paged_attention_reference import paged_attention_reference
from test_gguf_fixtures import SUPPORTED, T, block_size, random_blocks
from vllm_metal import ops


@pytest.fixture(params=["emulated", "metal"])
def metal(request):
    """The Metal kernels with the batch-invariant switch on: in the emulator here, on the
    GPU on a Mac (skipped elsewhere)."""
    previous_backend, previous_mode = ops.kernel_backend(), ops.batch_invariant()
    ops.set_batch_invariant(True)
    try:
        if request.param == "metal":
            if not metal_available():
                pytest.skip("no Metal GPU here (runs on macOS: .github/workflows/macos.yml)")
            with mx.stream(mx.gpu):
                yield request.param
        else:
            ops.set_kernel_backend("emulated")
            yield request.param
    finally:
        ops.set_kernel_backend(previous_backend)
        ops.set_batch_invariant(previous_mode)


@contextlib.contextmanager
def emulated_with_switch_off():
    """The emulated kernels with the default (batch-dependent) plans, restored afterwards."""
    previous_backend, previous_mode = ops.kernel_backend(), ops.batch_invariant()
    ops.set_kernel_backend("emulated")
    ops.set_batch_invariant(False)
    try:
        yield
    finally:
        ops.set_kernel_backend(previous_backend)
        ops.set_batch_invariant(previous_mode)


def cast(x: np.ndarray, dtype: str) -> mx.array:
    return mx.array(np.asarray(x, np.float32)).astype(DTYPES[dtype])


# ---- gguf_matmul ---------------------------------------------------------------------


def gguf_rows_vs_alone(t, dtype: str, rng, n: int = 12):
    """Returns (batch rows, the same rows alone, the same rows at other positions of a
    second batch) for a random batch of 1..40 rows."""
    k = 2 * block_size(t) if block_size(t) > 1 else 40
    blocks = mx.array(random_blocks(t, n, k, seed=int(rng.integers(1 << 30))))
    m = int(rng.integers(1, 41))
    x = cast(rng.standard_normal((m, k)), dtype)
    y = bits(ops.gguf_matmul(x, blocks, t.name, [n, k]))
    picks = rng.choice(m, size=min(m, 3), replace=False)
    alone = np.concatenate([bits(ops.gguf_matmul(x[int(r):int(r) + 1], blocks, t.name, [n, k]))
                            for r in picks])
    # the same rows inside another batch of another size, in another order
    extra = cast(rng.standard_normal((int(rng.integers(0, 20)), k)), dtype)
    order = rng.permutation(len(picks) + extra.shape[0])
    mixed = mx.concatenate([x[mx.array(picks)], extra])[mx.array(order)]
    y2 = bits(ops.gguf_matmul(mixed, blocks, t.name, [n, k]))
    at = np.argsort(order)[: len(picks)]  # where each picked row landed
    return y[picks], alone, y2[at], m


@pytest.mark.parametrize("t", SUPPORTED, ids=[t.name for t in SUPPORTED])
def test_gguf_matmul_row_independent_of_batch(metal, t):
    rng = np.random.default_rng(int(t))
    for dtype in DTYPES:
        batch, alone, other, m = gguf_rows_vs_alone(t, dtype, rng)
        what = f"gguf_matmul({t.name},m={m},{dtype})"
        assert_same_bits(batch, alone, what)
        assert_same_bits(other, alone, what + " in another batch")


def test_gguf_matmul_rows_depend_on_batch_with_switch_off():
    # the check above is sensitive: without the switch, 9+ rows take the tile kernel
    with emulated_with_switch_off():
        rng = np.random.default_rng(1)
        blocks = mx.array(random_blocks(T.Q4_K, 64, 256, seed=1))
        x = cast(rng.standard_normal((9, 256)), "float32")
        batch = bits(ops.gguf_matmul(x, blocks, "Q4_K", [64, 256]))[0]
        alone = bits(ops.gguf_matmul(x[:1], blocks, "Q4_K", [64, 256]))[0]
        assert (batch != alone).sum() > 10


# ---- paged attention -----------------------------------------------------------------


class Prompts:
    """Sequences whose whole prompts' K/V sit in a paged cache (blocks shuffled); any
    batch of query spans (seq, start, end) can be run against it."""

    def __init__(self, lengths, dtype, rng, hq=4, hkv=2, d=64, bs=16, **options):
        self.lengths, self.dtype, self.hq, self.d = list(lengths), dtype, hq, d
        self.options = dict(scale=d ** -0.5, **options)
        per_seq = [-(-n // bs) for n in self.lengths]
        num_blocks = sum(per_seq) + 2
        perm = rng.permutation(num_blocks).astype(np.int32)
        self.tables = np.full((len(lengths), max(per_seq)), -1, np.int32)
        at = 0
        for s, nb in enumerate(per_seq):
            self.tables[s, :nb] = perm[at:at + nb]
            at += nb
        self.kc = cast(rng.standard_normal((num_blocks, bs, hkv, d)), dtype)
        self.vc = cast(rng.standard_normal((num_blocks, bs, hkv, d)), dtype)
        self.q = [cast(rng.standard_normal((n, hq, d)), dtype) for n in self.lengths]

    def run(self, spans):
        """spans: [(seq, start, end)], the query tokens start..end-1 of a sequence whose
        context ends at `end`. Returns {(seq, pos): output bits [hq, d]}."""
        q = mx.concatenate([self.q[s][a:b] for s, a, b in spans])
        cu = np.concatenate([[0], np.cumsum([b - a for _, a, b in spans])]).astype(np.int32)
        out = ops.paged_attention(
            q, self.kc, self.vc, mx.array(self.tables[[s for s, _, _ in spans]]),
            mx.array(np.array([b for _, _, b in spans], np.int32)), mx.array(cu), **self.options)
        got = bits(out)
        return {(s, p): got[cu[i] + p - a] for i, (s, a, b) in enumerate(spans)
                for p in range(a, b)}

    def whole(self):
        """Each prompt alone, in one prefill: {(seq, pos): bits}."""
        rows = {}
        for s, n in enumerate(self.lengths):
            rows.update(self.run([(s, 0, n)]))
        return rows

    def random_batch(self, rng):
        """1..all sequences, each a decode row (one token at a random position) or a
        chunk of random bounds (a cached prefix when it does not start at 0); decode
        rows first, as the runner packs them."""
        seqs = rng.permutation(len(self.lengths))[: int(rng.integers(1, len(self.lengths) + 1))]
        decode, chunks = [], []
        for s in seqs:
            n = self.lengths[s]
            end = int(rng.integers(1, n + 1))
            if rng.random() < 0.5:
                decode.append((int(s), end - 1, end))
            else:
                chunks.append((int(s), int(rng.integers(0, end)), end))
        return decode + chunks


ATTENTION_CASES = {
    "gqa2_d64": dict(hq=4, hkv=2, d=64, bs=16),
    "d80_window_softcap": dict(hq=3, hkv=1, d=80, bs=8, sliding_window=13, softcap=20.0),
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(ATTENTION_CASES), ids=str)
def test_attention_token_independent_of_batch_and_chunking(metal, case, dtype):
    rng = np.random.default_rng(len(case) + len(dtype))
    prompts = Prompts(rng.integers(1, 45, size=5), dtype, rng, **ATTENTION_CASES[case])
    whole = prompts.whole()
    # the whole prompt computed once is right (the batches below must equal it)
    spans = [(s, 0, n) for s, n in enumerate(prompts.lengths)]
    rows = prompts.run(spans)
    for key, value in rows.items():
        assert_same_bits(value, whole[key], f"{case} {dtype} token {key} with every prompt")
    for _ in range(4):
        spans = prompts.random_batch(rng)
        for key, value in prompts.run(spans).items():
            assert_same_bits(value, whole[key], f"{case} {dtype} token {key} in batch {spans}")


def test_attention_invariant_path_matches_reference(metal):
    rng = np.random.default_rng(3)
    sinks = rng.standard_normal(4).astype(np.float32)
    prompts = Prompts([1, 30, 7, 1100], "float32", rng, hq=4, hkv=2, d=64, bs=16,
                      sliding_window=1000, softcap=10.0, sinks=mx.array(sinks))
    # decode rows, then chunks after a prefix; the last one's rows span 1 or 2 partitions
    spans = [(0, 0, 1), (2, 6, 7), (1, 10, 30), (3, 1020, 1030)]
    q = mx.concatenate([prompts.q[s][a:b] for s, a, b in spans])
    cu = np.concatenate([[0], np.cumsum([b - a for _, a, b in spans])]).astype(np.int32)
    tables = prompts.tables[[s for s, _, _ in spans]]
    seq_lens = np.array([b for _, _, b in spans], np.int32)
    out = ops.paged_attention(q, prompts.kc, prompts.vc, mx.array(tables), mx.array(seq_lens),
                              mx.array(cu), **prompts.options)
    ref = paged_attention_reference(
        to_numpy(q), to_numpy(prompts.kc), to_numpy(prompts.vc), tables, seq_lens, cu,
        scale=prompts.options["scale"], sliding_window=1000, softcap=10.0, sinks=sinks)
    assert_close(out, ref, "float32", "batch-invariant paged_attention")


def test_attention_depends_on_kernel_choice_with_switch_off():
    # the check above is sensitive: without the switch, a prompt's last token gets another
    # result as a decode row than inside its prefill chunk
    with emulated_with_switch_off():
        rng = np.random.default_rng(5)
        prompts = Prompts([40], "float32", rng)
        as_decode = prompts.run([(0, 39, 40)])[(0, 39)]
        in_chunk = prompts.run([(0, 0, 40)])[(0, 39)]
        assert (as_decode != in_chunk).sum() > 10


def test_attention_long_context_row_independent_of_batch_size(metal):
    # without the switch a lone decode row at ctx > 2 x 512 is split over 3 partitions,
    # but not when 64 rows fill the GPU; with it, neither is split
    rng = np.random.default_rng(9)
    prompts = Prompts([1100] + [1] * 63, "float32", rng, hq=2, hkv=2)
    alone = prompts.run([(0, 1099, 1100)])[(0, 1099)]
    crowd = prompts.run([(0, 1099, 1100)] + [(s, 0, 1) for s in range(1, 64)])[(0, 1099)]
    assert_same_bits(crowd, alone, "decode row at ctx 1100 among 64 rows")
    # a chunk across the 1024-key partition edge: rows split and unsplit in one launch
    chunk = prompts.run([(s, 0, 1) for s in range(1, 5)] + [(0, 1021, 1100)])
    for pos in (1021, 1023, 1024, 1025, 1099):
        one = alone if pos == 1099 else prompts.run([(0, pos, pos + 1)])[(0, pos)]
        assert_same_bits(chunk[(0, pos)], one, f"token {pos} in a chunk vs as a decode row")
    ops.set_batch_invariant(False)
    if metal == "emulated":  # the default planner's split is batch-dependent
        crowd_off = prompts.run([(0, 1099, 1100)] + [(s, 0, 1) for s in range(1, 64)])[(0, 1099)]
        assert (prompts.run([(0, 1099, 1100)])[(0, 1099)] != crowd_off).sum() > 10


def test_plans_with_the_switch(metal):
    from vllm_metal import _core

    (l,) = _core.plan_gguf_matmul("Q4_K", "float16", 100, 64, 512)
    assert l.kernel == "gguf_matvec_q4_k_float16" and list(l.grid) == [8, 13, 1]
    # one decode-kernel launch over all 30 query tokens, with as many partitions as the
    # longest context spans (each row takes its own), whatever the number of rows
    for num_decode in (1, 30):
        plan = _core.plan_paged_attention("float16", 30, 3 if num_decode == 1 else 30, 8, 2, 64,
                                          16, 300, 200, num_decode_seqs=num_decode,
                                          max_seq_len=3000, max_query_len=20 if num_decode == 1 else 1)
        assert [l.kernel for l in plan] == ["paged_attention_decode_float16_d64",
                                            "paged_attention_reduce_float16_d64"]
        assert list(plan[0].grid) == [2, 30, 6] and list(plan[1].grid) == [8, 30, 1]
    plan = _core.plan_paged_attention("float16", 30, 3, 8, 2, 64, 16, 300, 200, num_decode_seqs=1,
                                      max_seq_len=512, max_query_len=20)
    assert [list(l.grid) for l in plan] == [[2, 30, 1]]
    ops.set_batch_invariant(False)
    (l,) = _core.plan_gguf_matmul("Q4_K", "float16", 100, 64, 512)
    assert l.kernel == "gguf_matmul_q4_k_float16"


# ---- the other kernels of the serving path ----------------------------------------------


def random_subset(rng, n: int) -> np.ndarray:
    return rng.choice(n, size=int(rng.integers(1, min(n, 4) + 1)), replace=False)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_norms_row_independent_of_batch(metal, dtype):
    rng = np.random.default_rng(11)
    for hidden in (100, 576):
        m = int(rng.integers(1, 40))
        x = cast(rng.standard_normal((m, hidden)), dtype)
        res = cast(rng.standard_normal((m, hidden)), dtype)
        w = cast(rng.standard_normal(hidden), dtype)
        y = bits(ops.rms_norm(x, w, 1e-6))
        s, r = ops.add_rms_norm(x, res, w, 1e-6)
        s, r = bits(s), bits(r)
        for i in random_subset(rng, m):
            one = slice(int(i), int(i) + 1)
            assert_same_bits(bits(ops.rms_norm(x[one], w, 1e-6))[0], y[i], f"rms_norm m={m}")
            s1, r1 = ops.add_rms_norm(x[one], res[one], w, 1e-6)
            assert_same_bits(bits(s1)[0], s[i], f"add_rms_norm m={m}")
            assert_same_bits(bits(r1)[0], r[i], f"add_rms_norm residual m={m}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_ropes_row_independent_of_batch(metal, dtype):
    rng = np.random.default_rng(12)
    t = int(rng.integers(1, 30))
    x = cast(rng.standard_normal((t, 3, 64)), dtype)
    pos = rng.integers(0, 5000, size=t).astype(np.int64)
    pos3 = rng.integers(0, 5000, size=(3, t)).astype(np.int32)
    calls = {
        "rope neox": lambda x, p, p3: ops.rope(x, p),
        "rope gptj partial": lambda x, p, p3: ops.rope(x, p, rotary_dim=32, is_neox=False),
        "mrope interleaved": lambda x, p, p3: ops.mrope(x, p3, sections=(11, 11, 10),
                                                        interleaved=True),
    }
    for name, call in calls.items():
        y = bits(call(x, mx.array(pos), mx.array(pos3)))
        for i in random_subset(rng, t):
            one = slice(int(i), int(i) + 1)
            alone = bits(call(x[one], mx.array(pos[one]), mx.array(pos3[:, one])))[0]
            assert_same_bits(alone, y[i], f"{name} t={t} {dtype}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cache_write_row_independent_of_batch(metal, dtype):
    rng = np.random.default_rng(13)
    t, slots_total = int(rng.integers(1, 30)), 8 * 16
    key = cast(rng.standard_normal((t, 2, 64)), dtype)
    value = cast(rng.standard_normal((t, 2, 64)), dtype)
    cache = cast(np.zeros((8, 16, 2, 64)), dtype)
    slots = rng.permutation(slots_total)[:t].astype(np.int64)
    kc, vc = ops.reshape_and_cache(key, value, cache, cache, mx.array(slots))
    kc, vc = bits(kc).reshape(slots_total, -1), bits(vc).reshape(slots_total, -1)
    for i in random_subset(rng, t):
        one = slice(int(i), int(i) + 1)
        k1, v1 = ops.reshape_and_cache(key[one], value[one], cache, cache, mx.array(slots[one]))
        slot = int(slots[i])
        assert_same_bits(bits(k1).reshape(slots_total, -1)[slot], kc[slot], "cache_write key")
        assert_same_bits(bits(v1).reshape(slots_total, -1)[slot], vc[slot], "cache_write value")


def seq_rows(lengths, s):
    cu = hyb.cu_seqlens_of(lengths)
    return slice(int(cu[s]), int(cu[s + 1]))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_hybrid_ops_sequence_independent_of_batch(metal, dtype):
    rng = np.random.default_rng(14)
    lengths = [int(n) for n in rng.integers(0, 12, size=int(rng.integers(1, 6)))]
    lengths[0] = max(lengths[0], 1)
    n, t, slots_total = len(lengths), sum(lengths), len(lengths) + 2
    slots = rng.permutation(slots_total)[:n].astype(np.int32)
    has_init = rng.integers(0, 2, size=n).astype(np.int32)
    # causal_conv1d: x [T, C], state [slots, C, K-1]
    x = cast(rng.standard_normal((t, 40)), dtype)
    w = cast(rng.standard_normal((40, 4)) * 0.5, dtype)
    b = cast(rng.standard_normal(40), dtype)
    conv_state = cast(rng.standard_normal((slots_total, 40, 3)), dtype)
    # gated delta: q, k [T, Hk, Dk], v [T, Hv, Dv], a, b [T, Hv], state [slots, Hv, Dv, Dk]
    g = dict(q=cast(rng.standard_normal((t, 1, 32)), dtype),
             k=cast(rng.standard_normal((t, 1, 32)), dtype),
             v=cast(rng.standard_normal((t, 2, 8)), dtype),
             a=cast(rng.standard_normal((t, 2)), dtype), b=cast(rng.standard_normal((t, 2)), dtype))
    a_log = mx.array(np.log(rng.uniform(1, 16, 2)).astype(np.float32))
    dt_bias = mx.array(rng.standard_normal(2).astype(np.float32))
    gd_state = mx.array(rng.standard_normal((slots_total, 2, 8, 32)).astype(np.float32))

    def run(rows, lens, sl, init):
        y, cs = ops.causal_conv1d(x[rows], w, b, conv_state=conv_state,
                                  cu_seqlens=hyb.i32(hyb.cu_seqlens_of(lens)), slots=hyb.i32(sl),
                                  has_initial_state=hyb.i32(init))
        o, gs = ops.gated_delta_rule(**{key: val[rows] for key, val in g.items()}, A_log=a_log,
                                     dt_bias=dt_bias, state=gd_state,
                                     cu_seqlens=hyb.i32(hyb.cu_seqlens_of(lens)), slots=hyb.i32(sl),
                                     has_initial_state=hyb.i32(init))
        return bits(y), bits(cs), bits(o), bits(gs)

    y, cs, o, gs = run(slice(0, t), lengths, slots, has_init)
    for s in random_subset(rng, n):
        rows = seq_rows(lengths, s)
        y1, cs1, o1, gs1 = run(rows, [lengths[s]], slots[s:s + 1], has_init[s:s + 1])
        what = f"sequence {s} of lengths {lengths} ({dtype})"
        assert_same_bits(y1, y[rows], "causal_conv1d " + what)
        assert_same_bits(cs1[slots[s]], cs[slots[s]], "causal_conv1d state " + what)
        assert_same_bits(o1, o[rows], "gated_delta " + what)
        assert_same_bits(gs1[slots[s]], gs[slots[s]], "gated_delta state " + what)


@pytest.mark.parametrize("t", [T.Q4_1, T.Q6_K, T.IQ4_XS, T.Q8_0], ids=lambda t: t.name)
def test_gguf_dequantize_row_independent_of_tensor(metal, t):
    rng = np.random.default_rng(int(t))
    rows, k = int(rng.integers(1, 20)), 2 * block_size(t)
    blocks = random_blocks(t, rows, k, seed=int(t)).reshape(rows, -1)  # [rows, row bytes]
    for dtype in DTYPES:
        full = bits(ops.gguf_dequantize(mx.array(blocks), t.name, [rows, k], dtype))
        for r in random_subset(rng, rows):
            one = blocks[int(r)]
            alone = bits(ops.gguf_dequantize(mx.array(one), t.name, [1, k], dtype))[0]
            assert_same_bits(alone, full[r], f"gguf_dequantize({t.name}, rows={rows}, {dtype})")


# ---- a whole forward -------------------------------------------------------------------


@pytest.mark.parametrize("arch, qtype, dtype", [("llama3", "Q4_K", "float16"),
                                                ("llama3", "Q4_1", "bfloat16"),
                                                ("gemma3", "Q6_K", "float32")])
def test_forward_logits_independent_of_batch_and_chunking(metal, tmp_path, arch, qtype, dtype):
    """A tiny GGUF model on the Metal kernels: every position's logits of a sequence packed
    with others (chunked prefill, decode rows next to prefill chunks) equal those of the
    sequence alone in one prefill, bitwise (with the switch off 1 in 4 float16 logits differ)."""
    from vllm_metal.models import load_model
    from vllm_metal.models.testing import run_packed, tiny_config, write_tiny_gguf

    if metal == "metal":
        pytest.skip("the model-level check runs in the emulator; the Mac runs the kernel tests")
    cfg = tiny_config(arch, head_dim=64, num_hidden_layers=2)
    write_tiny_gguf(cfg, tmp_path / "m.gguf", seed=3, qtype=qtype)
    model = load_model(str(tmp_path / "m.gguf"), dtype)
    seqs = [list(range(10, 22)), list(range(40, 49)), list(range(70, 81)), list(range(5, 19))]
    packed = run_packed(model, seqs, [[5, 4, 1, 1, 1], [3, 1, 1, 1, 1, 1, 1], [9, 1, 1], [13, 1]])
    for i, seq in enumerate(seqs):
        alone = run_packed(model, [seq], [[len(seq)]], seed=i + 1)[0]
        differ = int((alone != packed[i]).sum())
        assert differ == 0, f"sequence {i}: {differ} of {alone.size} logits differ from alone"


@pytest.mark.parametrize("experts, dtype", [("dense", "float16"), ("Q4_0", "float32")])
def test_moe_forward_logits_independent_of_batch(metal, tmp_path, experts, dtype):
    """A tiny Qwen3-MoE on the Metal kernels (ops.fused_moe / fused_moe_gguf): a sequence's
    logits beside other sequences, chunked or decoding, equal its logits alone, bitwise."""
    from test_batch_invariance import assert_moe_rows_independent_of_batch, moe_model

    if metal == "metal":
        pytest.skip("the model-level check runs in the emulator; the Mac runs the kernel tests")
    assert_moe_rows_independent_of_batch(moe_model(tmp_path, experts, dtype))
