"""The fused Metal decoder layer (src/metal/decoder_layer.metal, plan_decoder_layer) in
the emulator: every intermediate against a NumPy float64 reference that rounds where
the kernels round (decoder_layer_case.py), and bitwise against the per-op Metal kernels
it replaces (rms_norm, gguf_matvec, rope, cache_write, paged_attention, add_rms_norm)
wherever the arithmetic is the same; then the op itself on the emulated backend."""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx

from decoder_layer_case import from_f64, make_case, reference, to_f64
from vllm_metal import _core, emulation, ops
from vllm_metal import kernel_traffic as kt

TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "F16"]
# max |got - ref| / max(1, max |ref|) per dtype: a few ulps of the output type after a
# handful of roundings (the reference's float64 sums move a rounding now and then)
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
# contexts: a first token, block boundaries +-1 (block size 16), odd positions
CTX = [1, 16, 17, 33, 100, 7, 64, 65]


@pytest.fixture(autouse=True)
def strict(monkeypatch):
    monkeypatch.setenv("MSLEMU_POISON", "1")
    monkeypatch.setenv("MSLEMU_STRICT", "1")


def folds_reduce(case) -> bool:
    """Split-KV attention whose reduce the o projection folds in (layer_matvec's
    fc_combine): the attention output is then never written as such, only staged."""
    return any(l.kernel.startswith("layer_matvec") and l.constants[11].bits == 1
               for l in case.plan)


def outputs(case) -> dict:
    a, s, dt = case.arrays, case.slots, case.dtype
    rows = a[0].shape[0]
    hkv, d = case.spec.num_kv_heads, case.spec.head_dim
    kc = to_f64(a[6], dt).reshape(-1, hkv, d)
    vc = to_f64(a[7], dt).reshape(-1, hkv, d)
    return dict(q=to_f64(a[s["q"]], dt), k=kc[a[2]], v=vc[a[2]],
                attn=to_f64(a[s["attn"]], dt).reshape(rows, -1), h=to_f64(a[s["h"]], dt),
                act=to_f64(a[s["act"]], dt), out=to_f64(a[s["out"]], dt))


def check_against_reference(case):
    before_k, before_v = case.arrays[6].copy(), case.arrays[7].copy()
    emulation.run_plan(case.plan, case.arrays)
    ref, got = reference(case), outputs(case)
    if folds_reduce(case):  # attn is not written: h and out carry it
        del ref["attn"]
    for name in ref:
        assert np.isfinite(got[name]).all(), f"{case.name}: {name} not finite"
        err = np.abs(got[name] - ref[name]).max() / max(1.0, np.abs(ref[name]).max())
        assert err <= TOL[case.dtype], f"{case.name}: {name} off by {err:.3g}"
    # only the rows' own slots of the caches changed
    slots = case.arrays[2]
    for cache, before in ((case.arrays[6], before_k), (case.arrays[7], before_v)):
        flat = cache.reshape(cache.shape[0] * cache.shape[1], -1)
        old = before.reshape(flat.shape)
        keep = np.ones(flat.shape[0], bool)
        keep[slots] = False
        assert (flat[keep] == old[keep]).all(), f"{case.name}: cache slots outside slot_mapping written"


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_llama_layer_every_type(qtype, dtype):
    check_against_reference(make_case((qtype,) * 7, dtype, rows=3, ctx=CTX[:3], seed=1))


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 13])
def test_rows_and_row_groups(rows):
    """1..8 rows share one pass over the weights; 9+ take the long-batch plan."""
    ctx = (CTX * 2)[:rows]
    check_against_reference(make_case(("Q4_1", "Q8_0", "Q6_K", "Q4_0", "Q4_K", "F16", "Q6_K"),
                                      "float16", rows=rows, ctx=ctx, seed=rows))


