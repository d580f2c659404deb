"""Decode tok/s of a whole synthetic MoE model (Qwen3-MoE layout, random weights), CPU.

Realistic per-layer shape by default: hidden 1024, 64 experts, top-8, expert width 512,
16 heads of 64 (4 KV heads), a few layers. Written once to a temp directory as a bfloat16
safetensors checkpoint (mlx-lm's stacked switch_mlp names) and as a qwen3moe GGUF with
Q4_0 and with MXFP4 experts (the rest F32), then decoded with load_model + greedy_generate: the served
model's forward without the HTTP server. Decode steps only (no prefill tokens in the step):
median tokens/s per step at each batch size. Prints one JSON line per case.

    .venv/bin/python benchmarks/moe_decode.py [--layers 4 --batch 1 4 --tokens 24]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "py"))


def config(a) -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "hidden_size": a.hidden, "intermediate_size": 4 * a.hidden,
            "moe_intermediate_size": a.inter, "num_hidden_layers": a.layers,
            "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
            "num_experts": a.experts, "num_experts_per_tok": a.top_k, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": a.vocab,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
            "tie_word_embeddings": False, "hidden_act": "silu", "dtype": "bfloat16",
            "bos_token_id": 1, "eos_token_id": 2}


def weights(cfg: dict, rng) -> dict[str, np.ndarray]:
    h, i, e = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    q, kv = 16 * 64, 4 * 64
    w = {"model.embed_tokens.weight": rng.standard_normal((cfg["vocab_size"], h)),
         "lm_head.weight": rng.standard_normal((cfg["vocab_size"], h)) / np.sqrt(h),
         "model.norm.weight": np.ones(h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        w.update({p + "input_layernorm.weight": np.ones(h), p + "post_attention_layernorm.weight": np.ones(h),
                  p + "self_attn.q_proj.weight": rng.standard_normal((q, h)) / np.sqrt(h),
                  p + "self_attn.k_proj.weight": rng.standard_normal((kv, h)) / np.sqrt(h),
                  p + "self_attn.v_proj.weight": rng.standard_normal((kv, h)) / np.sqrt(h),
                  p + "self_attn.o_proj.weight": rng.standard_normal((h, q)) / np.sqrt(q),
                  p + "self_attn.q_norm.weight": np.ones(64), p + "self_attn.k_norm.weight": np.ones(64),
                  p + "mlp.gate.weight": rng.standard_normal((e, h)) / np.sqrt(h),
                  p + "mlp.switch_mlp.gate_proj.weight": rng.standard_normal((e, i, h)) / np.sqrt(h),
                  p + "mlp.switch_mlp.up_proj.weight": rng.standard_normal((e, i, h)) / np.sqrt(h),
                  p + "mlp.switch_mlp.down_proj.weight": rng.standard_normal((e, h, i)) / np.sqrt(i)})
    return {k: v.astype(np.float32) for k, v in w.items()}


def write_safetensors(cfg, w, out: Path) -> Path:
    import mlx.core as mx

    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(out / "model.safetensors"),
                        {k: mx.array(v).astype(mx.bfloat16) for k, v in w.items()})
    return out


def write_gguf(cfg, w, path: Path, expert_type: str) -> Path:
    import gguf
    from test_gguf_fixtures import random_blocks  # valid blocks with sane scales

    from vllm_metal.models.testing import add_byte_level_tokenizer

    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}
    experts = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
    g = gguf.GGUFWriter(str(path), "qwen3moe")
    g.add_block_count(cfg["num_hidden_layers"])
    g.add_context_length(cfg["max_position_embeddings"])
    g.add_embedding_length(cfg["hidden_size"])
    g.add_head_count(16)
    g.add_head_count_kv(4)
    g.add_key_length(64)
    g.add_value_length(64)
    g.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    g.add_rope_freq_base(cfg["rope_theta"])
    g.add_vocab_size(cfg["vocab_size"])
    g.add_expert_count(cfg["num_experts"])
    g.add_expert_used_count(cfg["num_experts_per_tok"])
    g.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    add_byte_level_tokenizer(g, cfg)
    g.add_tensor("token_embd.weight", w["model.embed_tokens.weight"])
    g.add_tensor("output_norm.weight", w["model.norm.weight"])
    g.add_tensor("output.weight", w["lm_head.weight"])
    qt = gguf.GGMLQuantizationType[expert_type]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        for hf, name in names.items():
            g.add_tensor(f"blk.{n}.{name}.weight", w[p + hf + ".weight"])
        for hf, name in experts.items():
            e, rows, cols = w[p + "mlp.switch_mlp." + hf + ".weight"].shape
            blocks = random_blocks(qt, e * rows, cols, seed=n * 3 + len(hf))
            g.add_tensor(f"blk.{n}.{name}.weight", blocks.reshape(e, rows, -1), raw_dtype=qt)
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    return path


def decode_rate(loaded, batch: int, tokens: int, rng) -> float:
    from vllm_metal.models.generate import greedy_generate

    prompts = [rng.integers(3, 300, 8).tolist() for _ in range(batch)]
    greedy_generate(loaded, prompts, 2, stop_ids=[])  # warm-up
    steps: list = []
    greedy_generate(loaded, prompts, tokens, stop_ids=[], step_times=steps)
    rates = [rows / s for rows, prefill, s in steps if prefill == 0 and rows == batch]
    return statistics.median(rates)


def prefill_rate(loaded, tokens: int, rng) -> float:
    """Tokens/s of one `tokens`-token prompt prefilled in one step."""
    from vllm_metal.models.generate import greedy_generate

    prompt = [rng.integers(3, 300, tokens).tolist()]
    steps: list = []
    greedy_generate(loaded, prompt, 1, prefill_chunk=tokens, stop_ids=[], step_times=steps)
    (seconds,) = [s for rows, prefill, s in steps if prefill == tokens]
    return tokens / seconds


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """The synthetic model's shape and the decode batch sizes (config() reads them)."""
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=320)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])


def main() -> None:
    ap = argparse.ArgumentParser()
    add_shape_args(ap)
    ap.add_argument("--tokens", type=int, default=24)
    a = ap.parse_args()
    from vllm_metal.models import load_model

    cfg = config(a)
    rng = np.random.default_rng(0)
    w = weights(cfg, rng)
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"bfloat16 safetensors": (write_safetensors(cfg, w, Path(tmp) / "st"), "bfloat16"),
                   "Q4_0-experts GGUF": (write_gguf(cfg, w, Path(tmp) / "q4.gguf", "Q4_0"), "float32"),
                   "MXFP4-experts GGUF": (write_gguf(cfg, w, Path(tmp) / "mx.gguf", "MXFP4"), "float32")}
        for name, (path, dtype) in sources.items():
            loaded = load_model(str(path), dtype)
            for b in a.batch:
                rate = decode_rate(loaded, b, a.tokens, rng)
                print(json.dumps({"model": name, "layers": a.layers, "experts": a.experts,
                                  "top_k": a.top_k, "hidden": a.hidden, "inter": a.inter,
                                  "batch": b, "decode_tok_s": round(rate, 1)}), flush=True)
            del loaded


if __name__ == "__main__":
    main()
