"""A random-weight Qwen3-MoE safetensors checkpoint of any shape, written with NumPy
only (HF names: one tensor per expert, mlp.experts.{e}.{gate,up,down}_proj.weight),
for the expert-streaming tests and benchmark: shapes where the experts are the bulk
of the weights, as in real MoE models."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_qwen3_moe(path: Path, *, hidden: int = 256, inter: int = 512, experts: int = 16,
                    top_k: int = 2, layers: int = 4, vocab: int = 320, heads: int = 4,
                    kv_heads: int = 2, head_dim: int = 64, dtype: str = "float32",
                    seed: int = 0, router_skew: float = 0.0) -> dict:
    """Writes config.json + model.safetensors; returns {"expert_bytes", "other_bytes"}.
    router_skew > 0: router row e scaled by 1 + skew * (1 - e / E), so low-numbered experts
    win more often (real routers are skewed; random ones pick about uniformly)."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    np_dtype = {"float32": np.float32, "float16": np.float16}[dtype]

    def w(*shape, scale=None):
        scale = scale if scale is not None else shape[-1] ** -0.5
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np_dtype)

    t = {"model.embed_tokens.weight": w(vocab, hidden, scale=1.0),
         "model.norm.weight": np.ones(hidden, np_dtype), "lm_head.weight": w(vocab, hidden)}
    expert_bytes = 0
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = np.ones(hidden, np_dtype)
        t[p + "post_attention_layernorm.weight"] = np.ones(hidden, np_dtype)
        t[p + "self_attn.q_proj.weight"] = w(heads * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = w(kv_heads * head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = w(kv_heads * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = w(hidden, heads * head_dim)
        t[p + "self_attn.q_norm.weight"] = np.ones(head_dim, np_dtype)
        t[p + "self_attn.k_norm.weight"] = np.ones(head_dim, np_dtype)
        scale = 1 + router_skew * (1 - np.arange(experts) / experts)
        t[p + "mlp.gate.weight"] = (w(experts, hidden, scale=1.0) * scale[:, None]).astype(np_dtype)
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            t[q + "gate_proj.weight"] = w(inter, hidden)
            t[q + "up_proj.weight"] = w(inter, hidden)
            t[q + "down_proj.weight"] = w(hidden, inter)
            expert_bytes += 3 * inter * hidden * np.dtype(np_dtype).itemsize
    save_file(t, str(path / "model.safetensors"))
    config = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                  hidden_size=hidden, intermediate_size=inter * 2, moe_intermediate_size=inter,
                  num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                  decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  rms_norm_eps=1e-6, vocab_size=vocab, max_position_embeddings=4096,
                  rope_theta=1e6, tie_word_embeddings=False, torch_dtype=dtype,
                  bos_token_id=1, eos_token_id=2)
    (path / "config.json").write_text(json.dumps(config))
    total = sum(a.nbytes for a in t.values())
    return {"expert_bytes": expert_bytes, "other_bytes": total - expert_bytes}