def test_row_groups_of_the_fused_kernels():
    """In batch-invariant mode every batch takes the fused kernels, 8 rows per group."""
    ops.set_batch_invariant(True)
    try:
        case = make_case(("Q4_1", "Q8_0", "Q6_K", "Q4_0", "Q4_K", "F16", "Q6_K"), "float16",
                         rows=13, ctx=(CTX * 2)[:13], seed=4)
        assert case.plan[0].kernel == "layer_qkv_float16" and case.plan[0].grid[1] == 2
        check_against_reference(case)
    finally:
        ops.set_batch_invariant(False)


@pytest.mark.parametrize("layout", [
    dict(qkv_bias=True, o_bias=True),                             # llama attention_bias, qwen2
    dict(qk_norm=True),                                           # qwen3
    dict(qk_norm=True, sandwich=True, gelu=True),                 # gemma3
    dict(neox=False, rotary_dim=32),                              # GPT-J pairs, partial rotary
    dict(heads=8, kv_heads=1, rotary_dim=16),                     # wide GQA group
    dict(head_dim=256, heads=2, kv_heads=1, intermediate=512),    # gemma's head size
])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_layouts(layout, dtype):
    check_against_reference(make_case(("Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q4_K", "Q6_K"),
                                      dtype, rows=4, ctx=CTX[3:7], seed=7, **layout))


def test_reference_check_fails_on_a_broken_kernel():
    """The comparison can fail: a kernel rotating the wrong pairs is caught."""
    case = make_case(("Q8_0",) * 7, "float32", rows=2, ctx=[5, 40], seed=3)
    case.spec.neox = False  # the reference now pairs (2i, 2i + 1); the plan pairs (i, i + D/2)
    with pytest.raises(AssertionError, match="off by"):
        check_against_reference(case)


# ---- bitwise against the per-op kernels ----------------------------------------------


def _run(plan, arrays):
    emulation.run_plan(plan, arrays)
    return arrays


def per_op(case) -> dict:
    """The per-op Metal kernels on the same inputs, up to the residual stream h; then
    the down projection and residual add on the fused layer's own activation."""
    s, dt, a = case.spec, case.dtype, case.arrays
    rows, hid, d = a[0].shape[0], s.hidden, s.head_dim
    hq, hkv = s.num_heads, s.num_kv_heads
    w = {n: a[case.slots[n]] for n in s.weight_names()}
    empty = lambda shape: np.zeros(shape, a[0].dtype)  # noqa: E731

    def matmul(x, name, n, k, i):
        y = empty((x.shape[0], n))
        return _run(_core.plan_gguf_matmul(s.types[i], dt, x.shape[0], n, k), [x, w[name], y])[2]

    def add(x, b):
        return from_f64(to_f64(x, dt) + to_f64(b, dt), dt)

    xn = _run(_core.plan_rms_norm(dt, rows, hid, eps=s.norm_eps), [a[0], w["input_norm"], empty((rows, hid))])[2]
    kc, vc = a[6].copy(), a[7].copy()
    num_slots = kc.shape[0] * kc.shape[1]
    heads = {"q": hq, "k": hkv, "v": hkv}
    out = {}
    for i, name in enumerate("qkv"):
        y = matmul(xn, name + "_proj", heads[name] * d, hid, i)
        if s.qkv_bias:
            y = add(y, w[name + "_bias"])
        y = np.ascontiguousarray(y.reshape(rows, heads[name], d))
        if s.qk_norm and name != "v":
            y = _run(_core.plan_rms_norm(dt, rows * heads[name], d, eps=s.qk_norm_eps),
                     [y.reshape(-1, d), w[name + "_norm"], empty((rows * heads[name], d))])[2]
            y = y.reshape(rows, heads[name], d)
        if name != "v":
            y = _run(_core.plan_rope(dt, "int32", rows, heads[name], d, rotary_dim=s.rotary_dim,
                                     is_neox=s.neox, mscale=s.rope_mscale),
                     [y, a[1], a[8], empty(y.shape)])[3]
        out[name] = y
    for name, cache in (("k", kc), ("v", vc)):
        _run(_core.plan_cache_write(dt, rows, hkv, d, num_slots, [hkv * d, d, 1], False),
             [out[name], cache, a[2], cache])
    attn = empty((rows, hq, d))
    sinks = np.zeros(1, np.float32)
    # paged attention's own plan, its split-KV reduce included (batch-invariant mode:
    # partitions of kInvariantPartitionSize, as the layer's plan)
    plan = _core.plan_paged_attention(dt, rows, rows, hq, hkv, d, kc.shape[1], kc.shape[0],
                                      a[3].shape[1], rows, max(case.ctx), 1, scale=s.scale,
                                      partition_size=1024 if _core.batch_invariant() else 512)
    parts = plan[0].grid[2]
    scratch = ([np.zeros((rows, hq, parts, d), np.float32), np.zeros((rows, hq, parts), np.float32),
                np.zeros((rows, hq, parts), np.float32)] if parts > 1 else [np.zeros(1, np.float32)] * 3)
    _run(plan, [out["q"], kc, vc, a[3], a[4], a[5], sinks, attn] + scratch)
    def norm(y, name):  # gemma's output norms
        return _run(_core.plan_rms_norm(dt, rows, hid, eps=s.norm_eps), [y, w[name], empty((rows, hid))])[2]

    o = matmul(attn.reshape(rows, -1), "o_proj", hid, hq * d, 3)
    if s.o_bias:
        o = add(o, w["o_bias"])
    h = add(a[0], norm(o, "attn_out_norm") if s.sandwich else o)

    def finish():  # after the fused plan ran: its activation through the per-op down
        down = matmul(a[case.slots["act"]], "down_proj", hid, s.intermediate, 6)
        return add(h, norm(down, "mlp_out_norm") if s.sandwich else down)

    return dict(q=out["q"].reshape(rows, -1), key_cache=kc, value_cache=vc,
                attn=attn.reshape(rows, -1), h=h), finish


