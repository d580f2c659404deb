"""Every Metal kernel under the emulator's checks: races, out-of-bounds accesses, schedules.

The launches of the kernel tests that run plans on NumPy (test_metal_sources, test_rope,
test_hybrid_launches, test_paged_attention) and a few more here (cache copy, paged-attention
prefill, GGUF dequantize / mat-vec / mat-mat) run on the checked builds of src/metal
(mslemu checks.h): an out-of-bounds device or threadgroup access, a threadgroup-memory race
or a device write-write race fails the launch, naming kernel, buffer, offset and threads.
Each plan runs in thread order and under three fuzzed schedules (MSLEMU_SCHEDULE: random
fiber order every pass, preemption at shared-memory accesses, shuffled threadgroups); all
outputs must be bit-identical, and the original test's reference assertions still apply.
Verified in the emulator on Linux only.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import test_apply_token_bitmask as bitmask
import test_gelu as gelu
import test_gguf_matmul as gguf_matmul
import test_layer_norm as layer_norm
import test_decoder_layer_metal as layer
import test_fused_moe as moe
import test_hybrid_launches as hybrid
import test_lora_ops as lora
import test_metal_sources as sources
import test_paged_attention as attention
import test_rope as rope
import test_varlen_attention as varlen
from decoder_layer_case import make_case
from paged_attention_reference import paged_attention_reference
from test_gguf_fixtures import SUPPORTED, T, block_size, random_blocks, reference_dequantize
from vllm_metal import _core, emulation

SCHEDULES = (0, 11, 12, 13)  # 0: threads in order; the others: fuzzed, seeded


@functools.lru_cache(maxsize=None)
def checked_library(source: str):
    path = emulation.metal_source_dir() / f"{source}.metal"
    return emulation.mslemu_module().Library(str(path), checks=True)


def _copies(arrays):
    """Fresh copies, the same copy wherever the same array is passed twice."""
    by_id = {}
    for i, a in enumerate(arrays):
        for b in arrays[:i]:
            if b is not a and np.shares_memory(a, b):
                raise AssertionError("two different arrays of one plan share memory")
        by_id.setdefault(id(a), a.copy())
    return [by_id[id(a)] for a in arrays]


@pytest.fixture
def checked(monkeypatch):
    """emulation.run_plan on the checked builds, once per schedule; returns the names of
    the kernels launched."""
    real = emulation.run_plan
    launched = []

    def run(plan, arrays, counts=None):
        assert counts is None
        results = []
        for seed in SCHEDULES:
            monkeypatch.setenv("MSLEMU_SCHEDULE", str(seed))
            copies = _copies(arrays)
            real(plan, copies)
            results.append(copies)
        kernels = [l.kernel for l in plan]
        for seed, res in zip(SCHEDULES[1:], results[1:]):
            for slot, (a, b) in enumerate(zip(results[0], res)):
                assert a.tobytes() == b.tobytes(), (
                    f"{kernels}: array slot {slot} differs between the in-order schedule and "
                    f"MSLEMU_SCHEDULE={seed}")
        for a, c in zip(arrays, results[0]):
            if a.flags.writeable:
                np.copyto(a, c)
        launched.extend((l.source, l.kernel) for l in plan)

    monkeypatch.setattr(emulation, "library", checked_library)
    monkeypatch.setattr(emulation, "run_plan", run)
    return launched


def cache_copy_and_write():
    t, h, d, n = 5, 2, 64, 16
    rng = np.random.default_rng(7)
    key = rng.standard_normal((t, h, d)).astype(np.float16)
    kc_in = rng.standard_normal((n, h, d)).astype(np.float16)
    kc_out = np.zeros_like(kc_in)
    slots = np.array([3, -1, 15, 0, 9], np.int64)
    plan = _core.plan_cache_write("float16", t, h, d, n, [h * d, d, 1], copy_cache=True)
    emulation.run_plan(plan, [key, kc_in, slots, kc_out])
    expect = kc_in.copy()
    for i, s in enumerate(slots):
        if s >= 0:
            expect[s] = key[i]
    np.testing.assert_array_equal(kc_out, expect)


def paged(q_lens, ctx_lens, d, dtype, window=0, softcap=0.0, sinks=False, partition=512):
    """A mixed batch (decode sequences first, as vLLM orders them) against the reference."""
    hq, hkv, bs = 4, 2, 8
    q, kc, vc, tables, seq_lens, cu = attention.make_batch(q_lens, ctx_lens, hq, hkv, d, bs, dtype, d)
    qn, kcn, vcn = (np.array(a) for a in (q, kc, vc))
    sink = np.random.default_rng(d).standard_normal(hq).astype(np.float32) if sinks else None
    decode = sum(1 for x in q_lens if x == 1)
    plan = _core.plan_paged_attention(dtype, sum(q_lens), len(q_lens), hq, hkv, d, bs, kcn.shape[0],
                                      tables.shape[1], num_decode_seqs=decode, max_seq_len=max(ctx_lens),
                                      max_query_len=max(q_lens), scale=0.125, sliding_window=window,
                                      softcap=softcap, has_sinks=sinks, partition_size=partition)
    parts = max([l.grid[2] for l in plan if "decode" in l.kernel] + [1])
    out = np.zeros((sum(q_lens), hq, d), qn.dtype)
    scratch = [np.zeros((max(decode, 1), hq, parts, d), np.float32), np.zeros((max(decode, 1), hq, parts), np.float32),
               np.zeros((max(decode, 1), hq, parts), np.float32)]
    emulation.run_plan(plan, [qn, kcn, vcn, tables, seq_lens, cu,
                              sink if sinks else np.zeros(1, np.float32), out, *scratch])
    f = lambda a: a.astype(np.float64)  # noqa: E731
    ref = paged_attention_reference(f(qn), f(kcn), f(vcn), tables, seq_lens, cu, 0.125, window, softcap, sink)
    np.testing.assert_allclose(f(out), ref, atol=2e-5 if dtype == "float32" else 4e-3)
    return plan


def paged_prefill():
    plan = paged([3, 7], [3, 20], 64, "float32")
    assert any("prefill" in l.kernel for l in plan)


def gguf(t, m, n, k):
    blocks = random_blocks(t, n, k, seed=m)
    w = reference_dequantize(blocks, t, (n, k)).astype(np.float64)
    rows = np.zeros((n, k), np.float32)
    emulation.run_plan(_core.plan_gguf_dequantize(t.name, "float32", n, k), [blocks, rows])
    np.testing.assert_allclose(rows, w, rtol=1e-6, atol=0)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    y = np.zeros((m, n), np.float32)
    emulation.run_plan(_core.plan_gguf_matmul(t.name, "float32", m, n, k), [x, blocks, y])
    ref = x.astype(np.float64) @ w.T
    assert np.abs(y - ref).max() <= 2e-5 * np.abs(ref).max()


def batch_invariant(case):
    """The case planned in batch-invariant mode (the planners read the switch)."""
    def run():
        previous = _core.batch_invariant()
        _core.set_batch_invariant(True)
        try:
            case()
        finally:
            _core.set_batch_invariant(previous)
    return run


def paged_token_rows():
    # every query token a decode-kernel row, split by its own keys (16-key partitions
    # here: 1 to 3 per row), then a padding token the launches must not touch
    q_lens, ctx_lens, hq, hkv, d, bs = [1, 1, 5], [40, 9, 30], 4, 2, 64, 8
    q, kc, vc, tables, seq_lens, cu = attention.make_batch(q_lens, ctx_lens, hq, hkv, d, bs, "float32", 5)
    qn, kcn, vcn = (np.array(a) for a in (q, kc, vc))
    t = sum(q_lens) + 1
    qn = np.concatenate([qn, np.ones((1, hq, d), np.float32)])
    plan = _core.plan_paged_attention("float32", t, len(q_lens), hq, hkv, d, bs, kcn.shape[0],
                                      tables.shape[1], num_decode_seqs=2, max_seq_len=max(ctx_lens),
                                      max_query_len=max(q_lens), scale=0.125, partition_size=16)
    assert [l.kernel for l in plan] == ["paged_attention_decode_float32_d64",
                                        "paged_attention_reduce_float32_d64"]
    parts = plan[0].grid[2]
    out = np.full((t, hq, d), 7.0, np.float32)
    scratch = [np.zeros((t, hq, parts, d), np.float32), np.zeros((t, hq, parts), np.float32),
               np.zeros((t, hq, parts), np.float32)]
    emulation.run_plan(plan, [qn, kcn, vcn, tables, seq_lens, cu, np.zeros(1, np.float32), out, *scratch])
    ref = paged_attention_reference(qn[:-1].astype(np.float64), kcn, vcn, tables, seq_lens, cu, 0.125)
    np.testing.assert_allclose(out[:-1], ref, atol=1e-5)
    assert (out[-1] == 7.0).all()


def gguf_matvec_row_groups():
    assert _core.plan_gguf_matmul("Q6_K", "float32", 20, 9, 256)[0].kernel.startswith("gguf_matvec")
    gguf(T.Q6_K, 20, 9, 256)


def gguf_matvec_lane_shapes():
    # every mat-vec simdgroup shape (lanes per row 1..32, 1..4 rows per lane, 16- and
    # 8-weight pieces), ragged n so the last simdgroup's lanes hold fewer rows or none, 1
    # and 2 groups of x rows
    for t, k, shape in [(T.F32, 13, (1, 1, 16)), (T.Q8_0, 32, (2, 1, 16)), (T.F32, 56, (4, 1, 16)),
                        (T.Q8_0, 576, (8, 2, 8)), (T.Q8_0, 640, (16, 4, 8)),
                        (T.Q8_0, 768, (16, 4, 16)), (T.Q8_0, 1024, (32, 4, 16))]:
        assert _core.gguf_matvec_shape(k) == shape
        for m, n in [(3, 13), (9, 37)]:
            gguf(t, m, n, k)


# case -> (the src/metal sources it must launch, the case)
CASES = {
    "rms_norm": ({"rms_norm"}, lambda: sources.test_rms_norm_launches_on_numpy(3, 33, "float16", True)),
    "rms_norm_wide": ({"rms_norm"}, lambda: sources.test_rms_norm_launches_on_numpy(2, 1000, "float32", False)),
    "cache_write": ({"reshape_and_cache"}, sources.test_cache_write_launches_never_write_outside_the_cache),
    "cache_copy_and_write": ({"reshape_and_cache"}, cache_copy_and_write),
    "rope": ({"rope"}, lambda: rope.test_launches_on_numpy_stay_inside_the_output(
        5, 3, 80, 20, False, "float16", "int64")),
    "mrope": ({"mrope"}, lambda: hybrid.test_mrope_launches(True)),
    "apply_token_bitmask": ({"apply_token_bitmask"}, lambda: bitmask.test_launches_on_numpy(
        4, 1100, 0, [1, 2, 3], False)),
    "apply_token_bitmask_in_place": ({"apply_token_bitmask"}, lambda: bitmask.test_launches_on_numpy(
        3, 45, 1, [2, 0], True)),
    "gated_delta": ({"gated_delta"}, lambda: hybrid.test_gated_delta_launches(True)),
    "causal_conv1d": ({"causal_conv1d"}, hybrid.test_causal_conv1d_launches),
    "gelu": ({"gelu"}, lambda: (gelu.test_launches_on_numpy(False), gelu.test_launches_on_numpy(True))),
    "layer_norm": ({"layer_norm"}, lambda: (layer_norm.test_launches_on_numpy(3, 1000, "float32", True),
                                            layer_norm.test_launches_on_numpy(5, 33, "float16", False))),
    "gguf_matmul_epilogue": ({"gguf_matmul"}, gguf_matmul.test_epilogue_launches_on_numpy),
    "varlen_attention": ({"varlen_attention"}, lambda: (varlen.launches_on_numpy(False),
                                                        varlen.launches_on_numpy(True),
                                                        varlen.launches_on_numpy(False, 3))),
    "varlen_attention_tiled": ({"varlen_attention"}, lambda: (
        varlen.launches_on_numpy(False, d=32), varlen.launches_on_numpy(True, d=32),
        varlen.launches_on_numpy(False, 3, d=32))),
    "lora_apply": ({"lora"}, lora.test_launches_on_numpy),
    "paged_decode_split_kv": ({"paged_attention"}, attention.test_split_kv_launches_on_numpy_with_many_partitions),
    "paged_prefill": ({"paged_attention"}, paged_prefill),
    "paged_mixed_d128_f16_features": ({"paged_attention"}, lambda: paged(
        [1, 1, 6, 2], [40, 7, 30, 2], 128, "float16", window=16, softcap=30.0, sinks=True, partition=16)),
    "paged_mixed_d80_d96": ({"paged_attention"}, lambda: (paged([1, 5], [33, 12], 80, "float32"),
                                                          paged([1, 1, 2], [9, 17, 4], 96, "float32"))),
    "paged_token_rows_invariant": ({"paged_attention"}, batch_invariant(paged_token_rows)),
    "gguf_matvec_row_groups_invariant": ({"gguf_dequantize", "gguf_matmul"},
                                         batch_invariant(gguf_matvec_row_groups)),
    # the fused decoder layer: a llama layer of 8 decode rows (mixed weight types), a
    # gemma3 layer (q/k norm, sandwich norms, GELU, GPT-J pairs), 9 rows (two row groups)
    "decoder_layer_llama": ({"decoder_layer", "paged_attention"}, lambda: layer.check_against_reference(
        make_case(("Q4_1", "Q8_0", "Q6_K", "Q4_0", "Q4_K", "F16", "Q6_K"), "float16", rows=8,
                  ctx=[1, 16, 17, 33, 100, 7, 64, 65], qkv_bias=True, o_bias=True))),
    "decoder_layer_gemma": ({"decoder_layer", "paged_attention"}, lambda: layer.check_against_reference(
        make_case(("Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q4_K", "Q6_K"), "bfloat16", rows=3,
                  ctx=[5, 17, 40], qk_norm=True, sandwich=True, gelu=True, neox=False,
                  rotary_dim=32))),
    "decoder_layer_long_batch": ({"decoder_layer", "paged_attention", "rms_norm", "gguf_matmul"},
                                 lambda: layer.check_against_reference(make_case(
                                     ("Q4_K", "Q4_1", "Q6_K", "Q4_K", "Q8_0", "Q4_K", "Q6_K"),
                                     "float16", rows=11, ctx=[5, 17, 16, 40, 1, 9, 2, 33, 3, 8, 20],
                                     qkv_bias=True, o_bias=True, qk_norm=True))),
    "decoder_layer_long_batch_gemma": ({"decoder_layer", "paged_attention", "rms_norm", "gguf_matmul"},
                                       lambda: layer.check_against_reference(make_case(
                                           ("Q6_K",) * 7, "float32", rows=10, sandwich=True,
                                           gelu=True, qk_norm=True))),
    "decoder_layer_unstaged": ({"decoder_layer", "paged_attention"},
                               lambda: layer.test_rows_too_wide_to_stage_are_normalised_on_the_fly("float32")),
    "decoder_layer_row_groups_invariant": ({"decoder_layer", "paged_attention"}, batch_invariant(
        lambda: layer.check_against_reference(make_case(("Q8_0",) * 7, "float32", rows=9)))),
    # split-KV attention folded into the o projection (it combines the partitions while
    # staging): 3 partitions of 512 (a partial last one), a short row with empty ones;
    # batch-invariant mode: a row of 2 aligned 1024-key partitions next to a direct one
    "decoder_layer_split_kv": ({"decoder_layer", "paged_attention"}, lambda: layer.check_against_reference(
        make_case(("Q4_K", "Q8_0", "Q6_K", "Q4_1", "Q4_K", "Q8_0", "Q6_K"), "float16", rows=2,
                  ctx=[1025, 30], qk_norm=True, sandwich=True, gelu=True))),
    "decoder_layer_split_kv_invariant": ({"decoder_layer", "paged_attention"}, batch_invariant(
        lambda: layer.check_against_reference(make_case(("Q8_0",) * 7, "bfloat16", rows=2,
                                                        ctx=[20, 1030])))),
}
for _t in SUPPORTED:  # mat-vec (up to 8 rows) and mat-mat, every type
    _k = 2 * block_size(_t) if block_size(_t) > 1 else 13
    CASES[f"gguf_{_t.name.lower()}"] = ({"gguf_dequantize", "gguf_matmul"},
                                       lambda t=_t, k=_k: (gguf(t, 3, 9, k), gguf(t, 9, 7, k)))
# fused MoE: uneven loads (an expert with no tokens), odd sizes, 9 slots of Q4_K experts
# routed in groups of up to 8 per weight decode
CASES["fused_moe"] = ({"moe"}, lambda: moe.launches_on_numpy(t=7, h=40, e=6, i=24, k=2))
CASES["fused_moe_gguf"] = ({"moe", "moe_gguf"}, lambda: moe.launches_on_numpy(
    t=9, h=256, e=4, i=256, k=3, dtype="float32", gguf_type=T.Q4_K))
# gpt-oss's variant: biases bound as inputs 5-7, the outputs after them
CASES["fused_moe_gpt_oss"] = ({"moe"}, moe.test_gpt_oss_launches_on_numpy)
CASES["gguf_matvec_lane_shapes"] = ({"gguf_dequantize", "gguf_matmul"}, gguf_matvec_lane_shapes)
CASES["gguf_q4_0_two_row_tiles"] = ({"gguf_dequantize", "gguf_matmul"}, lambda: gguf(SUPPORTED[0], 33, 37, 64))


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_passes_the_checks_under_fuzzed_schedules(checked, case):
    expected, run = CASES[case]
    run()
    assert {s for s, _ in checked} == expected, f"{case} launched {checked}"


def test_every_kernel_source_has_a_case():
    assert set().union(*(s for s, _ in CASES.values())) == set(emulation.kernel_sources())
