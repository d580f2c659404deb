"""Qwen3.5-MoE (qwen3_5_moe: the hybrid gated delta net + attention layers, every MLP a
sparse MoE block with a gated shared expert) from safetensors, routed experts on
ops.fused_moe: greedy tokens and prompt logits against mlx-lm's own qwen3_5_moe forward on
a tiny random checkpoint (4 layers, 8 experts, top-2, hidden 64); requests packed together
with chunked prefill; both HF expert layouts and the published (vision + language) layout
load the same model; the same weights as a llama.cpp qwen35moe GGUF (F32: mlx-lm's tokens;
Q8_0 experts in block form on fused_moe_gguf: equal to the file dequantized)."""

from __future__ import annotations

from dataclasses import fields

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm.models.qwen3_5_moe")

from qwen3_5_checkpoint import (MOE_CONFIG, greedy, reference_model, run_packed_greedy,  # noqa: E402
                                write_checkpoint)
from vllm_metal.models import load_model  # noqa: E402
from vllm_metal.models.moe import FusedMoeBlock  # noqa: E402

STEPS = 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen3_5_moe"), seed=0, config=MOE_CONFIG)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return reference_model(checkpoint)


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, MOE_CONFIG["vocab_size"], int(rng.integers(4, 17))).tolist()
            for _ in range(n)]


def reference_logits(reference, prompt: list[int], steps: int) -> np.ndarray:
    """mlx-lm's logits of each greedy step (prefill's last row, then each decode)."""
    cache = reference.make_cache()
    out = reference(mx.array([prompt]), cache=cache)
    rows = []
    for _ in range(steps):
        rows.append(np.array(out[0, -1]))
        out = reference(mx.array([[int(mx.argmax(out[0, -1]).item())]]), cache=cache)
    return np.stack(rows)


def test_moe_blocks_run_on_fused_moe(checkpoint):
    loaded = load_model(str(checkpoint), "float32")
    assert loaded.spec.architecture == "Qwen3_5MoeForCausalLM"
    assert loaded.hybrid is not None and loaded.hybrid.linear_layers == [0, 1, 2]
    for layer in loaded.model.layers:
        assert type(layer.mlp) is FusedMoeBlock and "shared_expert" in layer.mlp
        assert layer.mlp.switch_mlp.gate_proj.weight.shape == (8, 32, 64)


def check_greedy(checkpoint, reference, ps, steps):
    want = [greedy(reference, p, steps) for p in ps]
    assert all(len(set(w)) > 3 for w in want)  # not a degenerate checkpoint
    loaded = load_model(str(checkpoint), "float32")
    got, logits = run_packed_greedy(loaded, ps, steps, chunk=5)
    assert got == want
    for p, rows in zip(ps, logits):
        np.testing.assert_allclose(np.stack(rows), reference_logits(reference, p, steps),
                                   atol=2e-4, rtol=1e-4)


def test_greedy_tokens_and_logits_match_mlx_lm(checkpoint, reference):
    check_greedy(checkpoint, reference, prompts(1, 3), STEPS)


@pytest.mark.slow
def test_emulated_metal_kernels_match_mlx_lm(tmp_path):
    """fused_moe, the gated delta layers, mrope and attention on their Metal kernels in the
    emulator; head_dim 64, a size the Metal attention kernels take."""
    from vllm_metal import ops

    config = dict(MOE_CONFIG, head_dim=64, rope_parameters=dict(
        MOE_CONFIG["rope_parameters"], mrope_section=[4, 2, 2]))
    path = write_checkpoint(tmp_path, seed=4, config=config)
    previous = ops.kernel_backend()
    ops.set_kernel_backend("emulated")
    try:
        check_greedy(path, reference_model(path), prompts(5, 2), 6)
    finally:
        ops.set_kernel_backend(previous)


