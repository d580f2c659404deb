"""gpt-oss from a llama.cpp-layout GGUF file (arch gpt-oss: attn_sinks, post_attention_norm,
q/k/v/o biases, ffn_gate_inp router with bias, ffn_{gate,up,down}_exps experts [E, rows, cols]
with biases), written here with the gguf package from a tiny transformers checkpoint: MXFP4
experts (ggml type 39, the gguf package's quantizer) kept in block form on
ops.fused_moe_gguf give transformers' greedy tokens on the same experts dequantized by the
gguf package; F32 experts give them on the checkpoint itself."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from safetensors.numpy import load_file  # noqa: E402

from test_models_gpt_oss import write_checkpoint  # noqa: E402
from test_models_qwen3_moe import hf_greedy  # noqa: E402
from vllm_metal.models import load_model  # noqa: E402
from vllm_metal.models.generate import greedy_generate  # noqa: E402
from vllm_metal.models.moe import GGUFSwitchGLU, GptOssMoeBlock  # noqa: E402
from vllm_metal.models.testing import add_byte_level_tokenizer  # noqa: E402

VOCAB = 320
_NAMES = {"input_layernorm.weight": "attn_norm.weight",
          "post_attention_layernorm.weight": "post_attention_norm.weight",
          "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
          "mlp.router.bias": "ffn_gate_inp.bias"}
for _p, _g in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
    for _s in ("weight", "bias"):
        _NAMES[f"self_attn.{_p}_proj.{_s}"] = f"{_g}.{_s}"


def write_gguf(checkpoint_dir, config, path, expert_type: str):
    """The checkpoint as llama.cpp's converter lays out a gpt-oss file; returns the experts
    as the file holds them, dequantized: {(layer, proj): float32 [E, rows, cols]}."""
    st = load_file(str(checkpoint_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    rp = config.rope_parameters
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rp["factor"])
    w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
    w.add_sliding_window(config.sliding_window)
    w.add_vocab_size(config.vocab_size)
    w.add_expert_count(config.num_local_experts)
    w.add_expert_used_count(config.num_experts_per_tok)
    w.add_expert_feed_forward_length(config.intermediate_size)
    add_byte_level_tokenizer(w, {"vocab_size": config.vocab_size, "bos_token_id": 1,
                                 "eos_token_id": 2})
    w.add_tensor("token_embd.weight", st["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", st["model.norm.weight"])
    w.add_tensor("output.weight", st["lm_head.weight"])
    qt = gguf.GGMLQuantizationType[expert_type]
    stored = {}
    for layer in range(config.num_hidden_layers):
        pre = f"model.layers.{layer}."
        for hf, g in _NAMES.items():
            w.add_tensor(f"blk.{layer}.{g}", st[pre + hf])
        gate_up = st[pre + "mlp.experts.gate_up_proj"].transpose(0, 2, 1)  # [E, 2I, H]
        gub = st[pre + "mlp.experts.gate_up_proj_bias"]
        experts = {"gate": (gate_up[:, 0::2], gub[:, 0::2]), "up": (gate_up[:, 1::2], gub[:, 1::2]),
                   "down": (st[pre + "mlp.experts.down_proj"].transpose(0, 2, 1),
                            st[pre + "mlp.experts.down_proj_bias"])}
        for proj, (weight, bias) in experts.items():
            weight = np.ascontiguousarray(weight, dtype=np.float32)
            name = f"blk.{layer}.ffn_{proj}_exps"
            if expert_type == "F32":
                w.add_tensor(name + ".weight", weight)
                stored[layer, proj] = weight
            else:
                q = gguf.quants.quantize(weight, qt)
                w.add_tensor(name + ".weight", q, raw_dtype=qt)
                stored[layer, proj] = gguf.quants.dequantize(q, qt).reshape(weight.shape)
            w.add_tensor(name + ".bias", np.ascontiguousarray(bias, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def set_experts(hf, stored):
    """The transformers model's experts set to what the file holds."""
    with torch.no_grad():
        for (layer, proj), weight in stored.items():
            experts = hf.model.layers[layer].mlp.experts
            t = torch.from_numpy(np.ascontiguousarray(weight.transpose(0, 2, 1)))  # [E, cols, rows]
            if proj == "down":
                experts.down_proj.copy_(t)
            else:
                experts.gate_up_proj[:, :, (0 if proj == "gate" else 1)::2].copy_(t)


@pytest.mark.parametrize("expert_type", ["F32", "MXFP4"])
def test_greedy_tokens_match_transformers(tmp_path, expert_type):
    config, hf = write_checkpoint(tmp_path / "hf", vocab_size=VOCAB, seed=7)
    stored = write_gguf(tmp_path / "hf", config, tmp_path / "tiny-gpt-oss.gguf", expert_type)
    set_experts(hf, stored)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 11, 2)]
    want = hf_greedy(hf, prompts, 24)

    loaded = load_model(str(tmp_path / "tiny-gpt-oss.gguf"), "float32")
    assert loaded.hf_config["model_type"] == "gpt_oss"
    assert [layer.self_attn.sliding_window for layer in loaded.model.layers] == [6, 0]
    assert all(isinstance(layer.mlp, GptOssMoeBlock) for layer in loaded.model.layers)
    assert all(isinstance(layer.mlp.experts, GGUFSwitchGLU) for layer in loaded.model.layers)
    got = greedy_generate(loaded, prompts, 24, block_size=4, prefill_chunk=4, stop_ids=[])
    assert all(len(set(x)) > 4 for x in want)
    assert got == want
