"""Qwen3-MoE layers in the fused decoder-layer op (ops.decoder_layer with an MoE MLP).

The op runs the per-op model's own kernels for the MoE MLP (rms_norm, the router's
gguf_matmul, fused_moe / fused_moe_gguf, the residual add), so on the CPU the fused model's
logits equal the per-op model's bit for bit; on the Metal kernels (emulated) they agree to
reordering, and a sequence's logits packed with others equal its logits alone in
batch-invariant mode. The per-op model itself is proven against transformers
(test_models_qwen3_moe*.py, which now run fused). Which MoE layers keep the per-op path, and
bad MoE specs, are checked too."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

import mlx.core as mx  # noqa: E402

from test_models_qwen3_moe import write_checkpoint  # noqa: E402
from test_fused_layers_metal import (  # noqa: E402,F401 (emulated: a fixture)
    assert_packed_equals_alone, emulated, fused_and_per_op)
from test_models_qwen3_moe_gguf import VOCAB, write_gguf  # noqa: E402
from vllm_metal import _core, emulation, ops  # noqa: E402
from vllm_metal.models import load_model  # noqa: E402
from vllm_metal.models.fused_layers import why_not_fused  # noqa: E402
from vllm_metal.models.testing import SCHEDULES  # noqa: E402


def _source(tmp_path, experts: str, **overrides):
    """A tiny qwen3_moe: safetensors ("dense") or a qwen3moe GGUF with experts of that type."""
    config, _ = write_checkpoint(tmp_path / "hf", vocab_size=VOCAB, seed=6, **overrides)
    if experts == "dense":
        return str(tmp_path / "hf")
    return str(write_gguf(tmp_path / "hf", config, tmp_path / f"moe-{experts}.gguf", experts))


@pytest.mark.parametrize("experts, dtype", [
    ("dense", "float32"), ("dense", "float16"), ("dense", "bfloat16"),
    ("Q8_0", "float32"), ("Q4_0", "float16")])
def test_cpu_fused_moe_layers_equal_per_op_bitwise(tmp_path, monkeypatch, experts, dtype):
    """Packed prefill chunks and decode rows through 3 sparse layers (norm_topk_prob off for
    Q8_0)."""
    path = _source(tmp_path, experts, num_hidden_layers=3, norm_topk_prob=experts != "Q8_0")
    rng = np.random.default_rng(3)
    sequences = [rng.integers(3, VOCAB, sum(s)).tolist() for s in SCHEDULES]
    fused, per_op = fused_and_per_op(monkeypatch, path, dtype, sequences, SCHEDULES)
    for a, b in zip(fused, per_op):
        assert np.isfinite(a).all()
        assert np.array_equal(a, b), f"max |fused - per-op| = {np.abs(a - b).max()}"


def test_cpu_dense_mlp_layer_beside_moe_layers_fuses(tmp_path, monkeypatch):
    """mlp_only_layers: layer 0's dense MLP fuses as a llama MLP does, whose act(gate) * up
    is computed in one pass (MLX's per-op silu and multiply differ by float32 rounding)."""
    path = _source(tmp_path, "dense", mlp_only_layers=[0], num_hidden_layers=3)
    rng = np.random.default_rng(3)
    sequences = [rng.integers(3, VOCAB, sum(s)).tolist() for s in SCHEDULES]
    fused, per_op = fused_and_per_op(monkeypatch, path, "float32", sequences, SCHEDULES)
    for a, b in zip(fused, per_op):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6 * max(np.abs(b).max(), 1.0))


# decode rows next to short chunks (the fused attention kernels) and a 13-token chunk (the
# op's long-batch plan); the MoE MLP runs the same kernels at either size
METAL_SCHEDULES = [[3, 1, 1, 1, 1], [1, 2, 1, 1], [13, 1, 1]]


@pytest.mark.parametrize("experts, dtype, tol", [("Q8_0", "float32", 1e-5),
                                                 ("dense", "float16", 2e-2)])
def test_emulated_metal_fused_moe_layers_match_per_op(emulated, tmp_path, monkeypatch, experts,
                                                      dtype, tol):
    """Head size 64 (the Metal attention kernels'); float16 adds the router logits' cast
    kernel. The per-op path's attention ops round between them where the fused kernels do not."""
    path = _source(tmp_path, experts, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    rng = np.random.default_rng(4)
    sequences = [rng.integers(3, VOCAB, sum(s)).tolist() for s in METAL_SCHEDULES]
    fused, per_op = fused_and_per_op(monkeypatch, path, dtype, sequences, METAL_SCHEDULES)
    for a, b in zip(fused, per_op):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * max(np.abs(b).max(), 1.0))


