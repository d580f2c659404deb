"""EAGLE3 heads (speculative method "eagle3"): a one-layer llama-style drafter that reads
three of the target's inner hidden states, run by head_draft.HeadDraft.

The head (facts of the format, as vLLM's llama_eagle3 defines it). With e the token
embedding and g the target's residual stream after the layers named by
eagle_aux_hidden_state_layer_ids (default 2, N // 2, N - 3 of N layers), concatenated:
    pass 1:    h = fc(g)                      [3 * target hidden -> hidden]
    later:     h = the head's own previous output (the stream before its final norm)
    r = h;  x = [input_layernorm(e), hidden_norm(h)]   (norm_before_residual: r = hidden_norm(h))
    r = r + self_attn(x)          q/k/v projections take 2 * hidden inputs; RoPE; causal
    r = r + mlp(post_attention_layernorm(r))
    logits = lm_head(norm(r)) over the draft vocabulary; target id = d + d2t[d]
The embedding is the head's own when its checkpoint has one, else the target's.

Checkpoints: the speculators format (config.json with speculators_model_type "eagle3",
the layer config under transformer_layer_config, norm_before_residual defaulting to true)
or the original EAGLE3 layout (a llama config with draft_vocab_size; "midlayer." for
"layers.0."). Variants with norm_before_fc or fc_norm, or more than one layer, are
refused at load with a message.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from vllm_metal.head_draft import HeadDraft


def read_config(path: Path) -> dict:
    """The head's layer config with its EAGLE3 fields (draft_vocab_size,
    norm_before_residual, eagle_aux_hidden_state_layer_ids, target_hidden_size, ...)."""
    raw = json.loads((path / "config.json").read_text())
    if raw.get("speculators_model_type") is not None:
        if raw["speculators_model_type"] != "eagle3":
            raise ValueError(f"[vllm-metal] {path}: speculators model type "
                             f"{raw['speculators_model_type']!r}, expected 'eagle3'")
        cfg = dict(raw.get("transformer_layer_config") or {})
        cfg["norm_before_residual"] = raw.get("norm_before_residual", True)
        for key in ("draft_vocab_size", "target_hidden_size", "norm_before_fc", "fc_norm",
                    "norm_output", "eagle_aux_hidden_state_layer_ids"):
            if raw.get(key) is not None:
                cfg[key] = raw[key]
        return cfg
    cfg = dict(raw)
    cfg.update(raw.get("eagle_config") or {})
    return cfg


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: dict):
        from mlx_lm.models import llama

        super().__init__()
        h, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        args = llama.ModelArgs.from_dict({**cfg, "model_type": "llama"})
        attn = llama.Attention(args)
        heads, kv = args.num_attention_heads, args.num_key_value_heads
        dim = args.head_dim or h // heads
        bias = bool(cfg.get("attention_bias", False))
        # the first (only) layer's attention reads [embedding, hidden]: 2 * hidden inputs
        attn.q_proj = nn.Linear(2 * h, heads * dim, bias=bias)
        attn.k_proj = nn.Linear(2 * h, kv * dim, bias=bias)
        attn.v_proj = nn.Linear(2 * h, kv * dim, bias=bias)
        self.self_attn = attn
        self.mlp = llama.MLP(args)
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.hidden_norm = nn.RMSNorm(h, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)


class Eagle3Module(nn.Module):
    """The head's parameters, named as its checkpoint names them."""

    def __init__(self, cfg: dict, target_hidden: int, num_aux: int, own_embedding: bool):
        super().__init__()
        h = cfg["hidden_size"]
        self.fc = nn.Linear(num_aux * target_hidden, h, bias=False)
        self.layers = [Eagle3Layer(cfg)]
        self.norm = nn.RMSNorm(h, eps=cfg.get("rms_norm_eps", 1e-6))
        self.lm_head = nn.Linear(h, int(cfg["draft_vocab_size"]), bias=False)
        if own_embedding:
            self.embed_tokens = nn.Embedding(int(cfg["vocab_size"]), h)


