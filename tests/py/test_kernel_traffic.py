"""Traffic budgets of the Metal kernels, from the emulator's counting builds.

Two bounds per case (vllm_metal.kernel_traffic; docs/kernels.md "Memory traffic"):
- unique bytes (each byte counted once per launch: DRAM traffic with perfect caches) <=
  1.15 x the op's minimum (+ split-KV scratch), 1.05 x for the GGUF mat-vec kernel at
  decode shapes (weights + x + y). Catches bytes the op does not need.
- simd bytes (every load and store of every thread, a simdgroup's broadcast load once) <=
  the recorded ratio to the minimum, measured when the budget was set plus ~5 %. Catches a
  change that re-reads data.
Ratios above the memory-bound 1.15 are exceptions, each with its reason.
"""

import pytest

from vllm_metal import emulation
from vllm_metal import kernel_traffic as kt

pytestmark = pytest.mark.skipif(not emulation.emulator_available(), reason="needs clang >= 19 (mslemu)")

UNIQUE_BUDGET = 1.15
# Gemma-3-270M's Q4_K_M file: q, k, gate, up Q5_0; v Q8_0; o Q4_K; down Q6_K
GEMMA3_TYPES = ("Q5_0", "Q5_0", "Q8_0", "Q4_K", "Q5_0", "Q5_0", "Q6_K")
MATVEC_BUDGET = 1.05  # the GGUF mat-vec kernel: weights, x and y read or written once
TOKEN_BITMASK_BUDGET = 1.05  # apply_token_bitmask: mask words, needed logits, outputs once