def test_emulated_metal_fused_moe_layer_is_batch_invariant(emulated, tmp_path):
    path = _source(tmp_path, "Q4_0", num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    model = load_model(path, "float16")
    assert why_not_fused(model.model) is None
    seqs = [list(range(10, 19)), list(range(40, 46)), list(range(70, 78))]
    assert_packed_equals_alone(model, seqs, [[5, 4], [3, 1, 1, 1], [6, 1, 1]])


def test_moe_layers_it_cannot_express_keep_the_per_op_path(tmp_path):
    """Streamed experts and LoRA keep the per-op path, each naming why."""
    from vllm_metal.lora.layers import LoraLinear
    from vllm_metal.models import expert_offload

    loaded = load_model(_source(tmp_path, "dense"), "float32")
    model = loaded.model
    assert why_not_fused(model) is None
    block = model.layers[1].mlp
    experts = block.switch_mlp
    block.switch_mlp = expert_offload.StreamedSwitchGLU.__new__(expert_offload.StreamedSwitchGLU)
    assert "experts StreamedSwitchGLU" in why_not_fused(model)
    block.switch_mlp = experts
    attn = model.layers[1].self_attn
    q = attn.q_proj
    attn.q_proj = LoraLinear.__new__(LoraLinear)
    assert "LoRA on an MoE model" in why_not_fused(model)
    attn.q_proj = q
    assert why_not_fused(model) is None


@pytest.fixture(scope="module")
def moe_call(tmp_path_factory):
    """One valid decoder_layer call on a tiny qwen3_moe layer with GGUF experts."""
    loaded = load_model(_source(tmp_path_factory.mktemp("op"), "Q8_0"), "float32")
    layer = loaded.model._fused_layers()[0]
    spec = layer.spec
    assert spec.num_experts == 8 and spec.top_k == 2 and spec.expert_blocks
    t, blocks, block_size = 3, 4, 4
    cache = mx.zeros((blocks, block_size, spec.num_kv_heads, spec.head_dim))
    return dict(x=mx.random.normal((t, spec.hidden)), positions=mx.arange(t, dtype=mx.int32),
                slot_mapping=mx.array([0, 1, 2], mx.int64),
                block_tables=mx.array([[0]], mx.int32), seq_lens=mx.array([t], mx.int32),
                cu_seqlens_q=mx.array([0, t], mx.int32), key_cache=cache, value_cache=cache,
                rope_table=layer.rope_table, weights=list(layer.weights), spec=spec)


def _spec_with(spec, **fields):
    new = _core.DecoderLayerSpec()
    for name in dir(spec):
        if not name.startswith("_") and name not in ("weight_names",):
            setattr(new, name, getattr(spec, name))
    for name, value in fields.items():
        setattr(new, name, value)
    return new


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(spec=_spec_with(a["spec"], top_k=9)), r"top_k must be in \[1, num_experts = 8\]"),
    (lambda a: a.update(spec=_spec_with(a["spec"], expert_blocks=False)),
     "dense experts must be F32, F16 or BF16"),
    (lambda a: a.update(weights=a["weights"][:6] + [a["weights"][6][:-1]] + a["weights"][7:]),
     "gate_exps must hold"),
    (lambda a: a.update(weights=a["weights"][:-1] + [a["weights"][-1][:-1]]), "router must hold"),
])
def test_bad_moe_input_is_refused(moe_call, change, message):
    args = dict(moe_call)
    change(args)
    with pytest.raises(ValueError, match=message):
        _core.decoder_layer(**args)


@pytest.mark.parametrize("backend", ["native", "emulated"])
def test_a_step_without_tokens_gives_an_empty_stream(moe_call, backend):
    """A packed step can hold sequences with no new tokens at all: nothing runs (an empty
    Metal plan has grids of zero threadgroups, which Metal refuses)."""
    emulation.load_all()
    previous = ops.kernel_backend()
    ops.set_kernel_backend(backend)
    try:
        args = dict(moe_call, x=mx.zeros((0, moe_call["spec"].hidden)),
                    positions=mx.zeros((0,), mx.int32), slot_mapping=mx.zeros((0,), mx.int64),
                    cu_seqlens_q=mx.array([0, 0], mx.int32))
        out = _core.decoder_layer(**args)
        mx.eval(out)
    finally:
        ops.set_kernel_backend(previous)
    assert out.shape == (0, moe_call["spec"].hidden)