class Eagle3Head:
    """head_draft.HeadDraft's head for an EAGLE3 checkpoint over a pre-norm target."""

    name = "EAGLE3 head"

    def __init__(self, target, model_path: str) -> None:
        from mlx.utils import tree_flatten

        from vllm_metal.models.layers import PagedAttention, RMSNorm
        from vllm_metal.models.linear_choice import choose_dense_layers
        from vllm_metal.models.rope import rope_config

        path = Path(model_path)
        if target.hybrid is not None or getattr(target.model, "sandwich", True):
            raise ValueError("[vllm-metal] speculative method 'eagle3' needs a llama-family "
                             "(pre-norm attention) target")
        cfg = read_config(path)
        for flag in ("norm_before_fc", "fc_norm"):
            if cfg.get(flag):
                raise ValueError(f"[vllm-metal] EAGLE3 head {path}: {flag} heads are not "
                                 "supported yet")
        if int(cfg.get("num_hidden_layers", 1)) != 1:
            raise ValueError(f"[vllm-metal] EAGLE3 head {path}: heads of "
                             f"{cfg['num_hidden_layers']} layers are not supported (one layer)")
        lm = target.model.lm
        n = len(target.model.layers)
        self.aux_layers = tuple(int(i) for i in cfg.get("eagle_aux_hidden_state_layer_ids")
                                or (2, n // 2, n - 3))
        if not all(0 <= i <= n for i in self.aux_layers):
            raise ValueError(f"[vllm-metal] EAGLE3 head {path}: aux hidden state layers "
                             f"{self.aux_layers} outside the target's 0..{n}")
        target_hidden = int(cfg.get("target_hidden_size") or lm.args.hidden_size)
        weights = _load_weights(path)
        self.d2t = weights.pop("d2t", None)
        weights.pop("t2d", None)
        own = "embed_tokens.weight" in weights
        if not own and int(cfg["hidden_size"]) != int(lm.args.hidden_size):
            raise ValueError(f"[vllm-metal] EAGLE3 head {path}: hidden size {cfg['hidden_size']} "
                             f"differs from the target's {lm.args.hidden_size} and the head has no "
                             "embedding of its own")
        module = Eagle3Module(cfg, target_hidden, len(self.aux_layers), own)
        want = dict((k, v.shape) for k, v in tree_flatten(module.parameters()))
        if set(weights) != set(want):
            missing, extra = sorted(set(want) - set(weights)), sorted(set(weights) - set(want))
            raise ValueError(f"[vllm-metal] EAGLE3 head {path}: tensors do not match the "
                             f"format: missing {missing[:4]}, unexpected {extra[:4]}")
        self.dtype = getattr(mx, target.spec.dtype)
        for name, value in weights.items():
            if value.shape != want[name]:
                raise ValueError(f"[vllm-metal] EAGLE3 head {path}: {name} has shape "
                                 f"{tuple(value.shape)}, the config needs {tuple(want[name])}")
            weights[name] = value.astype(self.dtype)
        module.load_weights(list(weights.items()), strict=True)
        draft_vocab = int(cfg["draft_vocab_size"])
        if self.d2t is None:
            if draft_vocab != target.spec.vocab_size:
                raise ValueError(f"[vllm-metal] EAGLE3 head {path}: a draft vocabulary of "
                                 f"{draft_vocab} needs its d2t mapping")
            self.d2t = mx.zeros((draft_vocab,), mx.int32)
        self.d2t = self.d2t.astype(mx.int32)
        layer = module.layers[0]
        attn = layer.self_attn
        rope_theta = cfg.get("rope_theta") or 10_000.0
        layer.self_attn = PagedAttention(attn, layer_idx=0,
                                         rope=rope_config(attn.rope, rope_theta, cfg.get("rope_scaling")),
                                         sliding_window=0, softcap=0.0)
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            setattr(layer, name, RMSNorm.replacing(getattr(layer, name)))
        module.norm = RMSNorm.replacing(module.norm)
        choose_dense_layers(module, "gguf")  # on the CPU our GEMM, on Apple GPUs MLX's
        module.eval()
        mx.eval(module.parameters())
        self.module, self.lm = module, lm
        self.norm_before_residual = bool(cfg.get("norm_before_residual", False))
        self.norm_output = bool(cfg.get("norm_output", False))
        self.cache_shape = (attn.n_kv_heads, attn.head_dim)
        self.own_embedding = own

    def prepare_target(self, ctx) -> None:
        ctx.aux_layers = self.aux_layers

    def target_states(self, ctx) -> mx.array:
        if not ctx.aux or any(a is None for a in ctx.aux):
            raise RuntimeError("[vllm-metal] eagle3: the target step kept no inner hidden states")
        return mx.concatenate(ctx.aux, axis=-1)

    def first(self, embeds, states, ctx):
        return self._layer(embeds, self.module.fc(states), ctx)

    def next(self, embeds, feed, ctx):
        return self._layer(embeds, feed, ctx)

    def _layer(self, embeds, h, ctx):
        layer = self.module.layers[0]
        e = layer.input_layernorm(embeds)
        normed = layer.hidden_norm(h)
        residual = normed if self.norm_before_residual else h
        r = residual + layer.self_attn(mx.concatenate([e, normed], axis=-1), ctx)
        r = r + layer.mlp(layer.post_attention_layernorm(r))
        out = self.module.norm(r)
        return out, (out if self.norm_output else r)

    def embed(self, ids: mx.array) -> mx.array:
        table = self.module.embed_tokens if self.own_embedding else self.lm.model.embed_tokens
        return table(ids).astype(self.dtype)

    def draft_ids(self, hidden: mx.array) -> mx.array:
        d = mx.argmax(self.module.lm_head(hidden), axis=-1).astype(mx.int32)
        return d + self.d2t[d]


def _load_weights(path: Path) -> dict:
    """The head's tensors, named as Eagle3Module's parameters."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        for name, value in mx.load(str(f)).items():
            if name.startswith("model."):
                name = name[len("model."):]
            if name.startswith("midlayer."):
                name = "layers.0." + name[len("midlayer."):]
            out[name] = value
    if not out:
        raise ValueError(f"[vllm-metal] EAGLE3 head {path}: no safetensors weights")
    return out


def Eagle3Draft(target, model_path: str, num_speculative_tokens: int,
                max_model_len: int) -> HeadDraft:
    """The runner's proposer for method "eagle3"."""
    return HeadDraft(Eagle3Head(target, model_path), num_speculative_tokens, max_model_len)