def test_prompt_logits_match_mlx_lm(checkpoint, reference):
    """Every prompt position's logits, two prompts packed into one step."""
    from vllm_metal.models.generate import KVPool, SeqChunk, build_step
    from vllm_metal.models.qwen3_5_paged import HybridContext

    loaded = load_model(str(checkpoint), "float32")
    ps = prompts(2, 2)
    pool = KVPool(loaded.spec, 16, 4)
    tables = [[], []]
    for t, p in zip(tables, ps):
        pool.allocate(t, len(p))
    packed = build_step([SeqChunk(p, 0, t, "all") for p, t in zip(ps, tables)], pool.kv_caches, 4)
    c = packed.ctx
    ctx = HybridContext(**{f.name: getattr(c, f.name) for f in fields(c)},
                        cu_seqlens_state=c.cu_seqlens_q, state_slots=mx.array([2, 0], mx.int32),
                        has_initial_state=mx.array([0, 0], mx.int32),
                        state_pools=loaded.model.make_state_pools(3, mx.float32))
    got = np.array(loaded.model(packed.input_ids, ctx))
    want = np.concatenate([np.array(reference(mx.array([p]))[0]) for p in ps])
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", ["vision_language", "per_expert"])
def test_other_layouts_load_the_same_model(tmp_path, checkpoint, reference, layout):
    kw = dict(vision_language=True) if layout == "vision_language" else dict(expert_layout="per_expert")
    other = write_checkpoint(tmp_path, seed=0, config=MOE_CONFIG, **kw)
    p = prompts(3, 1)[0]
    got, _ = run_packed_greedy(load_model(str(other), "float32"), [p], 6)
    assert got[0] == greedy(reference, p, 6)


def test_missing_expert_is_refused_naming_the_tensor(tmp_path):
    path = write_checkpoint(tmp_path, seed=0, config=MOE_CONFIG, expert_layout="per_expert")
    weights = mx.load(str(path / "model.safetensors"))
    del weights["model.layers.1.mlp.experts.5.up_proj.weight"]
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.\*\.up_proj\.weight"):
        load_model(str(path), "float32")


# ---- the same weights as a llama.cpp "qwen35moe" GGUF ---------------------------------

@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    from qwen3_5_checkpoint import random_model, write_gguf

    d = tmp_path_factory.mktemp("qwen35moe")
    model = random_model(seed=0, config=MOE_CONFIG)  # the checkpoint fixture's weights
    return dict(f32=write_gguf(model, d / "f32.gguf", config=MOE_CONFIG),
                q8=write_gguf(model, d / "q8.gguf", config=MOE_CONFIG, qtype="Q8_0"))


def test_gguf_config_is_the_checkpoints(ggufs):
    from vllm_metal.models import gguf_loader

    cfg = gguf_loader.hf_config(gguf_loader.GGUFCheckpoint(str(ggufs["f32"])))
    assert cfg["architectures"] == ["Qwen3_5MoeForCausalLM"]
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "norm_topk_prob", "hidden_size",
                "num_hidden_layers", "layer_types", "head_dim", "vocab_size"):
        assert cfg[key] == MOE_CONFIG[key], key


def test_f32_gguf_gives_mlx_lm_tokens(ggufs, reference):
    ps = prompts(6, 3)
    got, _ = run_packed_greedy(load_model(str(ggufs["f32"]), "float32"), ps, 8)
    assert got == [greedy(reference, p, 8) for p in ps]


def test_q8_0_experts_in_block_form_equal_dequantized(ggufs):
    from vllm_metal.models.moe import GGUFSwitchGLU

    blocks = load_model(str(ggufs["q8"]), "float32")
    dense = load_model(str(ggufs["q8"]), "float32", linear="mlx")  # experts dequantized at load
    assert all(isinstance(layer.mlp.switch_mlp, GGUFSwitchGLU) for layer in blocks.model.layers)
    assert not isinstance(dense.model.layers[0].mlp.switch_mlp, GGUFSwitchGLU)
    ps = prompts(7, 2)
    got, a = run_packed_greedy(blocks, ps, 4)
    want, b = run_packed_greedy(dense, ps, 4)
    assert got == want
    for x, y in zip(a, b):  # float32 activations (the default): the same sums, reordered
        np.testing.assert_allclose(np.stack(x), np.stack(y), rtol=0, atol=2e-4 * np.abs(y).max())
    # int8_activations reaches the experts too (8-bit rounded activations: not equal)
    rounded = load_model(str(ggufs["q8"]), "float32", int8_activations=True)
    assert not rounded.model.layers[0].mlp.switch_mlp.exact
    _, c = run_packed_greedy(rounded, ps[:1], 1)
    assert np.abs(np.stack(c[0]) - np.stack(b[0])[:1]).max() > 1e-4
