"""An mlx-lm model run over a packed batch and the paged KV cache.

`PagedCausalLM.adapt(mlx_lm_model, config)` swaps, in place, every attention
for PagedAttention and every RMSNorm for ours (same parameter names), then the
forward below walks the mlx-lm module tree itself: embeddings, decoder blocks,
final norm, lm_head. It never calls mlx-lm's model __call__, so no [T, T] mask
is built; the residual adds are fused with the following norm (add_rms_norm).
The linear layers and embeddings are swapped by the loader (gguf_linear.py).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from vllm_metal import ops
from vllm_metal.models.architectures import (Architecture, architecture_of, layer_sliding_windows,
                                             mlx_lm_config)
from vllm_metal.models.context import AttentionContext
from vllm_metal.models.gguf_linear import GGUFEmbedding
from vllm_metal.models.layers import PagedAttention, RMSNorm
from vllm_metal.models.moe import swap_moe_blocks
from vllm_metal.models.rope import rope_config

_NORM_NAMES = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm")


class PagedCausalLM(nn.Module):
    """forward: (input_ids int32 [T], ctx) -> logits [len(ctx.logits_indices), vocab]
    in the model dtype (the residual stream's)."""

    def __init__(self, lm: nn.Module, arch: Architecture, config: dict):
        super().__init__()
        self.lm = lm  # the mlx-lm Model; parameters keep its names under "lm."
        self.arch = arch
        self.sandwich = arch.block_style == "sandwich"
        # gemma3: embeddings times sqrt(hidden), rounded through bfloat16 as mlx-lm does
        self.embed_scale = math.sqrt(config["hidden_size"]) if self.sandwich else None
        self.final_softcap = float(config.get("final_logit_softcapping") or 0.0)
        # ministral3: queries scaled by 1 + beta * log(1 + floor(pos / original_max))
        self.llama4_beta = None
        if arch.model_type == "ministral3":
            rp = config["rope_parameters"]
            self.llama4_beta = float(rp["llama_4_scaling_beta"])
            self.llama4_original_max = float(rp["original_max_position_embeddings"])

    @classmethod
    def adapt(cls, lm: nn.Module, config: dict) -> "PagedCausalLM":
        """Swap attention and norms of `lm` (an mlx-lm Model, weights loaded or
        not); `config` is the HF config.json content."""
        arch = architecture_of(config)
        windows = layer_sliding_windows(config)
        rope_args = mlx_lm_config(config)
        offset = 1.0 if arch.block_style == "sandwich" else 0.0  # gemma: (1 + w)
        softcap = float(config.get("attn_logit_softcapping") or 0.0)
        body = lm.model
        for i, layer in enumerate(body.layers):
            attn = layer.self_attn
            if "q_norm" in attn:
                attn.q_norm = RMSNorm.replacing(attn.q_norm, offset)
                attn.k_norm = RMSNorm.replacing(attn.k_norm, offset)
            base, scaling = _rope_source(arch, rope_args, getattr(attn, "is_sliding", False))
            layer.self_attn = PagedAttention(
                attn, layer_idx=i, rope=rope_config(attn.rope, base, scaling),
                sliding_window=windows[i], softcap=softcap)
            for name in _NORM_NAMES:
                if name in layer:
                    setattr(layer, name, RMSNorm.replacing(layer[name], offset))
        body.norm = RMSNorm.replacing(body.norm, offset)
        swap_moe_blocks(lm)
        return cls(lm, arch, config)

    def set_dtype(self, dtype: mx.Dtype, predicate=lambda t: mx.issubdtype(t, mx.floating)) -> None:
        """Float parameters to `dtype` (block-form weights are uint8 and stay);
        block-form embeddings then look rows up in `dtype`."""
        super().set_dtype(dtype, predicate)
        self.reset_fused_layers()
        for _, m in self.named_modules():
            if isinstance(m, GGUFEmbedding):
                m.out_dtype = dtype if m.is_blocks else m.weight.dtype

    def reset_fused_layers(self) -> None:
        """Forget the fused layers (rebuilt from the current weights on the next forward)."""
        object.__setattr__(self, "_fused_plan", None)

    def fold_norm_offsets(self) -> None:
        self.reset_fused_layers()
        for _, m in self.named_modules():
            if isinstance(m, RMSNorm):
                m.fold_offset()

    @property
    def layers(self) -> list:
        return self.lm.model.layers

    # a decoder: a token's hidden state depends only on the tokens before it (pooling.py)
    causal = True

    def __call__(self, input_ids: mx.array, ctx: AttentionContext, carried=None) -> mx.array:
        """carried (pipeline parallel, a later stage): the previous stage's (h, residual)
        instead of the embedded input_ids."""
        body = self.lm.model
        out = self.hidden_states(input_ids, ctx, ctx.logits_indices, carried)
        if "lm_head" in self.lm:
            logits = self.lm.lm_head(out)
        else:
            logits = body.embed_tokens.as_linear(out)
        if self.final_softcap:
            logits = mx.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def hidden_states(self, input_ids: mx.array, ctx: AttentionContext, rows: mx.array,
                      carried=None) -> mx.array:
        """The final hidden states (after the last norm, before lm_head) at packed rows
        `rows`: what the pooling runner pools (pooling.HiddenStateSource)."""
        body = self.lm.model
        if carried is not None:
            h, residual = self.stage_forward(input_ids, ctx, carried)
            h = h[rows]
            out, _ = ops.add_rms_norm(h, residual[rows], body.norm.multiplier(), body.norm.eps)
            return out
        h = body.embed_tokens(input_ids)  # [T, hidden]
        if self.embed_scale is not None:
            h = h * mx.array(self.embed_scale, mx.bfloat16).astype(h.dtype)
        query_scale = self._llama4_query_scale(ctx.positions)
        fused = self._fused_layers()  # with LoRA adapters too (FusedDecoderLayer passes them)
        aux = _AuxStates(ctx)  # an EAGLE3 head's inputs: the stream after some layers
        aux.after(0, h, None)
        if fused:
            for i, layer in enumerate(fused):
                h = layer(h, ctx)
                aux.after(i + 1, h, None)
            # The fused layers write the caches in place, a side effect MLX cannot see: hand
            # the caches on as arrays that depend on the last layer (so on every layer), so
            # whoever evaluates ctx.kv_caches runs the step even when it wants no logits
            # (a prefill chunk whose logits are not needed).
            flat = mx.depends([c for kv in ctx.kv_caches for c in kv], [h])
            ctx.kv_caches[:] = list(zip(flat[0::2], flat[1::2]))
            residual = None  # h is the residual stream, already summed
        elif self.sandwich:
            if aux.layers:
                raise ValueError("[vllm-metal] hidden states of inner layers are kept for "
                                 "pre-norm (llama-family) models only")
            h, residual = self._sandwich_layers(h, ctx)
        else:
            h, residual = self._pre_norm_layers(h, ctx, query_scale, aux)

        # Only the rows wanted go through the final norm (and lm_head).
        h = h[rows]
        norm = body.norm
        if residual is None:
            return ops.rms_norm(h, norm.multiplier(), norm.eps)
        out, _ = ops.add_rms_norm(h, residual[rows], norm.multiplier(), norm.eps)
        return out

    def _fused_layers(self):
        """The layers as fused C++ ops (fused_layers.py), built on the first forward
        (after the weights and dtype are final), or None: the per-op path."""
        plan = self.__dict__.get("_fused_plan")
        if plan is None:
            from vllm_metal.models.fused_layers import fused_layers

            plan = fused_layers(self) or []
            # a plain attribute: nn.Module would file a list under its parameters
            object.__setattr__(self, "_fused_plan", plan)
        return plan

    def stage_forward(self, input_ids: mx.array, ctx: AttentionContext, carried=None):
        """Pipeline parallel: this stage's layers (models/pipeline_parallel.py). The first
        stage embeds input_ids; a later one takes the previous stage's (h, residual).
        Returns (h, residual) after the stage's last layer, the residual not yet added."""
        if carried is None:
            h, residual = self.lm.model.embed_tokens(input_ids), None
        else:
            h, residual = carried
        return self._pre_norm_layers(h, ctx, self._llama4_query_scale(ctx.positions),
                                     residual=residual)

    def _pre_norm_layers(self, h, ctx, query_scale, aux=None, residual=None):
        """llama family: x = norm1(h); h += attn(x); h += mlp(norm2(h)).
        Returns the last block's output and the residual it is added to
        (residual: a previous pipeline stage's, h to be added to it)."""
        for i, layer in enumerate(self.layers):
            n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
            if residual is None:
                residual = h
                x = n1(h)
            else:
                x, residual = ops.add_rms_norm(h, residual, n1.multiplier(), n1.eps)
            h = layer.self_attn(x, ctx, query_scale)
            x, residual = ops.add_rms_norm(h, residual, n2.multiplier(), n2.eps)
            h = layer.mlp(x)
            if aux is not None:
                aux.after(i + 1, h, residual)
        return h, residual

    def _sandwich_layers(self, h, ctx):
        """gemma3: h += post_attn_norm(attn(in_norm(h))); h += post_ff_norm(mlp(pre_ff_norm(h)))."""
        if h.dtype == mx.float16:
            return self._sandwich_layers_clipped(h, ctx)
        residual = None
        for layer in self.layers:
            n_in, n_pre = layer.input_layernorm, layer.pre_feedforward_layernorm
            if residual is None:
                residual = h
                x = n_in(h)
            else:
                x, residual = ops.add_rms_norm(h, residual, n_in.multiplier(), n_in.eps)
            r = layer.post_attention_layernorm(layer.self_attn(x, ctx))
            x, residual = ops.add_rms_norm(r, residual, n_pre.multiplier(), n_pre.eps)
            h = layer.post_feedforward_layernorm(layer.mlp(x))
        return h, residual

    def _sandwich_layers_clipped(self, h, ctx):
        """float16 gemma: residual adds in float32 clipped to the float16 range
        (mlx-lm's clip_residual), so they are not fused with the norms."""
        from mlx_lm.models.gemma3_text import clip_residual

        for layer in self.layers:
            r = layer.post_attention_layernorm(layer.self_attn(layer.input_layernorm(h), ctx))
            h = clip_residual(h, r)
            r = layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
            h = clip_residual(h, r)
        return mx.zeros_like(h), h  # the caller adds h + residual before the final norm

    def _llama4_query_scale(self, positions: mx.array):
        if self.llama4_beta is None:
            return None
        pos = positions.astype(mx.float32)
        scale = 1 + self.llama4_beta * mx.log(1 + mx.floor(pos / self.llama4_original_max))  # [T]
        return scale[:, None, None]


def _rope_source(arch: Architecture, config: dict, sliding: bool):
    """(base, scaling dict) the mlx-lm module built its rope from."""
    if arch.model_type == "gemma3_text":
        if sliding:
            return config.get("rope_local_base_freq", 10_000.0), None
        return config.get("rope_theta", 1_000_000.0), config.get("rope_scaling")
    if arch.model_type == "ministral3":
        rp = config["rope_parameters"]
        return rp["rope_theta"], rp
    return config.get("rope_theta") or 10_000.0, config.get("rope_scaling")


class _AuxStates:
    """ctx.aux_layers (when set): the residual stream after each of those many layers
    (0: the embeddings), in that order, into ctx.aux, as vLLM's EAGLE3 targets give them."""

    def __init__(self, ctx) -> None:
        self.layers = tuple(getattr(ctx, "aux_layers", None) or ())
        self.ctx = ctx
        if self.layers:
            ctx.aux = [None] * len(self.layers)

    def after(self, n: int, h: mx.array, residual: mx.array | None) -> None:
        for k, want in enumerate(self.layers):
            if want == n:
                self.ctx.aux[k] = h if residual is None else h + residual