# (case, unique budget, re-read budget (simd bytes / minimum), why bytes are re-read)
CASES = [
    (lambda: kt.rms_norm("float32", 2, 1000), UNIQUE_BUDGET, 1.65,
     "second pass re-reads x (L1-resident row); the weight is read once per row"),
    (lambda: kt.rms_norm("float16", 3, 576, fused=True), 1.25, 1.45,
     "EXCEPTION (unique 1.23): the second pass reads h back from residual_out instead of "
     "re-adding x + residual (one stream instead of two); the weight is read once per row"),
    (lambda: kt.cache_write("float16", 7, 3, 64, 64), UNIQUE_BUDGET, 1.15,
     "each head's threads load the token's slot again"),
    (lambda: kt.rope("float16", 5, 3, 64), UNIQUE_BUDGET, 1.95,
     "the turn-table entry and position are re-read for every head row of threads"),
    (lambda: kt.rope("float32", 3, 2, 64, is_neox=False), UNIQUE_BUDGET, 1.45, "as above"),
    (lambda: kt.gguf_dequantize("Q4_1", "float16", 4, 512), UNIQUE_BUDGET, 1.3,
     "the two 16-weight chunks of a block both read its d and m"),
    (lambda: kt.gguf_dequantize("Q4_K", "float16", 2, 512), UNIQUE_BUDGET, 1.35,
     "the 16 chunks of a super-block each read its scales"),
    (lambda: kt.gguf_dequantize("Q6_K", "bfloat16", 2, 256), UNIQUE_BUDGET, 1.5, "as above"),
    (lambda: kt.gguf_dequantize("Q8_0", "float32", 3, 96), UNIQUE_BUDGET, 1.05, "two chunks, one scale"),
    (lambda: kt.gguf_matvec("Q4_1", "float16", 1, 64, 576), MATVEC_BUDGET, 3.7,
     "each lane reads its 2 rows' x pieces (x comes back n / 2 times, cache-resident); a "
     "block's scales once per 8-weight piece, its nibble bytes once per nibble"),
    (lambda: kt.gguf_matvec("Q4_1", "float16", 3, 20, 576), MATVEC_BUDGET, 5.35, "as above, 3 x rows"),
    (lambda: kt.gguf_matvec("Q4_K", "float16", 1, 16, 512), MATVEC_BUDGET, 2.8, "as above, 4 rows per lane"),
    (lambda: kt.gguf_matvec("Q6_K", "float32", 2, 9, 256), MATVEC_BUDGET, 3.35, "as above"),
    # decode shapes: SmolLM2-135M Q4_1 (q/o, down, tied LM head sampled), Gemma-3-270M Q4_K_M
    (lambda: kt.gguf_matvec("Q4_1", "float16", 1, 576, 576), MATVEC_BUDGET, 3.9, "as above"),
    (lambda: kt.gguf_matvec("Q4_1", "float16", 1, 576, 1536), MATVEC_BUDGET, 2.85, "as above"),
    (lambda: kt.gguf_matvec("Q8_0", "float16", 1, 1536, 576), MATVEC_BUDGET, 2.1, "as above"),
    (lambda: kt.gguf_matvec("Q5_0", "bfloat16", 1, 1024, 640), MATVEC_BUDGET, 3.25, "as above"),
    (lambda: kt.gguf_matvec("Q4_K", "bfloat16", 1, 640, 1024), MATVEC_BUDGET, 3.4, "as above"),
    (lambda: kt.gguf_matvec("Q6_K", "bfloat16", 1, 640, 2048), MATVEC_BUDGET, 3.2, "as above"),
    (lambda: kt.gguf_matvec("Q5_0", "float16", 4, 256, 640), MATVEC_BUDGET, 5.2, "as above, 4 x rows"),
    (lambda: kt.paged_attention("float16", [1, 1], [37, 100], 9, 3, 64), UNIQUE_BUDGET, 1.15,
     "block-table entries and lengths re-read by each simdgroup; K/V once per kv head"),
    (lambda: kt.paged_attention("float16", [1], [100], 9, 3, 64, partition_size=32), UNIQUE_BUDGET, 1.55,
     "split-KV: partials written then read by the reduce (the scratch term of the budget)"),
    (lambda: kt.paged_attention("float16", [1, 5], [20, 30], 9, 3, 64), UNIQUE_BUDGET, 4.3,
     "prefill: each 8-row query tile of each q head reads its context's K/V again"),
    # a grammar's token mask (structured outputs): the mask's words are loaded once per
    # simdgroup span and passed lane to lane by simd_shuffle; a disallowed logit is not read
    (lambda: kt.apply_token_bitmask("float16", 5, 1100, [1, 2, 4]), TOKEN_BITMASK_BUDGET, 1.05,
     "each threadgroup re-reads its row's mask index"),
    (lambda: kt.apply_token_bitmask("float32", 3, 49152, [2, 0]), TOKEN_BITMASK_BUDGET, 1.05, "as above"),
    (lambda: kt.apply_token_bitmask("bfloat16", 4, 9000, [0, 3], in_place=True), TOKEN_BITMASK_BUDGET,
     1.05, "as above; in place only the -infs are written"),
    # the fused decoder layer: unique bytes are the floor + what crosses between its
    # dispatches (kt.decoder_layer's scratch). Re-reads: each threadgroup reads its x rows
    # (and the norm weight) once into threadgroup memory, then its weight rows use that copy
    # (re-read budgets measured on gguf_matvec's core: 2.29, 2.88, 2.75; with one weight
    # row per simdgroup SmolLM2's measured 2.3 and 4.9, budgets 2.45, 5.1, 4.7)
    (lambda: kt.decoder_layer("Q4_1", "float16", 1, 576, 9, 3, 64, 1536), UNIQUE_BUDGET, 2.45,
     "SmolLM2 layer, 1 decode row: x once per threadgroup (cache-resident); weights once"),
    (lambda: kt.decoder_layer("Q4_1", "float16", 8, 576, 9, 3, 64, 1536), UNIQUE_BUDGET, 3.05,
     "as above, 8 rows: 8 x rows per threadgroup"),
    (lambda: kt.decoder_layer("Q4_K", "float32", 3, 256, 4, 1, 256, 512, ctx=40, sandwich=True),
     UNIQUE_BUDGET, 2.9, "gemma layout, float32, small hidden: x copies weigh more"),
    # split-KV contexts (1024 + the new token: 3 partitions of 512): the o projection folds
    # the reduce in, so the partials cross (scratch) and the attention output does not;
    # every o threadgroup re-reads the partials (measured 2.01 and 2.28)
    (lambda: kt.decoder_layer("Q4_1", "float16", 1, 576, 9, 3, 64, 1536, ctx=1025), UNIQUE_BUDGET,
     2.1, "SmolLM2 layer at ctx 1025: as at ctx 100, plus the partials once per o threadgroup"),
    (lambda: kt.decoder_layer(GEMMA3_TYPES, "bfloat16", 1, 640, 4, 1, 256, 2048, ctx=1025,
                              sandwich=True), UNIQUE_BUDGET, 2.4, "Gemma-3-270M layer, as above"),
]


