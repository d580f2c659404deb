"""Sparse mixture-of-experts MLP blocks run on ops.fused_moe.

`swap_moe_blocks(lm)` replaces, in place, every mlx-lm Qwen3-MoE style block (a
router `gate` linear and a `switch_mlp` SwitchGLU of stacked expert weights
[E, I, H] / [E, H, I]) by `FusedMoeBlock`, which keeps those children and so
their parameter names. Qwen3-Next / Qwen3.5-MoE blocks add a shared expert (a dense
MLP run beside the op) scaled by sigmoid(shared_expert_gate(x)). Blocks whose experts
are MLX-quantized keep mlx-lm's module (gather_qmm). GGUF experts (llama.cpp's
ffn_*_exps, kept in block form) are installed by `install_expert_blocks` as
GGUFSwitchGLU and run on ops.fused_moe_gguf. With --additional-config moe_expert_offload,
switch_mlp is an expert_offload.StreamedSwitchGLU: the experts stream from disk through
a bounded cache (expert_cache.py) and the same ops run on its slots.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from vllm_metal import ops

# mlx-lm module -> (router scoring, attribute holding norm_topk_prob or None = always)
_MOE_BLOCKS = {
    "Qwen3MoeSparseMoeBlock": ("softmax", "norm_topk_prob"),
    "Qwen3NextSparseMoeBlock": ("softmax", "norm_topk_prob"),  # Qwen3.5-MoE: + shared expert
    "OlmoeSparseMoeBlock": ("softmax", "norm_topk_prob"),
}


class FusedMoeBlock(nn.Module):
    """x [T, hidden] -> sum over the top_k experts of p_e * SwiGLU_e(x), plus
    sigmoid(shared_expert_gate(x)) * shared_expert(x) when the block has a shared expert."""

    def __init__(self, gate: nn.Module, switch_mlp: nn.Module, *, top_k: int, renormalize: bool,
                 scoring: str, shared_expert: nn.Module | None = None,
                 shared_expert_gate: nn.Module | None = None):
        super().__init__()
        self.gate = gate
        self.switch_mlp = switch_mlp
        self.top_k = int(top_k)
        self.renormalize = bool(renormalize)
        self.scoring = scoring
        if (shared_expert is None) != (shared_expert_gate is None):
            raise ValueError("[vllm-metal] a shared expert needs its shared_expert_gate")
        if shared_expert is not None:
            self.shared_expert = shared_expert
            self.shared_expert_gate = shared_expert_gate

    @classmethod
    def replacing(cls, block: nn.Module) -> "FusedMoeBlock":
        scoring, norm_attr = _MOE_BLOCKS[type(block).__name__]
        renormalize = bool(getattr(block, norm_attr)) if norm_attr else True
        return cls(block.gate, block.switch_mlp, top_k=block.top_k, renormalize=renormalize,
                   scoring=scoring, shared_expert=getattr(block, "shared_expert", None),
                   shared_expert_gate=getattr(block, "shared_expert_gate", None))

    def __call__(self, x: mx.array) -> mx.array:
        y = self._routed(x)
        if "shared_expert" in self:
            y = y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y

    def _routed(self, x: mx.array) -> mx.array:
        sw = self.switch_mlp
        logits = self.gate(x)
        if _is_streamed(sw):  # experts on disk, through the expert cache (expert_offload.py)
            return sw.run(x, logits, top_k=self.top_k, scoring=self.scoring,
                          renormalize=self.renormalize)
        if isinstance(sw, GGUFSwitchGLU):
            g, u, d = sw.gate_proj, sw.up_proj, sw.down_proj
            return ops.fused_moe_gguf(x, logits, g.weight, g.type_id, u.weight, u.type_id, d.weight,
                                      d.type_id, inter=g.rows, top_k=self.top_k,
                                      renormalize=self.renormalize, scoring=self.scoring,
                                      exact=sw.exact)
        return ops.fused_moe(x, logits, sw.gate_proj.weight, sw.up_proj.weight,
                             sw.down_proj.weight, top_k=self.top_k,
                             renormalize=self.renormalize, scoring=self.scoring)


class GGUFExperts(nn.Module):
    """One stacked expert tensor [E, rows, cols] in GGUF block form (`weight`: its bytes)."""

    def __init__(self, blocks: mx.array, type_id: int, shape):
        super().__init__()
        self.weight = blocks
        self.type_id = int(type_id)
        self.num_experts, self.rows, self.cols = (int(d) for d in shape)


class GGUFSwitchGLU(nn.Module):
    """mlx-lm's SwitchGLU parameter names over GGUF expert blocks."""

    def __init__(self, gate_proj: GGUFExperts, up_proj: GGUFExperts, down_proj: GGUFExperts):
        super().__init__()
        self.gate_proj = gate_proj
        self.up_proj = up_proj
        self.down_proj = down_proj
        # float32 activations (CPU), as GGUFLinear's default; gguf_linear.set_exact_activations
        # switches both to 8-bit rounded ones (VLLM_METAL_INT8_ACTIVATIONS)
        self.exact = True


