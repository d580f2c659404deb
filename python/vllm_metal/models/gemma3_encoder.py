"""EmbeddingGemma: Gemma 3 text (transformers' Gemma3TextModel) with bidirectional
attention, on packed batches like the BERT encoders (models/bert.py): no KV cache, a
prompt runs whole in one step, attention is ``ops.varlen_attention`` within each
sequence. The sentence-transformers modules after it (mean pooling, Dense projections,
normalisation) are vLLM's pooler heads (pooling.py).

Per layer (Gemma 3's sandwich norms, RMSNorm scaling by 1 + w):
    h += post_attn_norm(attn(in_norm(h)));  h += post_ff_norm(mlp(pre_ff_norm(h)))
attention: q/k RMS-normed per head, RoPE with the layer type's base (sliding layers:
rope_local_base_freq), scale query_pre_attn_scalar^-0.5, grouped KV heads.

Sliding layers attend to keys with |i - j| < window (transformers' bidirectional window:
sliding_window // 2 + 1 of the saved value), through varlen_attention's window option; full
layers to the whole sequence. Inputs go up to max_position_embeddings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from vllm_metal import ops

ARCHITECTURE = "Gemma3TextModel"


@dataclass
class Gemma3EncoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    query_pre_attn_scalar: float
    rms_norm_eps: float
    max_tokens: int  # max_position_embeddings: longer inputs are refused
    rope_bases: list  # per layer
    windows: list  # per layer: the bidirectional window of a sliding layer, 0 for a full one
    hidden_act: str

    @classmethod
    def from_dict(cls, cfg: dict) -> "Gemma3EncoderConfig":
        if not cfg.get("use_bidirectional_attention"):
            raise ValueError(f"[vllm-metal] {ARCHITECTURE} without use_bidirectional_attention is not "
                             "served as an encoder (EmbeddingGemma sets it)")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"[vllm-metal] {ARCHITECTURE}: unsupported activation {act!r}")
        if cfg.get("attn_logit_softcapping"):
            raise ValueError(f"[vllm-metal] {ARCHITECTURE}: attention logit softcapping is not supported")
        n = cfg["num_hidden_layers"]
        layer_types = cfg.get("layer_types") or [
            "full_attention" if (i + 1) % cfg.get("sliding_window_pattern", 6) == 0 else "sliding_attention"
            for i in range(n)]
        rope = rope_bases(cfg)
        return cls(vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                   intermediate_size=cfg["intermediate_size"], num_hidden_layers=n,
                   num_attention_heads=cfg["num_attention_heads"],
                   num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
                   query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", cfg["head_dim"]),
                   rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), max_tokens=max_tokens(cfg),
                   rope_bases=[rope[t] for t in layer_types], hidden_act=act,
                   windows=[window(cfg) if t == "sliding_attention" else 0 for t in layer_types])


def max_tokens(cfg) -> int:
    """The longest input: the position range (sliding layers window their keys themselves)."""
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    return int(get("max_position_embeddings", 2048))


def window(cfg) -> int:
    """transformers' bidirectional window: a sliding layer's row i sees keys |i - j| < window,
    window = sliding_window // 2 + 1 of the saved value (0: no window)."""
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    saved = get("sliding_window")
    if saved is None:
        return 0
    # a config.json holds the saved value; a loaded transformers config, the halved one
    return int(saved) // 2 + 1 if isinstance(cfg, dict) else int(saved)


def rope_bases(cfg: dict) -> dict:
    """RoPE base per layer type; only the default (unscaled) rope is supported."""
    params = cfg.get("rope_parameters")
    if params and "full_attention" in params:
        out = {}
        for kind in ("full_attention", "sliding_attention"):
            p = params[kind]
            if p.get("rope_type", "default") != "default":
                raise ValueError(f"[vllm-metal] {ARCHITECTURE}: rope type {p['rope_type']!r} is not supported")
            out[kind] = float(p["rope_theta"])
        return out
    scaling = cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ValueError(f"[vllm-metal] {ARCHITECTURE}: rope scaling {scaling!r} is not supported")
    return {"full_attention": float(cfg.get("rope_theta", 1e6)),
            "sliding_attention": float(cfg.get("rope_local_base_freq", 10000.0))}