@pytest.fixture(scope="module", params=range(len(CASES)), ids=lambda i: str(i))
def measured(request):
    make, unique_budget, total_budget, why = CASES[request.param]
    return kt.measure(make()), unique_budget, total_budget, why


def test_unique_traffic_within_budget(measured):
    m, unique_budget, _, why = measured
    limit = unique_budget * m.case.minimum + m.case.scratch
    assert m.unique <= limit, (
        f"{m.case.name}: {m.unique} unique bytes > {limit:.0f} ({unique_budget} x minimum "
        f"{m.case.minimum} + scratch {m.case.scratch}); per launch: {_per_buffer(m)}")


def test_rereads_within_budget(measured):
    m, _, budget, why = measured
    assert m.simd <= budget * m.case.minimum, (
        f"{m.case.name}: {m.simd} bytes through loads/stores (simdgroup broadcasts once) = "
        f"{m.simd_ratio:.3f} x minimum, budget {budget} ({why}); per launch: {_per_buffer(m)}")


def test_decoder_layer_moves_its_floor_and_crossings_exactly(measured):
    """The fused layer's unique bytes are its floor plus what crosses between its
    dispatches (kt.decoder_layer's scratch: q, attention unless the o projection folds a
    split-KV reduce in, h, the MLP activation, x again, split-KV partials), to the byte."""
    m = measured[0]
    if not m.case.name.startswith("decoder_layer"):
        pytest.skip("not a decoder layer")
    assert m.unique == m.case.minimum + m.case.scratch, (m.case.name, _per_buffer(m))


def test_counts_are_plausible(measured):
    m = measured[0]
    for launch in m.launches:
        assert launch.threads > 0 and launch.threadgroups > 0
        assert launch.threadgroup_memory <= 32768
        for b in launch.buffers.values():  # nothing unique exceeds its total
            assert b.read_unique <= b.read_tg_unique <= b.read_simd <= b.read
            assert b.written_unique <= b.written_tg_unique <= b.written_simd <= b.written


def test_a_redundant_pass_breaks_the_budget():
    """The budget check fails when a plan reads its input twice (the launch run twice)."""
    case = kt.rms_norm("float16", 2, 100)
    once = kt.measure(case)
    case.plan = list(case.plan) * 2
    twice = kt.measure(case)
    assert twice.total == 2 * once.total and twice.unique == 2 * once.unique
    assert twice.simd == 2 * once.simd
    assert twice.unique > UNIQUE_BUDGET * case.minimum


def test_paged_attention_reads_only_the_context():
    """Unique K/V bytes equal the context's tokens: no padding slot of a last block is read."""
    m = kt.measure(kt.paged_attention("float16", [1], [17], 9, 3, 64))  # 1 token in the 2nd block
    (launch,) = m.launches
    kv = 17 * 3 * 64 * 2
    assert launch.buffers[1].read_unique == kv and launch.buffers[2].read_unique == kv


def _per_buffer(m):
    return [(l.kernel, {l.slots.get(i, "args"): (b.read, b.read_unique, b.written, b.written_unique)
                        for i, b in l.buffers.items()}) for l in m.launches]
