"""OLMoE (olmoe) from safetensors and from a llama.cpp-layout GGUF file (arch olmoe), its
sparse MLPs on ops.fused_moe / ops.fused_moe_gguf: greedy token-exact parity with
transformers (float32, CPU) on a tiny random checkpoint (2 layers, 8 experts, top-2, hidden
64), with and without norm_topk_prob; q/k RMSNorm over the whole projection; Q8_0 experts in
block form close to the same file dequantized at load."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from safetensors.numpy import load_file  # noqa: E402

from test_models_qwen3_moe import assert_prompt_logits_match, hf_greedy  # noqa: E402
from test_models_transformers import NEW_TOKENS, SIZES, _random_hf_model  # noqa: E402
from vllm_metal.models import load_model  # noqa: E402
from vllm_metal.models.generate import greedy_generate  # noqa: E402
from vllm_metal.models.moe import FusedMoeBlock, GGUFSwitchGLU  # noqa: E402
from vllm_metal.models.testing import add_byte_level_tokenizer, run_packed  # noqa: E402

VOCAB = 320  # room for the byte-level test tokenizer
_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}
_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def olmoe_config(**overrides):
    kw = dict(SIZES, intermediate_size=32, num_experts=8, num_experts_per_tok=2,
              norm_topk_prob=False, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return transformers.OlmoeConfig(**{**kw, **overrides})


def write_checkpoint(path, seed=0, **overrides):
    config = olmoe_config(**overrides)
    hf = _random_hf_model(config, seed=seed)
    hf.save_pretrained(path, safe_serialization=True)
    return config, hf


def expert_stack(st: dict, prefix: str, proj: str, n: int) -> np.ndarray:
    """[E, rows, cols] of one expert projection, from either layout transformers writes."""
    if f"{prefix}mlp.experts.0.{proj}.weight" in st:
        return np.stack([st[f"{prefix}mlp.experts.{e}.{proj}.weight"] for e in range(n)])
    if proj == "down_proj":
        return st[f"{prefix}mlp.experts.down_proj"]
    gate_up = st[f"{prefix}mlp.experts.gate_up_proj"]  # [E, 2I, H]: gate rows, then up rows
    half = gate_up.shape[1] // 2
    return gate_up[:, :half] if proj == "gate_proj" else gate_up[:, half:]


def write_gguf(checkpoint_dir, config, path, expert_type: str, extra: dict | None = None):
    """The checkpoint as llama.cpp's converter lays out an olmoe file (Q/K not permuted,
    experts stacked [E, rows, cols] in `expert_type`, the rest F32)."""
    st = load_file(str(checkpoint_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "olmoe")
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_vocab_size(config.vocab_size)
    w.add_expert_count(config.num_experts)
    w.add_expert_used_count(config.num_experts_per_tok)
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
            stacked = np.ascontiguousarray(expert_stack(st, pre, hf, config.num_experts))
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


@pytest.mark.parametrize("overrides", [{}, {"norm_topk_prob": True, "num_experts_per_tok": 3}],
                         ids=["no-renorm", "renorm-top3"])
def test_greedy_tokens_match_transformers(tmp_path, overrides):
    config, hf = write_checkpoint(tmp_path, **overrides)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (5, 11, 2)]
    want = hf_greedy(hf, prompts, NEW_TOKENS)

    loaded = load_model(str(tmp_path), "float32")
    assert all(type(layer.mlp) is FusedMoeBlock for layer in loaded.model.layers)
    assert all(layer.self_attn.qk_norm_whole for layer in loaded.model.layers)
    got = greedy_generate(loaded, prompts, NEW_TOKENS, block_size=4, prefill_chunk=4, stop_ids=[])
    assert all(len(set(w)) > 4 for w in want)  # not a degenerate repeat
    assert got == want


def test_prompt_logits_match_transformers(tmp_path):
    config, hf = write_checkpoint(tmp_path, seed=3)
    assert_prompt_logits_match(tmp_path, hf, config.vocab_size)


def test_gguf_f32_experts_greedy_tokens_match_transformers(tmp_path):
    config, hf = write_checkpoint(tmp_path / "hf", vocab_size=VOCAB)
    path = write_gguf(tmp_path / "hf", config, tmp_path / "tiny-olmoe.gguf", "F32")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 11, 2)]
    want = hf_greedy(hf, prompts, 24)

    loaded = load_model(str(path), "float32")
    assert loaded.hf_config["model_type"] == "olmoe"
    assert loaded.hf_config["norm_topk_prob"] is False
    assert all(isinstance(layer.mlp.switch_mlp, GGUFSwitchGLU) for layer in loaded.model.layers)
    got = greedy_generate(loaded, prompts, 24, block_size=4, prefill_chunk=4, stop_ids=[])
    assert all(len(set(x)) > 4 for x in want)
    assert got == want


def test_gguf_q8_0_experts_in_block_form_match_dequantized(tmp_path):
    config, _ = write_checkpoint(tmp_path / "hf", vocab_size=VOCAB, seed=2)
    path = write_gguf(tmp_path / "hf", config, tmp_path / "tiny-q8.gguf", "Q8_0")
    tokens = np.random.default_rng(3).integers(3, VOCAB, 13).tolist()
    blocks = load_model(str(path), "float32")
    dense = load_model(str(path), "float32", linear="mlx")  # experts dequantized at load
    assert not any(isinstance(layer.mlp.switch_mlp, GGUFSwitchGLU) for layer in dense.model.layers)
    got = run_packed(blocks, [tokens], schedules=[[8, 5]])[0]
    want = run_packed(dense, [tokens], schedules=[[8, 5]])[0]
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-4, err
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_gguf_unknown_tensor_is_refused_naming_it(tmp_path):
    config, _ = write_checkpoint(tmp_path / "hf", vocab_size=VOCAB)
    shexp = np.zeros((config.intermediate_size, config.hidden_size), np.float32)
    path = write_gguf(tmp_path / "hf", config, tmp_path / "bad.gguf", "F32",
                      extra={"blk.0.ffn_gate_shexp.weight": shexp})
    with pytest.raises(ValueError, match="blk.0.ffn_gate_shexp.weight"):
        load_model(str(path), "float32")


@pytest.mark.slow
def test_emulated_metal_kernels_match_transformers(tmp_path):
    """Every op (attention, norms, rope, fused_moe) on its Metal kernel in the emulator;
    head_dim 64, a size the Metal attention kernels take (transformers sizes the q norm by
    hidden_size: heads * head_dim = hidden)."""
    from vllm_metal import ops

    config, hf = write_checkpoint(tmp_path, seed=4, hidden_size=128, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=64)
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
