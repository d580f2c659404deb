"""Qwen3.5 text model (hybrid: gated delta net + full attention) on our ops.

mlx-lm's architecture (``mlx_lm.models.qwen3_5.TextModel``) with every linear-attention
layer running ``ops.causal_conv1d`` and ``ops.gated_delta_rule`` on per-request state
slots (vLLM's mamba-style layout: conv state ``[slots, C, K-1]``, recurrent state
``[slots, Hv, Dv, Dk]`` float32) instead of mlx-lm's per-batch arrays, and the
attention layers rotate with ``ops.mrope`` (interleaved sections, partial rotary).
Attention itself, MLPs and norms are mlx-lm's, with its KV cache. The parameter names are
mlx-lm's, so its sanitized checkpoints load unchanged.

A forward takes one request's rows ([1, L] tokens) and that request's caches from
``make_cache(slot)``; several requests share the per-layer state pools by slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5 as mlx_qwen3_5
from mlx_lm.models.cache import KVCache

from vllm_metal import ops


class StatePool:
    """Per-layer state of every slot: conv [slots, C, K-1] and recurrent float32
    [slots, Hv, Dv, Dk]. Updated in place by the ops (inplace=True)."""

    def __init__(self, num_slots: int, gdn: "GatedDeltaNet", dtype=mx.float32):
        k = gdn.conv_kernel_size
        self.conv = mx.zeros((num_slots, gdn.conv_dim, k - 1), dtype=dtype)
        self.ssm = mx.zeros((num_slots, gdn.num_v_heads, gdn.head_v_dim, gdn.head_k_dim),
                            dtype=mx.float32)
        mx.eval(self.conv, self.ssm)


@dataclass
class SlotCache:
    """A request's place in one layer's StatePool; `started` is False until its first
    rows ran (the op then ignores whatever the slot held before)."""

    pool: StatePool
    slot: int
    started: bool = False


class GatedDeltaNet(mlx_qwen3_5.GatedDeltaNet):
    """mlx-lm's layer (same parameters) with the conv and the recurrence on our ops."""

    def __call__(self, inputs: mx.array, mask=None, cache: SlotCache | None = None):
        if cache is None:
            raise ValueError("[qwen3_5] a linear-attention layer needs its SlotCache")
        if inputs.shape[0] != 1:
            raise ValueError("[qwen3_5] one request per forward (inputs [1, L, hidden])")
        length = inputs.shape[1]
        x = inputs[0]
        qkv = self.in_proj_qkv(x)
        z = self.in_proj_z(x).reshape(length, self.num_v_heads, self.head_v_dim)
        b, a = self.in_proj_b(x), self.in_proj_a(x)
        meta = dict(cu_seqlens=mx.array([0, length], dtype=mx.int32),
                    slots=mx.array([cache.slot], dtype=mx.int32),
                    has_initial_state=mx.array([int(cache.started)], dtype=mx.int32))
        pool = cache.pool
        conv_out, pool.conv = ops.causal_conv1d(
            qkv, self.conv1d.weight[:, :, 0].astype(qkv.dtype), None,
            conv_state=pool.conv, inplace=True, **meta)
        q, k, v = mx.split(conv_out, [self.key_dim, 2 * self.key_dim], axis=-1)
        y, pool.ssm = ops.gated_delta_rule(
            q.reshape(length, self.num_k_heads, self.head_k_dim),
            k.reshape(length, self.num_k_heads, self.head_k_dim),
            v.reshape(length, self.num_v_heads, self.head_v_dim),
            a, b, self.A_log, self.dt_bias, state=pool.ssm, inplace=True, **meta)
        cache.started = True
        out = self.norm(y, z)
        return self.out_proj(out.reshape(1, length, -1))


class InterleavedMrope(nn.Module):
    """Stands in for mlx-lm's ``rope(x [1, H, L, D], offset)`` in the attention layers:
    ``ops.mrope`` with Qwen3.5's interleaved sections and partial rotary. Text tokens
    have the same temporal, height and width position (offset + i), where this is
    mlx-lm's rope with exactly reduced angles."""

    def __init__(self, rotary_dim: int, base: float, sections):
        super().__init__()
        self.rotary_dim, self.base, self.sections = rotary_dim, base, tuple(sections)

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        if x.shape[0] != 1:
            raise ValueError("[qwen3_5] one request per forward")
        length = x.shape[2]
        positions = mx.broadcast_to(mx.arange(offset, offset + length, dtype=mx.int32),
                                    (3, length))
        y = ops.mrope(x[0].transpose(1, 0, 2), positions, sections=self.sections,
                      interleaved=True, rotary_dim=self.rotary_dim, base=self.base)
        return y.transpose(1, 0, 2)[None]


class TextModel(mlx_qwen3_5.TextModel):
    """mlx-lm's Qwen3.5 text model whose linear-attention layers and rope use our ops."""

    def __init__(self, args: mlx_qwen3_5.TextModelArgs, num_slots: int = 8):
        super().__init__(args)
        sections = (args.rope_parameters or {}).get("mrope_section", [11, 11, 10])
        rotary_dim = int(args.head_dim * args.partial_rotary_factor)
        for layer in self.model.layers:
            if layer.is_linear:
                layer.linear_attn.__class__ = GatedDeltaNet  # same parameters, our __call__
            else:
                layer.self_attn.rope = InterleavedMrope(rotary_dim, args.rope_theta, sections)
        dtype = mx.float32
        self.pools = [StatePool(num_slots, l.linear_attn, dtype) if l.is_linear else None
                      for l in self.model.layers]

    def set_state_dtype(self, dtype) -> None:
        """Conv state in the activations' dtype (the recurrent state stays float32)."""
        for pool in self.pools:
            if pool is not None:
                pool.conv = pool.conv.astype(dtype)

    def make_cache(self, slot: int = 0):
        return [SlotCache(pool, slot) if pool is not None else KVCache() for pool in self.pools]


def from_mlx_lm(reference: mlx_qwen3_5.TextModel, num_slots: int = 8) -> TextModel:
    """Our model with the parameters of an mlx-lm Qwen3.5 TextModel (shared, not copied)."""
    model = TextModel(reference.args, num_slots=num_slots)
    model.update(reference.parameters())
    return model
