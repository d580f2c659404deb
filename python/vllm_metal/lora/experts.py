"""LoRA on the routed experts of a sparse-MoE layer (PEFT modules
`layers.N.mlp.experts.E.{gate,up,down}_proj`, vLLM's per-expert names).

The fused MoE ops have no place to add a delta between an expert's gate/up matmuls and
its activation, so a step in which some row's adapter holds expert weights of a layer runs
that layer per op instead (`LoraMoeBlock`): the router's top-k on the host, then all
(token, expert) pairs at once, sorted by expert, through gate / up (each + one
ops.lora_apply over (expert, adapter slot) pairs), SwiGLU, down (+ ops.lora_apply),
weighted by the routing weight and added back to the token. Other steps (no adapter,
adapters without expert weights here) run the block as it is.

The expert weights are read where they are, in every form the MoE blocks hold them:
dense or MLX-quantized SwitchLinear (mlx-lm), GGUF blocks (GGUFExperts), and streamed
experts (expert_offload), whose slots are filled through the expert cache in rounds of
at most the pool's size, as StreamedExperts.run does.

Slot buffers per projection: A [E, S, R, in], B [E, S, out, R], scale [E, S]
(S = --max-loras, R = --max-lora-rank), allocated when an adapter with expert weights
is first written (vLLM sizes its MoE LoRA buffers the same way).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from vllm_metal import ops
from vllm_metal.models.expert_cache import routing_weights

PROJS = ("gate_proj", "up_proj", "down_proj")


def expert_key(expert: int, proj: str) -> str:
    """The adapter-weights key of one expert's projection (adapter.py parses the same)."""
    return f"experts.{expert}.{proj}"


class ExpertLoraSlots:
    """One MoE layer's per-expert slot buffers for gate / up / down."""

    def __init__(self, layer: int, num_experts: int, hidden: int, inter: int, slots: int,
                 rank: int, dtype: mx.Dtype):
        self.layer = layer
        self.num_experts, self.slots, self.rank, self.dtype = num_experts, slots, rank, dtype
        self.dims = {"gate_proj": (hidden, inter), "up_proj": (hidden, inter),
                     "down_proj": (inter, hidden)}  # (in, out)
        self._host = None  # proj -> (A, B, scale) float32, allocated on first use
        self.arrays = None  # proj -> (A, B, scale) on the device, or None: no expert adapter
        self.filled: set = set()  # slots holding some expert weights of this layer

    def shapes(self) -> dict:
        """(layer, key) -> (in, out) for the adapter checks."""
        return {(self.layer, expert_key(e, p)): self.dims[p]
                for e in range(self.num_experts) for p in PROJS}

    def write_slot(self, slot: int, weights: dict | None) -> None:
        """weights: the adapter's (layer, key) -> (A, B, scale), or None (slot emptied)."""
        mine = {} if weights is None else {
            (e, p): weights[(self.layer, expert_key(e, p))]
            for e in range(self.num_experts) for p in PROJS
            if (self.layer, expert_key(e, p)) in weights}
        if self._host is None:
            if not mine:
                return
            self._host = {p: (np.zeros((self.num_experts, self.slots, self.rank, i), np.float32),
                              np.zeros((self.num_experts, self.slots, o, self.rank), np.float32),
                              np.zeros((self.num_experts, self.slots), np.float32))
                          for p, (i, o) in self.dims.items()}
        for a_host, b_host, s_host in self._host.values():
            a_host[:, slot] = 0
            b_host[:, slot] = 0
            s_host[:, slot] = 0
        self.filled.discard(slot)
        if mine:
            self.filled.add(slot)
        for (e, p), (a, b, scale) in mine.items():
            a_host, b_host, s_host = self._host[p]
            r = a.shape[0]
            a_host[e, slot, :r] = a
            b_host[e, slot, :, :r] = b
            s_host[e, slot] = scale

    def sync(self) -> None:
        if self._host is None:
            return
        if not any(s.any() for _, _, s in self._host.values()):
            self.arrays = None  # no slot holds expert weights of this layer
            return
        self.arrays = {p: (mx.array(a).astype(self.dtype), mx.array(b).astype(self.dtype),
                           mx.array(s)) for p, (a, b, s) in self._host.items()}

    @property
    def stacked(self) -> dict:
        """proj -> (A [E * S, R, in], B [E * S, out, R], scale [E * S]): slot e * S + s is
        expert e's weights of adapter slot s, the layout ops.lora_apply takes."""
        n = self.num_experts * self.slots
        return {p: (a.reshape(n, *a.shape[2:]), b.reshape(n, *b.shape[2:]), sc.reshape(n))
                for p, (a, b, sc) in self.arrays.items()}


