"""benchmarks/step_recorder.py: every dispatch of a decode step, none dropped.

A 1-layer llama (head size 64, Q8_0 GGUF, float16) decodes one token on the GPU path. The
recorder's dispatch count must equal an independent count: our ops' launches from their
planners at the toy's shapes (the ops listed by hand), plus MLX's kernels counted by hand.
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
    from vllm_metal.models.testing import tiny_config, write_tiny_gguf

    _, msm = modules
    cfg = tiny_config("llama", hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=1,
                      num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=HEAD,
                      vocab_size=VOCAB, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("toy") / "toy.gguf"
    write_tiny_gguf(cfg, path, qtype="Q8_0")
    loaded = msm.load(str(path))
    return loaded, msm.DecodeStep(loaded, 1, CONTEXT)


def _layer_plan() -> list:
    """The fused decoder layer's Metal plan at the toy's shapes (decode: 1 row)."""
    spec = _core.DecoderLayerSpec()
    spec.hidden, spec.num_heads, spec.num_kv_heads = HIDDEN, HQ, HKV
    spec.head_dim, spec.intermediate, spec.rotary_dim = HEAD, FFN, HEAD
    spec.types = [8] * 7  # Q8_0
    spec.scale = HEAD ** -0.5
    plan, _ = _core.plan_decoder_layer(spec, "float16", 1, 1, 4, 16, 3, 1, CONTEXT + 1, 1)
    return plan


def _expected_our_launches() -> int:
    """Launches of the toy's ops, from the planners (no recording involved)."""
    plans = [
        _core.plan_gguf_dequantize("Q8_0", "float16", 1, HIDDEN),              # embedding row
        _layer_plan(),                                                          # the layer, fused
        _core.plan_rms_norm("float16", 1, HIDDEN, fused_add=False),            # final norm
        _core.plan_gguf_matmul("Q8_0", "float16", 1, VOCAB, HIDDEN),           # tied lm head
    ]
    return sum(len(p) for p in plans)


# MLX kernels of the step, by hand: the embedding's row gather, the logits row gather of h,
# the sampler's float32 cast, argmax, and the int32 cast of the tokens (the fused layer
# leaves MLX no SiLU(gate) * up and no zero sinks).
EXPECTED_MLX = {"Gather": 2, "AsType": 2, "ArgReduce": 1}


def test_dispatches_equal_an_independent_count(modules, toy):
    sr, _ = modules
    _, step = toy
    rec = step.record()
    ours = rec.count(sr.OURS)
    assert ours == rec.launches == _expected_our_launches()
    mlx_ops = {}
    for d in rec.dispatches:
        if d.source == sr.MLX:
            name = "Compiled" if d.op.startswith("Compiled") else d.op
            mlx_ops[name] = mlx_ops.get(name, 0) + 1
    assert mlx_ops == EXPECTED_MLX
    assert rec.count() == _expected_our_launches() + sum(EXPECTED_MLX.values())
    # the weights (Q8_0: 34 bytes per 32) are read: at least the matrices' bytes
    weights = (HIDDEN * (2 * HQ * HEAD + 2 * HKV * HEAD + 3 * FFN) + VOCAB * HIDDEN) // 32 * 34
    assert rec.total("bytes", sr.OURS) >= weights


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