def _rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x [T, H, D]; cos/sin [T, 1, D/2]: rotate the two halves (transformers' rotate_half)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class _Norm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x):
        return ops.rms_norm(x, 1.0 + self.weight, self.eps)


class _Attention(nn.Module):
    def __init__(self, c: Gemma3EncoderConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = _Norm(c.head_dim, c.rms_norm_eps)
        self.k_norm = _Norm(c.head_dim, c.rms_norm_eps)
        self.scale = float(c.query_pre_attn_scalar) ** -0.5

    def __call__(self, x, cu, cos, sin, window):
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).reshape(t, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(t, self.kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(t, self.kv_heads, self.head_dim)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        a = ops.varlen_attention(q, k, v, cu_seqlens=cu, scale=self.scale, window=window)
        return self.o_proj(a.reshape(t, -1))


class _MLP(nn.Module):
    def __init__(self, c: Gemma3EncoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def __call__(self, x):
        return self.down_proj(ops.gelu(self.gate_proj(x), approximate=True) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: Gemma3EncoderConfig):
        super().__init__()
        h, eps = c.hidden_size, c.rms_norm_eps
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)
        self.input_layernorm = _Norm(h, eps)
        self.post_attention_layernorm = _Norm(h, eps)
        self.pre_feedforward_layernorm = _Norm(h, eps)
        self.post_feedforward_layernorm = _Norm(h, eps)

    def __call__(self, h, cu, cos, sin, window):
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cu, cos, sin,
                                                             window))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3Encoder(nn.Module):
    """pooling.HiddenStateSource of an EmbeddingGemma checkpoint; see the module docstring."""

    causal = False  # bidirectional: a prompt runs in one step

    def __init__(self, config: Gemma3EncoderConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [_Layer(config) for _ in range(config.num_hidden_layers)]
        self.norm = _Norm(config.hidden_size, config.rms_norm_eps)

    def __call__(self, input_ids, cu_seqlens, positions=None) -> mx.array:
        """Final hidden states [T, hidden] (after the last norm) of packed sequences."""
        c = self.config
        cu_np = np.asarray(cu_seqlens, np.int32)
        ids = mx.array(input_ids).astype(mx.int32).reshape(-1)
        t = ids.shape[0]
        if cu_np.ndim != 1 or cu_np.size < 2 or cu_np[0] != 0 or cu_np[-1] != t \
                or np.any(np.diff(cu_np) < 0):
            raise ValueError(f"[vllm-metal] cu_seqlens must rise from 0 to {t}, got {cu_np.tolist()}")
        lengths = np.diff(cu_np)
        if lengths.size and lengths.max() > c.max_tokens:
            raise ValueError(f"[vllm-metal] an input of {int(lengths.max())} tokens is longer than "
                             f"the model's {c.max_tokens} positions")
        if positions is None:
            positions = np.arange(t) - np.repeat(cu_np[:-1], lengths)
        pos = np.asarray(positions, np.float64)
        h = self.embed_tokens(ids)
        # transformers scales the embeddings by sqrt(hidden) in the weights' dtype
        h = h * mx.array(c.hidden_size ** 0.5, mx.float32).astype(h.dtype)
        tables = {}
        for base in set(c.rope_bases):
            inv = base ** (-np.arange(0, c.head_dim, 2, dtype=np.float64) / c.head_dim)
            ang = (pos[:, None] * inv[None, :]).astype(np.float32)[:, None, :]
            tables[base] = (mx.array(np.cos(ang)).astype(h.dtype), mx.array(np.sin(ang)).astype(h.dtype))
        cu = mx.array(cu_np)
        for layer, base, w in zip(self.layers, c.rope_bases, c.windows):
            h = layer(h, cu, *tables[base], w)
        return self.norm(h)

    def hidden_states(self, input_ids, ctx, rows, token_type_ids=None) -> mx.array:
        """pooling.HiddenStateSource: hidden states at packed `rows` (whole prompts), every
        row if None."""
        hidden = self(input_ids, np.asarray(ctx.cu_seqlens_q, np.int32), np.asarray(ctx.positions))
        return hidden if rows is None else hidden[mx.array(rows).astype(mx.int32)]


def load_gemma3_encoder(directory: str | Path, dtype=mx.float32, linear: str = "gguf") -> Gemma3Encoder:
    """From a directory with config.json and *.safetensors (a saved Gemma3TextModel, the
    sentence-transformers layout of EmbeddingGemma)."""
    from vllm_metal.models.linear_choice import choose_dense_layers

    directory = Path(directory)
    config = Gemma3EncoderConfig.from_dict(json.loads((directory / "config.json").read_text()))
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"[vllm-metal] no *.safetensors in {directory}")
    weights = {}
    for f in files:
        for name, w in mx.load(str(f)).items():
            name = name[len("model."):] if name.startswith("model.") else name
            if not name.startswith("lm_head."):
                weights[name] = w.astype(dtype)
    model = Gemma3Encoder(config)
    model.load_weights(list(weights.items()), strict=True)
    choose_dense_layers(model, linear)
    mx.eval(model.parameters())
    return model
