"""Our modules swapped into mlx-lm models: RMSNorm on ops.rms_norm, and
attention over the paged KV cache (rope -> reshape_and_cache -> paged_attention).

Both keep mlx-lm's parameter names (weight; q_proj/k_proj/v_proj/o_proj,
q_norm/k_norm), so checkpoints load into them unchanged.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from vllm_metal import ops
from vllm_metal.models.context import AttentionContext
from vllm_metal.models.rope import RopeConfig, apply_rope


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (offset + weight) over the last axis.

    offset is 1 for Gemma, whose checkpoints store w with the norm using 1 + w.
    `fold_offset` bakes it into `weight` once the weights are loaded, so a
    step does not recompute 1 + w (after folding, `weight` is the multiplier).
    """

    def __init__(self, dims: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = mx.zeros((dims,)) if offset else mx.ones((dims,))
        self.eps = float(eps)
        self.offset = float(offset)

    @classmethod
    def replacing(cls, norm: nn.Module, offset: float = 0.0) -> "RMSNorm":
        out = cls(norm.weight.shape[0], norm.eps, offset)
        out.weight = norm.weight
        return out

    def fold_offset(self) -> None:
        if self.offset:
            # In the weight's dtype, as mlx-lm's gemma computes 1.0 + weight.
            self.weight = self.weight + self.offset
            self.offset = 0.0

    def multiplier(self) -> mx.array:
        return self.weight + self.offset if self.offset else self.weight

    def __call__(self, x: mx.array) -> mx.array:
        return ops.rms_norm(x, self.multiplier(), self.eps)


class PagedAttention(nn.Module):
    """An mlx-lm attention's projections over vLLM's paged KV cache.

    Input x [T, hidden] holds the packed tokens of every scheduled request
    (decode rows first). Queries and keys are rotated at their own positions,
    the step's keys/values are written at ctx.slot_mapping, and each query row
    attends to its request's cached context (causal, optionally windowed).
    """

    def __init__(self, source: nn.Module, *, layer_idx: int, rope: RopeConfig,
                 sliding_window: int = 0, softcap: float = 0.0):
        super().__init__()
        self.q_proj = source.q_proj
        self.k_proj = source.k_proj
        self.v_proj = source.v_proj
        self.o_proj = source.o_proj
        if "q_norm" in source:  # qwen3, gemma3: per-head RMSNorm before rope
            self.q_norm = source.q_norm
            self.k_norm = source.k_norm
        # gpt-oss's mlx-lm module names them num_attention_heads / num_key_value_heads / sm_scale
        self.num_heads = getattr(source, "n_heads", None) or source.num_attention_heads
        self.num_kv_heads = getattr(source, "n_kv_heads", None) or source.num_key_value_heads
        self.head_dim = self.q_proj.weight.shape[0] // self.num_heads
        if "sinks" in source:  # gpt-oss: one extra attention logit per head
            self.sinks = source.sinks
        # olmoe: one RMSNorm over all heads' projection (weight [heads * head_dim])
        self.qk_norm_whole = ("q_norm" in source and self.num_heads > 1
                              and source.q_norm.weight.shape[0] == self.num_heads * self.head_dim)
        self.scale = float(source.scale if hasattr(source, "scale") else source.sm_scale)
        self.layer_idx = layer_idx
        self.rope = rope
        self.sliding_window = int(sliding_window)
        self.softcap = float(softcap)

    def __call__(self, x: mx.array, ctx: AttentionContext,
                 query_scale: mx.array | None = None) -> mx.array:
        t = x.shape[0]
        q, k = self.q_proj(x), self.k_proj(x)
        if self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(t, self.num_heads, self.head_dim)                  # [T, Hq, D]
        k = k.reshape(t, self.num_kv_heads, self.head_dim)               # [T, Hkv, D]
        v = self.v_proj(x).reshape(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if "q_norm" in self and not self.qk_norm_whole:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q, ctx.positions, self.rope)
        k = apply_rope(k, ctx.positions, self.rope)
        if query_scale is not None:  # ministral3: position-dependent query scaling, [T, 1, 1]
            q = q * query_scale.astype(q.dtype)

        key_cache, value_cache = ctx.kv_caches[self.layer_idx]
        # in place: step N's tasks still hold the caches while step N+1 is built (async
        # scheduling), so MLX could not donate them and would copy each cache every step
        key_cache, value_cache = ops.reshape_and_cache(k, v, key_cache, value_cache,
                                                       ctx.slot_mapping, inplace=True)
        ctx.kv_caches[self.layer_idx] = (key_cache, value_cache)

        out = ops.paged_attention(
            q, key_cache, value_cache, ctx.block_tables, ctx.seq_lens, ctx.cu_seqlens_q,
            scale=self.scale, sliding_window=self.sliding_window, softcap=self.softcap,
            sinks=self.sinks.astype(mx.float32) if "sinks" in self else None,
            num_decode_seqs=ctx.num_decode_seqs, max_seq_len=ctx.max_seq_len,
            max_query_len=ctx.max_query_len)                          # [T, Hq, D]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