@pytest.mark.parametrize("rows", [5, 12])  # the fused kernels; the long-batch plan
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("layout", [dict(), dict(qkv_bias=True, o_bias=True, qk_norm=True),
                                    dict(neox=False, rotary_dim=32)])
def test_same_bits_as_the_per_op_kernels(dtype, layout, rows):
    case = make_case(("Q4_K", "Q4_1", "Q6_K", "Q8_0", "Q4_0", "Q4_K", "Q6_K"), dtype, rows=rows,
                     ctx=([3, 17, 16, 50, 1] * 3)[:rows], seed=11, **layout)
    check_same_bits(case, layout)


# model-sized layers: the mat-vec shapes gguf_matvec picks at k = 576 / 1536 (SmolLM2) and
# 640 / 1024 / 2048 (Gemma-3-270M), each a row split no smaller case reaches
SMOLLM2 = dict(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536)
GEMMA3 = dict(hidden=640, heads=4, kv_heads=1, head_dim=256, intermediate=2048, qk_norm=True,
              sandwich=True, gelu=True)
MODEL_LAYERS = {
    "smollm2-q4_1": (("Q4_1",) * 7, SMOLLM2),
    "smollm2-q8_0": (("Q8_0",) * 7, SMOLLM2),
    # Gemma-3-270M's Q4_K_M file: q, k, gate, up Q5_0; v Q8_0 (half the layers); o Q4_K;
    # down Q6_K (half the layers)
    "gemma3": (("Q5_0", "Q5_0", "Q8_0", "Q4_K", "Q5_0", "Q5_0", "Q6_K"), GEMMA3),
    # awkward widths: k = 352 and 224 (2 lanes a row, 16 rows a simdgroup, a partial last
    # threadgroup), k = 192 (8-weight pieces)
    "odd-k": (("Q8_0", "Q4_0", "Q4_1", "Q8_0", "Q4_1", "Q8_0", "Q4_0"),
              dict(hidden=352, heads=3, kv_heads=1, head_dim=64, intermediate=224)),
}


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("model", list(MODEL_LAYERS))
def test_same_bits_as_the_per_op_kernels_at_model_shapes(model, dtype, rows):
    types, layout = MODEL_LAYERS[model]
    case = make_case(types, dtype, rows=rows, ctx=([3, 17, 16, 50, 1, 33, 7, 64])[:rows],
                     seed=12, **layout)
    check_same_bits(case, model)