_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def install_expert_blocks(lm: nn.Module, weights: dict) -> dict:
    """Swap every switch_mlp whose three expert tensors are block-form GGUF weights
    (values with blocks / type_id / shape) for a GGUFSwitchGLU holding them; returns
    `weights` with those blocks as plain arrays (for load_weights(strict=True)).
    An expert tensor that is not [E, rows, cols] is refused, naming it."""
    out = dict(weights)
    for i, layer in enumerate(lm.model.layers):
        prefix = f"model.layers.{i}.mlp.switch_mlp"
        names = [f"{prefix}.{p}.weight" for p in _EXPERT_PROJS]
        found = [weights.get(n) for n in names]
        if not any(f is not None and not isinstance(f, mx.array) for f in found):
            continue
        if not all(f is not None and not isinstance(f, mx.array) for f in found):
            raise ValueError(f"[vllm-metal] {prefix}: expert tensors must all be in GGUF block "
                             f"form or all dense")
        for n, f in zip(names, found):
            if len(f.shape) != 3:
                raise ValueError(f"[vllm-metal] GGUF expert tensor for {n} must be [experts, rows, "
                                 f"cols], got shape {tuple(f.shape)}")
        experts = [GGUFExperts(f.blocks, f.type_id, f.shape) for f in found]
        layer.mlp.switch_mlp = GGUFSwitchGLU(*experts)
        for n, f in zip(names, found):
            out[n] = f.blocks
    return out


def _is_streamed(sw: nn.Module) -> bool:
    return type(sw).__name__ in ("StreamedSwitchGLU", "StreamedBiasedSwitchGLU")


def _dense_experts(block: nn.Module) -> bool:
    sw = block.switch_mlp
    if isinstance(sw, GGUFSwitchGLU) or _is_streamed(sw):
        return True
    projs = [sw.gate_proj, sw.up_proj, sw.down_proj]
    if getattr(sw, "activation", None) is not None and type(sw.activation).__name__ != "SwiGLU":
        return False
    return all("scales" not in p and "bias" not in p and mx.issubdtype(p.weight.dtype, mx.floating)
               for p in projs)


class GptOssMoeBlock(nn.Module):
    """gpt-oss's MLP (mlx-lm gpt_oss.MLPBlock: `router` linear with bias, `experts` SwitchGLU
    with biases) on ops.fused_moe: softmax over the top-k router logits, expert biases, the
    clamped SwiGLU. Keeps mlx-lm's parameter names."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.router = block.router
        self.experts = block.experts
        self.top_k = int(block.num_experts_per_tok)

    def __call__(self, x: mx.array) -> mx.array:
        sw = self.experts
        if _is_streamed(sw):  # experts on disk (expert_offload.StreamedBiasedSwitchGLU)
            return sw.run(x, self.router(x), top_k=self.top_k, scoring="softmax_topk",
                          renormalize=False)
        g, u, d = sw.gate_proj, sw.up_proj, sw.down_proj
        kw = dict(top_k=self.top_k, renormalize=False, scoring="softmax_topk",
                  activation="swiglu_oai", b_gate=g.bias, b_up=u.bias, b_down=d.bias)
        if isinstance(sw, GGUFSwitchGLU):  # MXFP4 experts (models/gpt_oss.py)
            return ops.fused_moe_gguf(x, self.router(x), g.weight, g.type_id, u.weight, u.type_id,
                                      d.weight, d.type_id, inter=g.rows, exact=sw.exact, **kw)
        return ops.fused_moe(x, self.router(x), g.weight, u.weight, d.weight, **kw)


def _gpt_oss_block(mlp: nn.Module) -> bool:
    if type(mlp).__module__ != "mlx_lm.models.gpt_oss" or type(mlp).__name__ != "MLPBlock":
        return False
    if isinstance(mlp.experts, GGUFSwitchGLU) or _is_streamed(mlp.experts):
        return True
    projs = [mlp.experts.gate_proj, mlp.experts.up_proj, mlp.experts.down_proj]
    return all("scales" not in p and mx.issubdtype(p.weight.dtype, mx.floating) for p in projs)


def swap_moe_blocks(lm: nn.Module) -> int:
    """Swap the supported MoE blocks of an mlx-lm model; returns how many."""
    n = 0
    for layer in lm.model.layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and _gpt_oss_block(mlp):
            layer.mlp = GptOssMoeBlock(mlp)
            n += 1
        elif mlp is not None and type(mlp).__name__ in _MOE_BLOCKS and _dense_experts(mlp):
            layer.mlp = FusedMoeBlock.replacing(mlp)
            n += 1
    return n
