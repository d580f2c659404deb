"""benchmarks/step_recorder.py: every dispatch of a decode step, none dropped.

A 1-layer llama (head size 64, Q8_0 GGUF, float16) decodes one token on the GPU path, on
the fused layer and on the per-op one. The recorder's dispatch count must equal an
independent count: our ops' launches from their planners at the toy's shapes (the ops
listed by hand), plus MLX's kernels counted by hand.
The graph walk must also see every call of an mx.compile'd function (MLX shares one
Compiled primitive between them) and every launch must belong to a graph node.
"""

import importlib
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from vllm_metal import _core, emulation

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not emulation.emulator_available(), reason="needs clang >= 19 (mslemu)")

HIDDEN, FFN, HQ, HKV, HEAD, VOCAB, CONTEXT = 128, 192, 2, 1, 64, 300, 40


@pytest.fixture(scope="module")
def modules():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    return importlib.import_module("step_recorder"), importlib.import_module("metal_step_model")


@pytest.fixture(scope="module")
def toy(modules, tmp_path_factory):
    """A 1-layer llama GGUF, loaded for the GPU path."""
    from vllm_metal.models.testing import tiny_config, write_tiny_gguf

    _, msm = modules
    cfg = tiny_config("llama", hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=1,
                      num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=HEAD,
                      vocab_size=VOCAB, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("toy") / "toy.gguf"
    write_tiny_gguf(cfg, path, qtype="Q8_0")
    return msm.load(str(path))


NUM_BLOCKS, MAX_BLOCKS = 4, 3  # DecodeStep's pool: ceil((CONTEXT + 1) / 16) blocks + 1


def _outside_the_layer(residual_apart: bool):
    """The plans of the step's ops outside its layer. The per-op layer leaves its residual
    apart (the final norm adds it); the fused layer's output is the summed stream."""
    return [
        _core.plan_gguf_dequantize("Q8_0", "float16", 1, HIDDEN),              # embedding row
        _core.plan_rms_norm("float16", 1, HIDDEN, fused_add=residual_apart),   # final norm
        _core.plan_gguf_matmul("Q8_0", "float16", 1, VOCAB, HIDDEN),           # tied lm head
    ]


def _expected_per_op_launches() -> int:
    """Launches of the toy's per-op layer and the rest, from the planners (no recording)."""
    plans = [
        *_outside_the_layer(residual_apart=True),
        _core.plan_rms_norm("float16", 1, HIDDEN, fused_add=False),            # input norm
        *[_core.plan_gguf_matmul("Q8_0", "float16", 1, n, HIDDEN) for n in (HQ * HEAD, HKV * HEAD, HKV * HEAD)],
        *[_core.plan_rope("float16", "int32", 1, h, HEAD, is_neox=True, mscale=1.0) for h in (HQ, HKV)],
        *[_core.plan_cache_write("float16", 1, HKV, HEAD, 64, [HKV * HEAD, HEAD, 1])] * 2,  # k, v
        _core.plan_paged_attention("float16", 1, 1, HQ, HKV, HEAD, 16, NUM_BLOCKS, MAX_BLOCKS,
                                   num_decode_seqs=1, max_seq_len=CONTEXT + 1, max_query_len=1,
                                   scale=HEAD ** -0.5, partition_size=512),
        _core.plan_gguf_matmul("Q8_0", "float16", 1, HIDDEN, HQ * HEAD),       # o
        _core.plan_rms_norm("float16", 1, HIDDEN, fused_add=True),             # post-attention
        *[_core.plan_gguf_matmul("Q8_0", "float16", 1, FFN, HIDDEN)] * 2,      # gate, up
        _core.plan_gguf_matmul("Q8_0", "float16", 1, HIDDEN, FFN),             # down
    ]
    return sum(len(p) for p in plans)


def _expected_fused_launches() -> int:
    """Launches of the toy's fused layer (its Metal plan) and the rest, from the planners."""
    spec = _core.DecoderLayerSpec()
    spec.hidden, spec.num_heads, spec.num_kv_heads = HIDDEN, HQ, HKV
    spec.head_dim, spec.intermediate, spec.rotary_dim = HEAD, FFN, HEAD
    spec.types = [8] * 7  # Q8_0
    spec.scale = HEAD ** -0.5
    layer, _ = _core.plan_decoder_layer(spec, "float16", 1, 1, NUM_BLOCKS, 16, MAX_BLOCKS, 1, CONTEXT + 1, 1)
    return len(layer) + sum(len(p) for p in _outside_the_layer(residual_apart=False))


# MLX kernels of the step, by hand. Both paths: the embedding's row gather, the logits row
# gather of h, the sampler's float32 cast, argmax, and the int32 cast of the tokens. The
# per-op path also: SiLU(gate) * up (one compiled kernel) and the logits row gather of the
# residual (the fused layer sums the residual itself).
EXPECTED_MLX = {
    True: {"Gather": 2, "AsType": 2, "ArgReduce": 1},
    False: {"Gather": 3, "Compiled": 1, "AsType": 2, "ArgReduce": 1},
}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "per-op"])
def test_dispatches_equal_an_independent_count(modules, toy, fused):
    sr, msm = modules
    rec = msm.DecodeStep(toy, 1, CONTEXT, fused).record()
    expected = _expected_fused_launches() if fused else _expected_per_op_launches()
    ours = rec.count(sr.OURS)
    assert ours == rec.launches == expected
    mlx_ops = {}
    for d in rec.dispatches:
        if d.source == sr.MLX:
            name = "Compiled" if d.op.startswith("Compiled") else d.op
            mlx_ops[name] = mlx_ops.get(name, 0) + 1
    assert mlx_ops == EXPECTED_MLX[fused]
    assert rec.count() == expected + sum(EXPECTED_MLX[fused].values())
    # the weights (Q8_0: 34 bytes per 32) are read: at least the matrices' bytes
    weights = (HIDDEN * (2 * HQ * HEAD + 2 * HKV * HEAD + 3 * FFN) + VOCAB * HIDDEN) // 32 * 34
    assert rec.total("bytes", sr.OURS) >= weights