# split-KV contexts: past 1024 keys the decode kernel splits into 512-key partitions (3 at
# 1025: a partial last one of 1 key; 4 at 1537, 1600); every decode row of the launch then
# leaves partials, shorter ones empty partitions (-inf max). Batch-invariant mode: 1024-key
# partitions by each row's own keys, rows within one partition written directly.
SPLIT_CTX = [1025, 1600, 40, 1537, 700]


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("model", ["smollm2-q4_1", "gemma3"])
def test_same_bits_at_split_contexts(model, dtype, rows, invariant):
    """The o projection combines split-KV attention's partitions as paged_attention_reduce
    does (its order, rounded to T): h and out are the per-op kernels' bits (attention with
    its reduce, then gguf_matvec). The attention output itself is not written then, so
    it is checked through h and out."""
    types, layout = MODEL_LAYERS[model]
    ctx = [2100, 40, 1100, 1025, 3][:rows] if invariant else SPLIT_CTX[:rows]
    ops.set_batch_invariant(invariant)
    try:
        case = make_case(types, dtype, rows=rows, ctx=ctx, seed=13, **layout)
        assert folds_reduce(case)
        assert not any("reduce" in l.kernel for l in case.plan)
        check_same_bits(case, model)
    finally:
        ops.set_batch_invariant(False)


@pytest.mark.parametrize("layout", [dict(), dict(sandwich=True, gelu=True, qk_norm=True)])
def test_split_contexts_against_the_reference(layout):
    case = make_case(("Q4_K", "Q4_1", "Q6_K", "Q8_0", "Q4_0", "Q4_K", "Q6_K"), "float16", rows=4,
                     ctx=[1025, 30, 1200, 513], seed=14, **layout)
    assert folds_reduce(case)
    check_against_reference(case)


def test_split_reduce_stays_when_the_combine_does_not_fit():
    """8 float32 rows of q width 1024 fill the o projection's 32 KB with the staged rows
    alone: the partitions' statistics do not fit next to them, so attention keeps its
    reduce dispatch and o reads its output (same bits either way)."""
    case = make_case(("Q8_0", "Q4_0", "Q4_1", "Q8_0", "Q4_1", "Q8_0", "Q4_0"), "float32", rows=8,
                     hidden=128, heads=16, kv_heads=1, head_dim=64, intermediate=128,
                     ctx=[1030, 5, 17, 1200, 2, 9, 600, 1025], seed=15)
    kernels = [l.kernel for l in case.plan]
    assert "paged_attention_reduce_float32_d64" in kernels and not folds_reduce(case)
    o = case.plan[kernels.index("paged_attention_reduce_float32_d64") + 1]
    assert o.kernel == "layer_matvec_float32" and o.constants[9].bits == 1  # staged
    check_same_bits(case, "fallback")


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("model", ["smollm2-q4_1", "smollm2-q8_0", "gemma3"])
def test_matvec_lane_use_at_model_shapes(model, rows):
    """Each fused mat-vec kernel (whole launch: norms, staging and epilogues included) keeps
    its lanes as busy as gguf_matvec at the same (type, k): 1.0, no lane idles (the old
    core, 32 lanes striding over k = 576's 36 chunks, measured 0.58-0.87)."""
    types, layout = MODEL_LAYERS[model]
    case = kt.decoder_layer(types, "float16", rows, layout["hidden"], layout["heads"],
                            layout["kv_heads"], layout["head_dim"], layout["intermediate"],
                            ctx=40, sandwich=layout.get("sandwich", False))
    lanes = kt.decoder_layer_lanes(case)
    assert [r["kernel"] for r in lanes] == ["layer_qkv", "layer_matvec", "layer_gate_up",
                                           "layer_matvec"]
    for r in lanes:
        assert r["gguf_matvec"] == 1.0, r  # the shapes picked so that none idles
        assert r["lane_use"] >= r["gguf_matvec"], f"{case.name}: {r}"