class _ExpertMatmuls:
    """x_j @ W_{e_j}.T for (row, expert) pairs j, whatever form the expert weights are in."""

    def __init__(self, switch_mlp: nn.Module, dims: dict):
        self.sw = switch_mlp
        self.dims = dims  # proj -> (in, out)
        self.streamed = getattr(switch_mlp, "streamed", None)

    def rounds(self, experts: list):
        """Groups of experts whose weights can be read together (streamed: a pool's worth,
        loaded into the cache before the group runs)."""
        streamed = self.streamed
        if streamed is None:
            yield experts
            return
        pool = streamed.pool
        for start in range(0, len(experts), pool.slots):
            chunk = experts[start:start + pool.slots]
            streamed._load(chunk, {(streamed.layer, e) for e in chunk})
            yield chunk

    def __call__(self, i: int, x: mx.array, eids: np.ndarray) -> mx.array:
        """x [n, in], eids [n] (host) -> [n, out]."""
        streamed, proj = self.streamed, PROJS[i]
        if streamed is not None:  # the experts' slots in the pool (rounds() loaded them)
            pool = streamed.pool
            slot_of = {e: pool.lru[(streamed.layer, e)] for e in set(eids.tolist())}
            slots = np.array([slot_of[e] for e in eids.tolist()], np.int32)
            if streamed.gguf_types is None:
                return _gather_mm(x, pool.arrays[i], slots)
            cols, rows = self.dims[proj]
            return _per_expert(x, slots, lambda xe, s: ops.gguf_matmul(
                xe, pool.arrays[i][s], streamed.gguf_types[i], (rows, cols), exact=streamed.exact))
        p = getattr(self.sw, proj)
        if hasattr(p, "type_id"):  # GGUFExperts: [E, rows, cols] in blocks, no gathered op
            blocks = p.weight.reshape(p.num_experts, -1)
            return _per_expert(x, eids, lambda xe, e: ops.gguf_matmul(
                xe, blocks[e], p.type_id, (p.rows, p.cols), exact=self.sw.exact))
        if "scales" in p:  # mlx-lm QuantizedSwitchLinear
            y = mx.gather_qmm(x[:, None, :], p["weight"], p["scales"], p.get("biases"),
                              rhs_indices=mx.array(eids.astype(np.int32)), transpose=True,
                              group_size=p.group_size, bits=p.bits, mode=p.mode,
                              sorted_indices=_ascending(eids))[:, 0]
        else:
            y = _gather_mm(x, p["weight"], eids)
        if "bias" in p:
            y = y + p["bias"][mx.array(eids.astype(np.int32))]
        return y


def _gather_mm(x: mx.array, w: mx.array, idx: np.ndarray) -> mx.array:
    """x [n, in] @ w[idx[j]].T per row, w [E, out, in]."""
    return mx.gather_mm(x[:, None, :], w.swapaxes(-1, -2), rhs_indices=mx.array(idx.astype(np.int32)),
                        sorted_indices=_ascending(idx))[:, 0]


def _ascending(idx: np.ndarray) -> bool:
    return bool(np.all(idx[1:] >= idx[:-1]))


def _per_expert(x: mx.array, idx: np.ndarray, matmul) -> mx.array:
    """matmul(x rows of one index, index) per distinct index, rows put back in order."""
    order = np.argsort(idx, kind="stable")
    parts, start = [], 0
    sorted_idx = idx[order]
    while start < len(order):
        stop = int(np.searchsorted(sorted_idx, sorted_idx[start], side="right"))
        parts.append(matmul(x[mx.array(order[start:stop].astype(np.int32))], int(sorted_idx[start])))
        start = stop
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return mx.concatenate(parts)[mx.array(inverse.astype(np.int32))]


