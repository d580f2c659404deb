"""Qwen3.5 text (hybrid: gated delta net + gated full attention) over a packed batch.

The serving form of models/qwen3_5.py: the same mlx-lm ``TextModel`` parameters, but one
forward runs every scheduled request at once (decode rows first, then prefill chunks,
as the batch packer lays them out):

- linear-attention layers: ``ops.causal_conv1d`` and ``ops.gated_delta_rule`` over the
  packed rows (``cu_seqlens``), each request reading and updating its own state slot in
  the layer's ``StatePool``; ``has_initial_state`` 0 starts a request from zeros (its
  first chunk, or a recompute after preemption);
- full-attention layers: q/k/v projections, per-head q/k RMSNorm, ``ops.mrope``
  (interleaved sections, partial rotary; text tokens carry one position in all three
  streams), ``reshape_and_cache`` + ``paged_attention`` over vLLM's blocks, and
  Qwen3-Next's sigmoid output gate;
- MoE checkpoints (Qwen3.5-MoE): the routed experts on ``ops.fused_moe``, the shared
  expert a dense MLP beside it (models/moe.py).

The forward walks mlx-lm's module tree itself and never calls its ``__call__`` (no
[T, T] masks, no per-request caches).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from vllm_metal import ops
from vllm_metal.models.context import AttentionContext
from vllm_metal.models.layers import RMSNorm
from vllm_metal.models.moe import swap_moe_blocks
from vllm_metal.models.qwen3_5 import StatePool

# dense and MoE (routed experts + a shared expert on ops.fused_moe, models/moe.py)
MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")


@dataclass
class HybridContext(AttentionContext):
    """AttentionContext plus what the linear-attention layers read (built per step by
    the runner's HybridState)."""

    cu_seqlens_state: "mx.array" = None   # int32 [num_seqs + 1]: cu_seqlens_q (same rows)
    state_slots: "mx.array" = None        # int32 [num_seqs]: batch index -> state slot
    has_initial_state: "mx.array" = None  # int32 [num_seqs]: 0 = start from a zero state
    # Per layer: that layer's StatePool (linear-attention layers) or None. Pools are
    # replaced by the updated (lazy) arrays the ops return, as kv_caches are.
    state_pools: list = None
    # hybrid.StateRounds when prefix caching checkpoints a state inside a chunk: the
    # conv and the recurrence then run in passes (None: one pass over every row)
    state_rounds: object = None
    # keep_hidden: the forward also leaves the final (normed) hidden states of every row
    # in `hidden` (an MTP block reads them: mtp.py)
    keep_hidden: bool = False
    hidden: "mx.array" = None


@dataclass(frozen=True)
class StateShapes:
    """Per linear-attention layer: what one state slot holds (vLLM's MambaSpec shapes)."""

    conv: tuple[int, int]          # [conv_dim, kernel - 1], in the model dtype
    ssm: tuple[int, int, int]      # [num_v_heads, head_v_dim, head_k_dim], float32

    def slot_bytes(self, conv_itemsize: int) -> int:
        c = self.conv[0] * self.conv[1] * conv_itemsize
        return c + self.ssm[0] * self.ssm[1] * self.ssm[2] * 4


def state_shapes_of(config: dict, tensor_parallel_size: int = 1) -> StateShapes:
    """From an HF (text) config: the state one linear-attention layer keeps per request
    (on one rank of `tensor_parallel_size`: its share of the heads, tensor_parallel_qwen3_5)."""
    key_dim = config["linear_key_head_dim"] * config["linear_num_key_heads"]
    value_dim = config["linear_value_head_dim"] * config["linear_num_value_heads"]
    conv_dim = 2 * key_dim + value_dim
    return StateShapes(
        conv=(conv_dim // tensor_parallel_size, config.get("linear_conv_kernel_dim", 4) - 1),
        ssm=(config["linear_num_value_heads"] // tensor_parallel_size,
             config["linear_value_head_dim"], config["linear_key_head_dim"]))


def layer_is_linear(config: dict) -> list[bool]:
    """HF layer_types when given, else mlx-lm's rule (every interval-th layer is full)."""
    n = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types:
        if len(types) != n or set(types) - {"linear_attention", "full_attention"}:
            raise ValueError(f"[qwen3_5] unexpected layer_types {types}")
        return [t == "linear_attention" for t in types]
    interval = config.get("full_attention_interval", 4)
    return [(i + 1) % interval != 0 for i in range(n)]


class PagedGatedAttention(nn.Module):
    """Qwen3-Next attention (q_proj also yields a sigmoid gate) over the paged KV cache."""

    def __init__(self, source: nn.Module, *, layer_idx: int, rotary_dim: int, base: float,
                 sections):
        super().__init__()
        self.q_proj, self.k_proj = source.q_proj, source.k_proj
        self.v_proj, self.o_proj = source.v_proj, source.o_proj
        self.q_norm = RMSNorm.replacing(source.q_norm)
        self.k_norm = RMSNorm.replacing(source.k_norm)
        self.num_heads = source.num_attention_heads
        self.num_kv_heads = source.num_key_value_heads
        self.head_dim = source.head_dim
        self.scale = float(source.scale)
        self.layer_idx = layer_idx
        self.rotary_dim, self.base, self.sections = rotary_dim, float(base), tuple(sections)

    def __call__(self, x: mx.array, ctx: HybridContext, positions3: mx.array) -> mx.array:
        t = x.shape[0]
        qg = self.q_proj(x).reshape(t, self.num_heads, 2 * self.head_dim)
        q, gate = mx.split(qg, 2, axis=-1)                                  # [T, Hq, D] each
        k = self.k_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
        rot = dict(sections=self.sections, interleaved=True, rotary_dim=self.rotary_dim,
                   base=self.base)
        q = ops.mrope(self.q_norm(q), positions3, **rot)
        k = ops.mrope(self.k_norm(k), positions3, **rot)

        key_cache, value_cache = ctx.kv_caches[self.layer_idx]
        # in place: step N's tasks still hold the caches while step N+1 is built (async
        # scheduling), so MLX could not donate them and would copy each cache every step
        key_cache, value_cache = ops.reshape_and_cache(k, v, key_cache, value_cache,
                                                       ctx.slot_mapping, inplace=True)
        ctx.kv_caches[self.layer_idx] = (key_cache, value_cache)
        out = ops.paged_attention(
            q, key_cache, value_cache, ctx.block_tables, ctx.seq_lens, ctx.cu_seqlens_q,
            scale=self.scale, num_decode_seqs=ctx.num_decode_seqs, max_seq_len=ctx.max_seq_len,
            max_query_len=ctx.max_query_len)                                 # [T, Hq, D]
        out = out.reshape(t, -1) * mx.sigmoid(gate.reshape(t, -1))
        return self.o_proj(out)


def gated_delta_net(gdn: nn.Module, x: mx.array, ctx: HybridContext, layer_idx: int) -> mx.array:
    """mlx-lm's GatedDeltaNet (its parameters) over packed rows, state in slots."""
    t = x.shape[0]
    qkv = gdn.in_proj_qkv(x)                                                 # [T, conv_dim]
    z = gdn.in_proj_z(x).reshape(t, gdn.num_v_heads, gdn.head_v_dim)
    b, a = gdn.in_proj_b(x), gdn.in_proj_a(x)                                # [T, Hv]
    pool = ctx.state_pools[layer_idx]
    rounds = ctx.state_rounds
    if rounds is None:
        y = _recurrence(gdn, qkv, a, b, pool, ctx.cu_seqlens_state, ctx.state_slots,
                        ctx.has_initial_state)
    else:
        # Passes over pieces of the chunks, the state copied out in between (prefix-cache
        # checkpoints; the state before a request's drafts).
        # The recurrence is exact across a cut (the state carries everything), so the
        # rows come out as one pass would give them.
        ys = []
        for r in rounds.rounds:
            pick = (lambda u: u) if r.rows is None else (lambda u, rows=r.rows: u[rows])
            ys.append(_recurrence(gdn, pick(qkv), pick(a), pick(b), pool, r.cu_seqlens, r.slots,
                                  r.has_initial_state))
            for copy, src, dst in ((rounds.checkpoints, r.save_from, r.save_to),
                                   (rounds.saved, r.keep, r.keep)):
                if src is None:
                    continue
                out = copy[layer_idx]
                out.conv[dst] = pool.conv[src]
                out.ssm[dst] = pool.ssm[src]
                # the next pass (or step) updates the pool in place: after these reads
                pool.conv, pool.ssm = mx.depends([pool.conv, pool.ssm], [out.conv, out.ssm])
        y = ys[0] if rounds.order is None else mx.concatenate(ys)[rounds.order]
    out = gdn.norm(y, z)                                                     # [T, Hv, Dv]
    return gdn.out_proj(out.reshape(t, -1))


def _recurrence(gdn: nn.Module, qkv: mx.array, a: mx.array, b: mx.array, pool, cu_seqlens,
                slots, has_initial_state) -> mx.array:
    """The causal conv and the gated delta rule over packed rows; pool updated in place."""
    t = qkv.shape[0]
    meta = dict(cu_seqlens=cu_seqlens, slots=slots, has_initial_state=has_initial_state,
                inplace=True)
    conv_out, pool.conv = ops.causal_conv1d(
        qkv, gdn.conv1d.weight[:, :, 0].astype(qkv.dtype), None, conv_state=pool.conv, **meta)
    q, k, v = mx.split(conv_out, [gdn.key_dim, 2 * gdn.key_dim], axis=-1)
    y, pool.ssm = ops.gated_delta_rule(
        q.reshape(t, gdn.num_k_heads, gdn.head_k_dim),
        k.reshape(t, gdn.num_k_heads, gdn.head_k_dim),
        v.reshape(t, gdn.num_v_heads, gdn.head_v_dim),
        a, b, gdn.A_log, gdn.dt_bias, state=pool.ssm, **meta)
    return y


class PagedQwen3_5(nn.Module):
    """forward: (input_ids int32 [T], ctx: HybridContext) -> logits [len(logits_indices), vocab]."""

    def __init__(self, lm: nn.Module, config: dict):
        super().__init__()
        args = lm.args
        if getattr(args, "num_experts", 0):
            swap_moe_blocks(lm)  # dense experts on ops.fused_moe; MLX-quantized stay mlx-lm's
        self.lm = lm  # mlx-lm's qwen3_5.TextModel; parameters keep its names under "lm."
        self.is_linear = [layer.is_linear for layer in lm.model.layers]
        if self.is_linear != layer_is_linear(config):
            raise ValueError("[qwen3_5] config layer_types disagree with full_attention_interval")
        sections = (args.rope_parameters or {}).get("mrope_section", [11, 11, 10])
        rotary_dim = int(args.head_dim * args.partial_rotary_factor)
        for i, layer in enumerate(lm.model.layers):
            if not layer.is_linear:
                layer.self_attn = PagedGatedAttention(layer.self_attn, layer_idx=i,
                                                      rotary_dim=rotary_dim,
                                                      base=args.rope_theta, sections=sections)
            layer.input_layernorm = RMSNorm.replacing(layer.input_layernorm)
            layer.post_attention_layernorm = RMSNorm.replacing(layer.post_attention_layernorm)
        lm.model.norm = RMSNorm.replacing(lm.model.norm)
        self.state_shapes = state_shapes_of(config)

    @property
    def layers(self) -> list:
        return self.lm.model.layers

    def make_state_pools(self, num_slots: int, conv_dtype: mx.Dtype) -> list:
        """Per layer: a StatePool of `num_slots` slots (linear layers) or None."""
        pools = []
        for layer in self.layers:
            pools.append(StatePool(num_slots, layer.linear_attn, conv_dtype)
                         if layer.is_linear else None)
        return pools

    def __call__(self, input_ids: mx.array, ctx: HybridContext, carried=None) -> mx.array:
        """carried (pipeline parallel, a later stage): the previous stage's (h, residual)
        instead of the embedded input_ids."""
        body = self.lm.model
        pending, h = self.stage_forward(input_ids, ctx, carried)
        h = h + pending
        if getattr(ctx, "keep_hidden", False):
            ctx.hidden = body.norm(h)
            out = ctx.hidden[ctx.logits_indices]
        else:
            out = body.norm(h[ctx.logits_indices])
        if self.lm.args.tie_word_embeddings:
            return body.embed_tokens.as_linear(out)
        return self.lm.lm_head(out)

    def stage_forward(self, input_ids: mx.array, ctx: HybridContext, carried=None):
        """The layers this model holds (all of them, or a pipeline stage's:
        models/pipeline_parallel.py). The first stage embeds input_ids; a later one takes
        the previous stage's (h, residual). Returns (the last layer's MLP output, the
        stream it is still to be added to), as the llama family's stage_forward does."""
        if carried is None:
            stream, pending = self.lm.model.embed_tokens(input_ids), None   # [T, hidden]
        else:
            pending, stream = carried
        t = input_ids.shape[0]
        positions3 = mx.broadcast_to(ctx.positions[None], (3, t))            # text: t = h = w
        for i, layer in enumerate(self.layers):
            if pending is not None:
                stream = stream + pending
            x = layer.input_layernorm(stream)
            if layer.is_linear:
                r = gated_delta_net(layer.linear_attn, x, ctx, i)
            else:
                r = layer.self_attn(x, ctx, positions3)
            stream = stream + r
            pending = layer.mlp(layer.post_attention_layernorm(stream))
        return pending, stream
