"""Qwen3.5 text GGUF files (llama.cpp architectures "qwen35" and, with MoE MLPs,
"qwen35moe"): config and weights.

llama.cpp's converter (conversion/qwen.py: Qwen3NextModel, _LinearAttentionVReorderBase,
Qwen3_5TextModel) writes, besides renaming:
- zero-centred RMSNorm weights (all but the gated norm of the linear layers) as 1 + w;
- A_log as ssm_a = -exp(A_log); dt_bias as ssm_dt.bias; conv1d squeezed to [C, K];
- when linear_num_value_heads > linear_num_key_heads, the value heads reordered from
  HF's grouped order (the r value heads of key head 0, then of key head 1, ...) to a
  tiled order (value head 0 of every key head, then value head 1, ...), in every tensor
  indexed by value head: the V rows of attn_qkv and the V channels of ssm_conv1d,
  attn_gate (z), ssm_alpha (a), ssm_beta (b), ssm_a, ssm_dt, and the columns of ssm_out;
- an MTP (multi-token prediction) block as extra layers blk.{n}.. with blk.*.nextn.*
  tensors, counted in block_count and announced by qwen35.nextn_predict_layers.
We undo all of it, giving mlx-lm's sanitized parameters (norms 1 + w, conv1d
[C, K, 1]) in HF head order; the MTP layers are left to mtp_weights (speculative
method "mtp": mtp.py).
qwen35moe adds per layer the router ffn_gate_inp, the stacked experts ffn_*_exps
([E, rows, cols], kept in block form for ops.fused_moe_gguf), the shared expert
ffn_*_shexp and its gate ffn_gate_inp_shexp (a vector [hidden]: HF's [1, hidden]).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from vllm_metal.models.stage_loading import outside_stage

ARCH = "qwen35"
MOE_ARCH = "qwen35moe"

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",  # q and its output gate, per head [q | gate] as in HF
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt": "linear_attn.dt_bias",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    # qwen35moe
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}

# tensors of linear layers and embeddings: may stay in block form (GGUFLinear)
_LINEAR = {"token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
           "ffn_up", "ffn_down", "attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta", "ssm_out",
           "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp",
           "ffn_up_shexp", "ffn_down_shexp"}


def hf_config(ckpt) -> dict:
    """The HF Qwen3.5 text config of a qwen35 / qwen35moe GGUF (MTP layers not counted)."""
    from vllm_metal.models.gguf_loader import _f32, native_dtype

    meta = ckpt.metadata
    arch = ckpt.architecture

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    nextn = int(get("nextn_predict_layers", 0) or 0)
    n_layers = int(get("block_count")) - nextn
    hidden = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length") or hidden // n_heads)
    interval = int(get("full_attention_interval", 4))
    num_v = int(get("ssm.time_step_rank"))
    rotary = int(get("rope.dimension_count", head_dim // 4))
    sections = list(get("rope.dimension_sections", [11, 11, 10, 0]))[:3]
    tokens = meta.get("tokenizer.ggml.tokens") or []
    cfg = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length") or 0),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": int(get("vocab_size") or len(tokens)
                          or ckpt.tensors["token_embd.weight"].shape[0]),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in ckpt.tensors,
        "full_attention_interval": interval,
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                        for i in range(n_layers)],
        "linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
        "linear_key_head_dim": int(get("ssm.state_size")),
        "linear_num_key_heads": int(get("ssm.group_count")),
        "linear_num_value_heads": num_v,
        "linear_value_head_dim": int(get("ssm.inner_size")) // num_v,
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default",
                            "rope_theta": _f32(get("rope.freq_base", 10_000_000.0)),
                            "partial_rotary_factor": rotary / head_dim,
                            "mrope_section": sections, "mrope_interleaved": True},
        "dtype": native_dtype(ckpt),
    }
    for key in ("bos", "eos", "padding"):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            cfg["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(value)
    if arch == MOE_ARCH:
        # llama.cpp's qwen35moe graph: softmax router, top-k weights renormalized
        cfg.update(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text",
                   num_experts=int(get("expert_count")),
                   num_experts_per_tok=int(get("expert_used_count")),
                   moe_intermediate_size=int(get("expert_feed_forward_length")),
                   shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length")),
                   norm_topk_prob=True, decoder_sparse_step=1)
    if nextn:
        cfg["mtp_num_hidden_layers"] = nextn  # vLLM's "mtp" method reads it
    check_rotary(cfg)
    return cfg


def _name(gguf_name: str, n_layers: int) -> str | None:
    """mlx-lm name of a tensor; None for the MTP layers' tensors."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) >= 3 and parts[1].isdigit():
        if int(parts[1]) >= n_layers or parts[2] == "nextn":
            return None  # MTP block
        # ssm_a has no suffix; ssm_dt's is .bias: both are plain parameters in mlx-lm
        if parts[2] in ("ssm_a", "ssm_dt") and len(parts) <= 4:
            return f"model.layers.{parts[1]}.{_BLOCK[parts[2]]}"
        if len(parts) == 4 and parts[2] in _BLOCK:
            return f"model.layers.{parts[1]}.{_BLOCK[parts[2]]}.{parts[3]}"
    raise ValueError(f"[vllm-metal] unexpected tensor {gguf_name!r} in a {ARCH} GGUF")


# the MTP layer's own tensors (blk.{n}.nextn.*) -> mtp.MtpBlock's parameters
_NEXTN = {"eh_proj": "fc", "enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden",
          "shared_head_norm": "norm"}


