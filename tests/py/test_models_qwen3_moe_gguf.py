"""Qwen3-MoE from a llama.cpp-layout GGUF file (arch qwen3moe: ffn_gate_inp router,
ffn_gate_exps / ffn_up_exps / ffn_down_exps stacked [E, rows, cols] experts), written
here with the gguf package from a tiny transformers checkpoint: F32 experts give
transformers' greedy tokens exactly; Q8_0 experts, kept in block form on
ops.fused_moe_gguf, give logits close to the same file dequantized at load."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from safetensors.numpy import load_file  # noqa: E402

from test_models_qwen3_moe import hf_greedy, write_checkpoint  # noqa: E402
from vllm_metal.models import load_model  # noqa: E402
from vllm_metal.models.generate import greedy_generate  # noqa: E402
from vllm_metal.models.moe import FusedMoeBlock, GGUFSwitchGLU  # noqa: E402
from vllm_metal.models.testing import add_byte_level_tokenizer, run_packed  # noqa: E402

VOCAB = 320
_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}
_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def write_gguf(checkpoint_dir, config, path, expert_type: str, extra: dict | None = None):
    """The checkpoint's weights as llama.cpp's converter lays out a qwen3moe file; experts
    in `expert_type`, everything else F32; `extra`: more tensors {name: float32 array}."""
    st = load_file(str(checkpoint_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_vocab_size(config.vocab_size)
    w.add_expert_count(config.num_experts)
    w.add_expert_used_count(config.num_experts_per_tok)
    w.add_expert_feed_forward_length(config.moe_intermediate_size)
    add_byte_level_tokenizer(w, {"vocab_size": config.vocab_size, "bos_token_id": 1,
                                 "eos_token_id": 2})
    w.add_tensor("token_embd.weight", st["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", st["model.norm.weight"])
    w.add_tensor("output.weight", st["lm_head.weight"])
    qt = gguf.GGMLQuantizationType[expert_type]
    for layer in range(config.num_hidden_layers):
        pre = f"model.layers.{layer}."
        for hf, g in _NAMES.items():
            w.add_tensor(f"blk.{layer}.{g}.weight", st[pre + hf + ".weight"])
        for hf, g in _EXPERTS.items():
            stacked = np.stack([st[f"{pre}mlp.experts.{e}.{hf}.weight"]
                                for e in range(config.num_experts)])  # [E, rows, cols]
            if expert_type == "F32":
                w.add_tensor(f"blk.{layer}.{g}.weight", stacked)
            else:
                w.add_tensor(f"blk.{layer}.{g}.weight", gguf.quants.quantize(stacked, qt), raw_dtype=qt)
    for name, value in (extra or {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_f32_experts_greedy_tokens_match_transformers(tmp_path):
    config, hf = write_checkpoint(tmp_path / "hf", vocab_size=VOCAB)
    path = write_gguf(tmp_path / "hf", config, tmp_path / "tiny-qwen3moe.gguf", "F32")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 11, 2)]
    want = hf_greedy(hf, prompts, 24)

    loaded = load_model(str(path), "float32")
    assert loaded.hf_config["model_type"] == "qwen3_moe"
    assert all(isinstance(layer.mlp.switch_mlp, GGUFSwitchGLU) for layer in loaded.model.layers)
    got = greedy_generate(loaded, prompts, 24, block_size=4, prefill_chunk=4, stop_ids=[])
    assert all(len(set(x)) > 4 for x in want)
    assert got == want


def test_q8_0_experts_in_block_form_match_dequantized(tmp_path):
    config, _ = write_checkpoint(tmp_path / "hf", vocab_size=VOCAB, seed=2)
    path = write_gguf(tmp_path / "hf", config, tmp_path / "tiny-q8.gguf", "Q8_0")
    tokens = np.random.default_rng(3).integers(3, VOCAB, 13).tolist()
    blocks = load_model(str(path), "float32")
    dense = load_model(str(path), "float32", linear="mlx")  # experts dequantized at load
    assert all(isinstance(layer.mlp, FusedMoeBlock) for layer in dense.model.layers)
    assert not any(isinstance(layer.mlp.switch_mlp, GGUFSwitchGLU) for layer in dense.model.layers)
    got = run_packed(blocks, [tokens], schedules=[[8, 5]])[0]
    want = run_packed(dense, [tokens], schedules=[[8, 5]])[0]
    # float32 activations (load_model's default, GGUFLinear's too): the same sums, reordered
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-4, err
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_unknown_expert_tensor_is_refused_naming_it(tmp_path):
    """A shared expert (Qwen2-MoE style ffn_*_shexp) is not part of qwen3moe: refused at load."""
    config, _ = write_checkpoint(tmp_path / "hf", vocab_size=VOCAB)
    shexp = np.zeros((config.moe_intermediate_size, config.hidden_size), np.float32)
    path = write_gguf(tmp_path / "hf", config, tmp_path / "bad.gguf", "F32",
                      extra={"blk.1.ffn_gate_shexp.weight": shexp})
    with pytest.raises(ValueError, match="blk.1.ffn_gate_shexp.weight"):
        load_model(str(path), "float32")