def check_same_bits(case, label):
    want, finish = per_op(case)  # before the fused plan writes the caches
    emulation.run_plan(case.plan, case.arrays)
    want["out"] = finish()
    a, s = case.arrays, case.slots
    got = dict(q=a[s["q"]], key_cache=a[6], value_cache=a[7],
               attn=a[s["attn"]].reshape(a[0].shape[0], -1), h=a[s["h"]], out=a[s["out"]])
    if folds_reduce(case):  # attn is not written (o stages the combined partitions): h, out
        del want["attn"]
    for name, value in want.items():
        differ = int((got[name].view(np.uint8) != value.view(np.uint8)).sum())
        assert differ == 0, f"{case.name} {label}: {name} differs from the per-op kernels"


# ---- the plan --------------------------------------------------------------------------


def test_long_batches_run_the_per_op_kernels():
    """Past 8 tokens (prefill), the tiled mat-mul and small epilogues, in one plan."""
    case = make_case(("Q4_K",) * 7, "float16", rows=9, ctx=CTX + [3], sandwich=True, gelu=True)
    kernels = [l.kernel for l in case.plan]
    assert kernels.count("gguf_matmul_q4_k_float16") == 7 and "layer_act_float16" in kernels
    assert not any(k.startswith(("layer_matvec", "layer_gate_up")) for k in kernels)


def test_dispatches_per_layer():
    llama = make_case(("Q4_1",) * 7, "float16", rows=8, ctx=CTX)
    assert [l.kernel for l in llama.plan] == [
        "layer_qkv_float16", "paged_attention_decode_float16_d64", "layer_matvec_float16",
        "layer_gate_up_float16", "layer_matvec_float16"]
    gemma = make_case(("Q4_K",) * 7, "float32", rows=2, ctx=[3, 9], sandwich=True, gelu=True,
                      qk_norm=True)
    assert len(gemma.plan) == 6 and gemma.plan[-1].kernel == "layer_add_norm_float32"
    # split-KV contexts (a context of 1024 with the new token: 3 partitions): the o
    # projection folds the reduce in, so still 5 and 6
    for case, n in ((make_case(("Q4_1",) * 7, "float16", rows=1, ctx=[1025], **SMOLLM2), 5),
                    (make_case(MODEL_LAYERS["gemma3"][0], "bfloat16", rows=1, ctx=[1025],
                               **GEMMA3), 6)):
        assert case.plan[1].grid[2] == 3 and len(case.plan) == n and folds_reduce(case)


def test_every_planned_kernel_is_instantiated():
    kernels = emulation.library("decoder_layer").kernels
    for dtype in ("float32", "float16", "bfloat16"):
        case = make_case(("Q8_0",) * 7, dtype, rows=1, ctx=[2], sandwich=True)
        for launch in case.plan:
            if launch.source == "decoder_layer":
                assert launch.kernel in kernels


# ---- the op on the emulated backend ------------------------------------------------


@pytest.fixture
def emulated():
    emulation.load_all()
    previous = ops.kernel_backend()
    ops.set_kernel_backend("emulated")
    yield
    ops.set_kernel_backend(previous)


