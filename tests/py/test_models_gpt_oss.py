"""gpt-oss (gpt_oss) from safetensors with dense experts, its MoE MLPs on ops.fused_moe
(top-k softmax router with bias, expert biases, clamped SwiGLU): greedy token-exact parity
with transformers (float32, CPU) on a tiny random checkpoint (2 layers: sliding window 6 then
full attention, attention sinks, q/k/v/o biases, YaRN rope, 8 experts, top-2, hidden 64);
MXFP4 experts (the published safetensors layout) repacked into GGUF MXFP4 blocks on
ops.fused_moe_gguf, against transformers on the same experts dequantized."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_models_qwen3_moe import assert_prompt_logits_match, hf_greedy  # noqa: E402
from test_models_transformers import NEW_TOKENS, SIZES, _random_hf_model  # noqa: E402
from vllm_metal.models import load_model  # noqa: E402
from vllm_metal.models.generate import greedy_generate  # noqa: E402
from vllm_metal.models.moe import GptOssMoeBlock  # noqa: E402

_ROPE = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
         "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0}


def gpt_oss_config(**overrides):
    kw = dict(SIZES, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
              sliding_window=6, layer_types=["sliding_attention", "full_attention"],
              rope_parameters=dict(_ROPE), tie_word_embeddings=False)
    return transformers.GptOssConfig(**{**kw, **overrides})


def write_checkpoint(path, seed=0, **overrides):
    config = gpt_oss_config(**overrides)
    hf = _random_hf_model(config, seed=seed)
    with torch.no_grad():  # sinks of either sign, sizeable (the init gives ~N(0, 1) anyway)
        for layer in hf.model.layers:
            layer.self_attn.sinks.copy_(torch.randn_like(layer.self_attn.sinks))
            # larger expert weights: gate/up values cross the clamp at 7
            layer.mlp.experts.gate_up_proj.mul_(6.0)
    hf.save_pretrained(path, safe_serialization=True)
    return config, hf


@pytest.mark.parametrize("overrides", [{}, {"num_experts_per_tok": 3}], ids=["top2", "top3"])
def test_greedy_tokens_match_transformers(tmp_path, overrides):
    config, hf = write_checkpoint(tmp_path, **overrides)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (5, 11, 2)]
    want = hf_greedy(hf, prompts, NEW_TOKENS)

    loaded = load_model(str(tmp_path), "float32")
    assert all(type(layer.mlp) is GptOssMoeBlock for layer in loaded.model.layers)
    assert [layer.self_attn.sliding_window for layer in loaded.model.layers] == [6, 0]
    assert all("sinks" in layer.self_attn for layer in loaded.model.layers)
    got = greedy_generate(loaded, prompts, NEW_TOKENS, block_size=4, prefill_chunk=4, stop_ids=[])
    assert all(len(set(w)) > 4 for w in want)  # not a degenerate repeat
    assert got == want


def test_prompt_logits_match_transformers(tmp_path):
    config, hf = write_checkpoint(tmp_path, seed=3)
    assert_prompt_logits_match(tmp_path, hf, config.vocab_size)


def write_mxfp4_checkpoint(path, seed=0, **overrides):
    """A gpt-oss checkpoint with MXFP4 experts as published (uint8 *_blocks [E, rows, G, 16],
    *_scales [E, rows, G]; random codes, exponents 2^-6..2^-3); the transformers model
    returned holds the same experts dequantized by transformers' own MXFP4 code."""
    import json

    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config, hf = write_checkpoint(path, seed=seed, **overrides)
    st = load_file(str(path / "model.safetensors"))
    rng = np.random.default_rng(seed + 100)
    e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
    for layer in range(config.num_hidden_layers):
        pre = f"model.layers.{layer}.mlp.experts."
        experts = hf.model.layers[layer].mlp.experts
        for name, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            blocks = rng.integers(0, 256, (e, rows, cols // 32, 16), dtype=np.uint8)
            scales = rng.integers(121, 125, (e, rows, cols // 32), dtype=np.uint8)
            del st[pre + name]
            st[pre + name + "_blocks"] = blocks
            st[pre + name + "_scales"] = scales
            dense = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                               dtype=torch.float32)
            with torch.no_grad():
                getattr(experts, name).copy_(dense)  # [E, cols, rows]: x @ W
    save_file(st, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg))
    return config, hf


def test_mxfp4_experts_greedy_tokens_match_transformers(tmp_path):
    """MXFP4 experts repacked into GGUF MXFP4 blocks, on ops.fused_moe_gguf: transformers'
    tokens on the same experts dequantized."""
    from vllm_metal.models.moe import GGUFSwitchGLU

    config, hf = write_mxfp4_checkpoint(tmp_path, seed=6)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (5, 11, 2)]
    want = hf_greedy(hf, prompts, 24)
    loaded = load_model(str(tmp_path), "float32")
    assert all(isinstance(layer.mlp.experts, GGUFSwitchGLU) for layer in loaded.model.layers)
    assert all(layer.mlp.experts.gate_proj.type_id == 39 for layer in loaded.model.layers)
    got = greedy_generate(loaded, prompts, 24, block_size=4, prefill_chunk=4, stop_ids=[])
    assert all(len(set(w)) > 4 for w in want)
    assert got == want


def test_mxfp4_blocks_without_scales_refused_naming_the_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    write_mxfp4_checkpoint(tmp_path)
    st = load_file(str(tmp_path / "model.safetensors"))
    del st["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(st, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.experts.down_proj"):
        load_model(str(tmp_path), "float32")


def test_other_activation_constants_refused(tmp_path):
    write_checkpoint(tmp_path, swiglu_limit=5.0)
    with pytest.raises(ValueError, match="swiglu_limit"):
        load_model(str(tmp_path), "float32")


@pytest.mark.slow
def test_emulated_metal_kernels_match_transformers(tmp_path):
    """Every op (attention with sinks and window, norms, YaRN rope, fused_moe with the gpt-oss
    options) on its Metal kernel in the emulator; head_dim 64, a size the Metal attention
    kernels take."""
    from vllm_metal import ops

    config, hf = write_checkpoint(tmp_path, seed=4, num_attention_heads=2, num_key_value_heads=1,
                                  head_dim=64)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (6, 3)]
    want = hf_greedy(hf, prompts, 8)
    previous = ops.kernel_backend()
    ops.set_kernel_backend("emulated")
    try:
        loaded = load_model(str(tmp_path), "float32")
        got = greedy_generate(loaded, prompts, 8, block_size=4, prefill_chunk=4, stop_ids=[])
    finally:
        ops.set_kernel_backend(previous)
    assert got == want
