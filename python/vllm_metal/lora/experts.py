"""LoRA on the routed experts of a sparse-MoE layer (PEFT modules
`layers.N.mlp.experts.E.{gate,up,down}_proj`, vLLM's per-expert names).

The fused MoE ops have no place to add a delta between an expert's gate/up matmuls and
its activation, so a step whose rows carry adapters runs the layer per op instead
(`LoraMoeBlock`): the router's top-k on the host, then, expert by expert, that expert's
rows through gate / up (+ ops.lora_apply, each row its own slot), SwiGLU, down
(+ ops.lora_apply), weighted by the routing weight and added back to the token. Steps
without adapters, and layers no loaded adapter targets, run the block as it is.

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


class _ExpertMatmuls:
    """x @ W_e.T for one expert's gate / up / down, whatever form the weights are in."""

    def __init__(self, switch_mlp: nn.Module, dims: dict):
        self.sw = switch_mlp
        self.dims = dims  # proj -> (in, out)

    def rounds(self, experts: list):
        """Groups of experts whose weights can be read together (streamed: a pool's worth,
        loaded into the cache before the group runs)."""
        streamed = getattr(self.sw, "streamed", None)
        if streamed is None:
            yield experts
            return
        pool = streamed.pool
        for start in range(0, len(experts), pool.slots):
            chunk = experts[start:start + pool.slots]
            streamed._load(chunk, {(streamed.layer, e) for e in chunk})
            yield chunk

    def __call__(self, i: int, e: int, x: mx.array) -> mx.array:
        sw, proj = self.sw, PROJS[i]
        streamed = getattr(sw, "streamed", None)
        if streamed is not None:
            w = streamed.pool.arrays[i][streamed.pool.lru[(streamed.layer, e)]]
            if streamed.gguf_types is None:
                return x @ w.T
            cols, rows = self.dims[proj]
            return ops.gguf_matmul(x, w, streamed.gguf_types[i], (rows, cols), exact=streamed.exact)
        p = getattr(sw, proj)
        if hasattr(p, "type_id"):  # GGUFExperts: [E, rows, cols] in blocks
            blocks = p.weight.reshape(p.num_experts, -1)[e]
            return ops.gguf_matmul(x, blocks, p.type_id, (p.rows, p.cols), exact=sw.exact)
        if "scales" in p:  # mlx-lm QuantizedSwitchLinear
            biases = p.get("biases")
            y = mx.quantized_matmul(x, p["weight"][e], p["scales"][e],
                                    None if biases is None else biases[e], transpose=True,
                                    group_size=p.group_size, bits=p.bits, mode=p.mode)
        else:
            y = x @ p["weight"][e].T
        if "bias" in p:
            y = y + p["bias"][e]
        return y


class LoraMoeBlock(nn.Module):
    """Stands where a sparse-MoE block was; runs it as it is unless this step has rows with
    adapters and some slot holds expert weights of this layer."""

    def __init__(self, block: nn.Module, slots: ExpertLoraSlots, step, *, top_k: int,
                 renormalize: bool, scoring: str):
        super().__init__()
        self.block = block
        object.__setattr__(self, "_slots", slots)
        object.__setattr__(self, "_step", step)
        self.top_k, self.renormalize, self.scoring = int(top_k), bool(renormalize), scoring

    def __call__(self, x: mx.array) -> mx.array:
        row_slot = self._step.row_slot
        if row_slot is None or self._slots.arrays is None:
            return self.block(x)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        y = self._routed(x, row_slot)
        block = self.block
        if "shared_expert" in block:  # its projections are LoraLinear: adapters apply there
            y = y + mx.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        return y.reshape(shape)

    def _routed(self, x: mx.array, row_slot: mx.array) -> mx.array:
        # the top-k and weights as the fused op computes them
        ids, p = routing_weights(self.block.gate(x), self.top_k, self.scoring, self.renormalize)
        mx.eval(ids)
        ids_np = np.array(ids).reshape(-1)
        tok_np = np.repeat(np.arange(x.shape[0]), self.top_k)
        p = p.reshape(-1).astype(x.dtype)
        arrays = self._slots.arrays
        mm = _ExpertMatmuls(self.block.switch_mlp, self._slots.dims)
        out = mx.zeros(x.shape, dtype=x.dtype)
        for chunk in mm.rounds(sorted(set(ids_np.tolist()))):
            for e in chunk:
                pairs = np.flatnonzero(ids_np == e)
                tok = mx.array(tok_np[pairs].astype(np.int32))
                xe, slot = x[tok], row_slot[tok]

                def proj(i, inp):
                    a, b, s = arrays[PROJS[i]]
                    return ops.lora_apply(mm(i, e, inp), inp, lora_a=a[e], lora_b=b[e],
                                          scale=s[e], row_slot=slot)

                h = nn.silu(proj(0, xe)) * proj(1, xe)
                d = proj(2, h) * p[mx.array(pairs.astype(np.int32))][:, None]
                out = out.at[tok].add(d)
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