class LoraMoeBlock(nn.Module):
    """Stands where a sparse-MoE block was; runs it as it is unless a row of this step has
    an adapter holding expert weights of this layer."""

    def __init__(self, block: nn.Module, slots: ExpertLoraSlots, step, *, top_k: int,
                 renormalize: bool, scoring: str):
        super().__init__()
        self.block = block
        object.__setattr__(self, "_slots", slots)
        object.__setattr__(self, "_step", step)
        self.top_k, self.renormalize, self.scoring = int(top_k), bool(renormalize), scoring

    def __call__(self, x: mx.array) -> mx.array:
        step, slots = self._step, self._slots
        if step.row_slot is None or slots.arrays is None or not slots.filled & step.slots:
            return self.block(x)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        y = self._routed(x, step.row_slot)
        block = self.block
        if "shared_expert" in block:  # its projections are LoraLinear: adapters apply there
            y = y + mx.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        return y.reshape(shape)

    def _routed(self, x: mx.array, row_slot: mx.array) -> mx.array:
        """All (token, expert) pairs at once: each projection one gathered mat-mul (or one
        per expert for GGUF blocks) and one ops.lora_apply whose slots are (expert, adapter
        slot) pairs of the stacked buffers [E * S, ...]."""
        # the top-k and weights as the fused op computes them
        ids, p = routing_weights(self.block.gate(x), self.top_k, self.scoring, self.renormalize)
        mx.eval(ids)
        eids = np.array(ids).reshape(-1)
        order = np.argsort(eids, kind="stable")  # pairs grouped by expert: each read once
        eids, toks = eids[order], np.repeat(np.arange(x.shape[0]), self.top_k)[order]
        p = p.reshape(-1)[mx.array(order.astype(np.int32))].astype(x.dtype)
        rows = row_slot[mx.array(toks.astype(np.int32))]  # each pair's adapter slot
        pair_slot = mx.where(rows >= 0, mx.array(eids.astype(np.int32)) * self._slots.slots + rows, -1)
        buffers = self._slots.stacked
        mm = _ExpertMatmuls(self.block.switch_mlp, self._slots.dims)
        out = mx.zeros(x.shape, dtype=x.dtype)
        for chunk in mm.rounds(sorted(set(eids.tolist()))):
            sel = np.flatnonzero(np.isin(eids, chunk)) if mm.streamed is not None \
                else np.arange(len(eids))
            sel_mx = mx.array(sel.astype(np.int32))
            tok = mx.array(toks[sel].astype(np.int32))
            xs, e_sel, slot = x[tok], eids[sel], pair_slot[sel_mx]

            def proj(i, inp):
                a, b, scale = buffers[PROJS[i]]
                return ops.lora_apply(mm(i, inp, e_sel), inp, lora_a=a, lora_b=b, scale=scale,
                                      row_slot=slot)

            h = nn.silu(proj(0, xs)) * proj(1, xs)
            out = out.at[tok].add(proj(2, h) * p[sel_mx][:, None])
            mx.eval(out)  # a streamed round's slots are rewritten by the next
        return out


def _moe_block_params(block: nn.Module):
    """(top_k, renormalize, scoring) of a sparse-MoE block we can run per op, else None."""
    from vllm_metal.models.moe import _MOE_BLOCKS, FusedMoeBlock

    if isinstance(block, FusedMoeBlock):
        return block.top_k, block.renormalize, block.scoring
    kind = _MOE_BLOCKS.get(type(block).__name__)  # mlx-lm's block, kept for MLX-quantized experts
    if kind is None or not hasattr(block, "switch_mlp"):
        return None
    scoring, norm_attr = kind
    return int(block.top_k), bool(getattr(block, norm_attr)) if norm_attr else True, scoring


def _inter(switch_mlp: nn.Module) -> int:
    """The experts' intermediate size (rows of gate_proj)."""
    streamed = getattr(switch_mlp, "streamed", None)
    if streamed is not None:
        spec = streamed.pool.projs[0]
        return int(streamed.inter) if streamed.gguf_types is not None else int(spec.shape[0])
    g = switch_mlp.gate_proj
    return int(g.rows) if hasattr(g, "type_id") else int(g["weight"].shape[1])


def wrap_moe_block(layer: nn.Module, index: int, slots: int, rank: int, dtype: mx.Dtype,
                   step) -> "ExpertLoraSlots | None":
    """Replaces layer.mlp by a LoraMoeBlock when it is a sparse-MoE block with SwiGLU
    experts (Qwen3-MoE, OLMoE, Qwen3.5-MoE); returns its slot buffers, else None
    (gpt-oss's experts take no adapters: its PEFT adapters use fused 3D expert tensors)."""
    block = getattr(layer, "mlp", None)
    params = None if block is None else _moe_block_params(block)
    if params is None:
        return None
    top_k, renormalize, scoring = params
    from vllm_metal.lora.layers import _dims

    hidden, num_experts = _dims(block.gate)
    slots_ = ExpertLoraSlots(index, num_experts, hidden, _inter(block.switch_mlp), slots, rank,
                             dtype)
    layer.mlp = LoraMoeBlock(block, slots_, step, top_k=top_k, renormalize=renormalize,
                             scoring=scoring)
    return slots_