def _op_args(case):
    a = case.arrays
    arr = lambda i: mx.array(a[i]) if a[i].dtype != np.uint16 else mx.array(a[i]).view(mx.bfloat16)  # noqa: E731
    weights = [arr(case.slots[n]) for n in case.spec.weight_names()]
    return dict(x=arr(0), positions=mx.array(a[1]), slot_mapping=mx.array(a[2]),
                block_tables=mx.array(a[3]), seq_lens=mx.array(a[4]), cu_seqlens_q=mx.array(a[5]),
                key_cache=arr(6), value_cache=arr(7), rope_table=mx.array(a[8]), weights=weights,
                spec=case.spec)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_op_runs_the_plan(emulated, dtype):
    """_core.decoder_layer on the emulated backend: the plan's output, caches in place."""
    case = make_case(("Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q4_K", "Q6_K"), dtype, rows=3,
                     ctx=[4, 33, 17], qk_norm=True, sandwich=True, gelu=True, seed=5)
    args = _op_args(case)
    mx.eval(args["key_cache"], args["value_cache"])
    out = _core.decoder_layer(**args)
    mx.eval(out)
    emulation.run_plan(case.plan, case.arrays)
    want = case.arrays[case.slots["out"]]
    got = np.array(out.view(mx.uint16) if dtype == "bfloat16" else out)
    assert (got == want).all()
    kc = np.array(args["key_cache"].view(mx.uint16) if dtype == "bfloat16" else args["key_cache"])
    assert (kc == case.arrays[6]).all()


def test_op_without_hints_needs_evaluated_metadata(emulated):
    case = make_case(("Q8_0",) * 7, "float32", rows=2, ctx=[2, 5])
    args = _op_args(case)
    args["seq_lens"] = args["seq_lens"] + 0  # lazy
    with pytest.raises(ValueError, match="planning hints"):
        _core.decoder_layer(**args)
    out = _core.decoder_layer(**args, num_decode_seqs=2, max_seq_len=5, max_query_len=1)
    mx.eval(out)
    assert np.isfinite(np.array(out)).all()


def test_wide_rows_sum_their_squares_with_256_threads():
    """Past hidden 1024 rms_norm would use 512+ threads; the mat-vec kernels keep 256 (their
    registers), so the RMS is summed in another order: still the reference's numbers."""
    case = make_case(("Q8_0", "Q4_K", "Q6_K", "Q4_0", "Q4_K", "Q4_1", "Q6_K"), "float32",
                     rows=2, hidden=1280, ctx=[3, 20], seed=6, sandwich=True)
    assert all(l.threadgroup[0] <= 512 for l in case.plan if l.kernel.startswith("layer_qkv"))
    check_against_reference(case)


def _staged(launch) -> bool:
    return next(c.bits for c in launch.constants if c.index == 9) == 1


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rows_too_wide_to_stage_are_normalised_on_the_fly(dtype):
    """8 float32 rows of 1024 do not fit in threadgroup memory next to the head tile: every
    weight row then normalises x itself. Same numbers (and bits) either way."""
    wide = make_case(("Q8_0", "Q4_K", "Q4_K", "Q4_K", "Q6_K", "Q4_0", "Q4_K"), dtype, rows=8,
                     hidden=1024, ctx=CTX, seed=2)
    qkv, gate_up = wide.plan[0], wide.plan[3]
    assert _staged(qkv) == _staged(gate_up) == (dtype == "float16")
    narrow = make_case(("Q4_K",) * 7, dtype, rows=8, ctx=CTX)
    assert _staged(narrow.plan[0]) and _staged(narrow.plan[3])
    check_against_reference(wide)


def test_op_refuses_an_out_of_range_slot(emulated):
    """The kernels skip a slot outside the cache; a computed slot table is refused first."""
    case = make_case(("Q8_0",) * 7, "float32", rows=2, ctx=[2, 5])
    args = _op_args(case)
    num_slots = case.arrays[6].shape[0] * case.arrays[6].shape[1]
    args["slot_mapping"] = mx.array([0, num_slots], mx.int64)
    with pytest.raises(IndexError, match=rf"slot_mapping\[1\] = {num_slots} is outside"):
        _core.decoder_layer(**args)