def test_the_fused_step_runs_the_layer_as_one_op(modules, toy):
    """The fused layer's launches all belong to one graph node; the per-op layer's to many."""
    sr, msm = modules
    nodes = {}
    for fused in (True, False):
        rec = msm.DecodeStep(toy, 1, CONTEXT, fused).record()
        nodes[fused] = {d.node for d in rec.dispatches if d.source == sr.OURS and d.op == "DecoderLayer"}
    assert len(nodes[True]) == 1 and not nodes[False]


def test_a_layer_is_what_a_second_layer_adds(modules):
    sr, msm = modules
    d = lambda op, shapes="1x8": sr.Dispatch(sr.OURS, op, op.lower(), 100, 0, shapes)  # noqa: E731
    one = sr.StepRecord([d("Embed"), d("Norm"), d("Matmul"), d("Head")], {}, 4, 4)
    two = sr.StepRecord([d("Embed"), d("Norm"), d("Matmul"), d("Norm"), d("Matmul"), d("Head")], {}, 6, 6)
    layer, outside = msm.layer_split(one, two)
    assert [x.op for x in layer] == ["Norm", "Matmul"]
    assert [x.op for x in outside] == ["Embed", "Head"]
    with pytest.raises(RuntimeError):
        msm.layer_split(two, one)


def test_every_call_of_a_compiled_function_is_a_node(modules):
    sr, _ = modules
    from vllm_metal import ops

    sr.enable_counting()
    x = mx.ones((1, 64), mx.float16)
    w = mx.zeros((64, 68), mx.uint8)  # Q8_0 [64, 64]
    mx.eval(x, w)
    silu_mul = mx.compile(lambda g, u: g * mx.sigmoid(g) * u)

    def build():
        h = x
        for _ in range(3):
            h = silu_mul(ops.gguf_matmul(h, w, "Q8_0", [64, 64]), ops.gguf_matmul(h * 2, w, "Q8_0", [64, 64]))
        return [h]

    rec = sr.record(build)
    assert rec.launches == rec.count(sr.OURS) == 6
    assert sum(d.op.startswith("Compiled") for d in rec.dispatches) == 3
    assert sum(d.op == "Multiply" for d in rec.dispatches) == 3  # h * 2


def test_an_unclassified_mlx_op_is_an_error(modules, monkeypatch):
    sr, _ = modules
    import mlx_metal_ops

    monkeypatch.setattr(mlx_metal_ops, "_ELEMENTWISE", mlx_metal_ops._ELEMENTWISE - {"Multiply"})
    x = mx.ones((4,))
    mx.eval(x)
    with pytest.raises(KeyError, match="Multiply"):
        sr.record(lambda: [x * 3])


def test_a_large_grid_counted_on_prefixes_matches_the_whole_count(modules):
    """Grids over 512 threadgroups are counted on 64 and 128 and extrapolated: exact for
    equal threadgroups; a partial last one counts as whole (a bound: at most its share)."""
    sr, _ = modules
    from vllm_metal import kernel_traffic as kt
    from vllm_metal import ops

    k, row = 576, 576 // 32 * 34
    (probe,) = _core.plan_gguf_matmul("Q8_0", "float16", 1, 4096, k)
    rows = -(-4096 // probe.grid[0])  # weight rows per threadgroup
    # 600 full threadgroups; then 601, the last holding 2 rows (rows - 2 counted too many)
    for n, missing in ((600 * rows, 0), (600 * rows + 2, rows - 2)):
        x = mx.ones((1, k), mx.float16)
        w = mx.zeros((n, row), mx.uint8)
        mx.eval(x, w)
        rec = sr.record(lambda: [ops.gguf_matmul(x, w, "Q8_0", [n, k])])
        (d,) = [d for d in rec.dispatches if d.source == sr.OURS]
        exact = kt.measure(kt.gguf_matvec("Q8_0", "float16", 1, n, k)).unique
        assert d.sampled
        assert exact <= d.bytes <= exact + missing * (row + 2)