def mtp_weights(ckpt, config: dict) -> dict:
    """The MTP block (the layers after num_hidden_layers, dense float32) named as
    mtp.MtpBlock's parameters; its norms as stored (1 + w). Copies of the embedding
    and output head in the block (nextn.embed_tokens, nextn.shared_head_head) are left:
    the target's are used. {} when the file has no MTP block."""
    n = config["num_hidden_layers"]
    out = {}
    for name in ckpt.tensors:
        parts = name.split(".")
        if parts[0] != "blk" or len(parts) < 3 or not parts[1].isdigit() or int(parts[1]) < n:
            continue
        if int(parts[1]) > n:
            raise ValueError(f"[vllm-metal] {name}: MTP blocks of more than one layer are not "
                             "supported")
        if parts[2] == "nextn" and len(parts) == 5:
            if parts[3] not in _NEXTN:
                continue
            target = f"{_NEXTN[parts[3]]}.{parts[4]}"
        elif len(parts) == 4 and parts[2] in _BLOCK:
            target = f"layers.0.{_BLOCK[parts[2]]}.{parts[3]}"
        else:
            raise ValueError(f"[vllm-metal] unexpected tensor {name!r} in the MTP block of a "
                             f"{ckpt.architecture} GGUF")
        out[target] = ckpt.dense(name, mx.float32)
    return out


def tiled_to_grouped(num_k: int, num_v: int) -> np.ndarray:
    """Index map over value heads: grouped head i is tiled head perm[i]."""
    r = num_v // num_k
    g, j = np.divmod(np.arange(num_v), r)  # grouped head i = (key head g, j-th of its r)
    return j * num_k + g


def _rows(w, perm: np.ndarray, head_rows: int, offset: int = 0):
    """Reorder the value-head row blocks of w (dense or block-form rows) from `offset`."""
    idx = np.arange(w.shape[0])
    heads = (perm[:, None] * head_rows + np.arange(head_rows)[None]).reshape(-1) + offset
    idx[offset:offset + heads.size] = heads
    return mx.take(w, mx.array(idx), axis=0)


def load_weights(ckpt, config: dict, dtype: mx.Dtype, *, blocks: bool = False) -> dict:
    """Every non-MTP tensor under its mlx-lm (sanitized) name, HF layout and head order;
    matrices as GGUFWeight when `blocks` and they need no column reorder."""
    from vllm_metal.models.gguf_loader import GGUFWeight

    n_layers = config["num_hidden_layers"]
    num_k, num_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    perm = tiled_to_grouped(num_k, num_v) if num_v != num_k else None
    # zero-centred norms are stored as 1 + w, mlx-lm's sanitized form: kept as they are
    out = {}
    for name, t in ckpt.tensors.items():
        target = _name(name, n_layers)
        if target is None:
            continue
        kind = name.split(".")[2] if name.startswith("blk.") else name.split(".")[0]
        # another pipeline stage's layer: a lazy dense placeholder, never read from the file
        # and never evaluated (stage_loading.py); the stage drops the layer after the build
        outside = outside_stage(name)
        # ssm_out's value heads are its columns: reordered dense (they split blocks)
        as_blocks = (blocks and not outside and kind in _LINEAR
                     and not (perm is not None and kind == "ssm_out"))
        w = ckpt.blocks(name) if as_blocks else None
        if w is not None:
            if perm is not None and kind in ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta"):
                head_rows = 1 if kind in ("ssm_alpha", "ssm_beta") else dv
                offset = 2 * num_k * dk if kind == "attn_qkv" else 0
                w = GGUFWeight(mx.contiguous(_rows(w.blocks, perm, head_rows, offset)),
                               w.type_id, w.shape)
            out[target] = w
            continue
        w = mx.zeros(ckpt.tensors[name].shape, mx.float32) if outside else ckpt.dense(name, mx.float32)
        if kind == "ssm_a":  # -exp(A_log) -> A_log, kept float32 (mlx-lm does not cast it)
            w = mx.log(-w)
        if perm is not None:
            if kind in ("attn_qkv", "ssm_conv1d"):
                w = _rows(w, perm, dv, 2 * num_k * dk)
            elif kind == "attn_gate":
                w = _rows(w, perm, dv)
            elif kind in ("ssm_alpha", "ssm_beta", "ssm_a", "ssm_dt"):
                w = _rows(w, perm, 1)
            elif kind == "ssm_out":
                w = _rows(w.T, perm, dv).T
        if kind == "ssm_conv1d":  # [C, K] -> mlx-lm's Conv1d weight [C, K, 1]
            w = w[:, :, None]
        elif kind == "ffn_gate_inp_shexp":  # [hidden] -> the Linear(hidden, 1) weight
            w = w.reshape(1, -1)
        out[target] = w if kind == "ssm_a" else w.astype(dtype)
    return out


def is_qwen35(ckpt) -> bool:
    return ckpt.architecture in (ARCH, MOE_ARCH)


def check_rotary(config: dict) -> None:
    rp = config["rope_parameters"]
    rot = rp["partial_rotary_factor"] * config["head_dim"]
    if not math.isclose(rot, round(rot)) or sum(rp["mrope_section"]) * 2 != round(rot):
        raise ValueError(f"[vllm-metal] {ARCH} GGUF: rope sections {rp['mrope_section']} do not "
                         f"cover the rotary dimension {rot}")
