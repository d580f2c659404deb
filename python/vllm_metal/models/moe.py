"""Sparse mixture-of-experts MLP blocks run on ops.fused_moe.

`swap_moe_blocks(lm)` replaces, in place, every mlx-lm Qwen3-MoE style block (a
router `gate` linear and a `switch_mlp` SwitchGLU of stacked expert weights
[E, I, H] / [E, H, I]) by `FusedMoeBlock`, which keeps those children and so
their parameter names. Blocks whose experts are MLX-quantized keep mlx-lm's
module (gather_qmm): fused_moe takes dense experts.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from vllm_metal import ops

# mlx-lm module -> (router scoring, attribute holding norm_topk_prob or None = always)
_MOE_BLOCKS = {
    "Qwen3MoeSparseMoeBlock": ("softmax", "norm_topk_prob"),
}


class FusedMoeBlock(nn.Module):
    """x [T, hidden] -> sum over the top_k experts of p_e * SwiGLU_e(x)."""

    def __init__(self, gate: nn.Module, switch_mlp: nn.Module, *, top_k: int, renormalize: bool,
                 scoring: str):
        super().__init__()
        self.gate = gate
        self.switch_mlp = switch_mlp
        self.top_k = int(top_k)
        self.renormalize = bool(renormalize)
        self.scoring = scoring

    @classmethod
    def replacing(cls, block: nn.Module) -> "FusedMoeBlock":
        scoring, norm_attr = _MOE_BLOCKS[type(block).__name__]
        renormalize = bool(getattr(block, norm_attr)) if norm_attr else True
        return cls(block.gate, block.switch_mlp, top_k=block.top_k, renormalize=renormalize,
                   scoring=scoring)

    def __call__(self, x: mx.array) -> mx.array:
        sw = self.switch_mlp
        logits = self.gate(x)
        return ops.fused_moe(x, logits, sw.gate_proj.weight, sw.up_proj.weight,
                             sw.down_proj.weight, top_k=self.top_k,
                             renormalize=self.renormalize, scoring=self.scoring)


def _dense_experts(block: nn.Module) -> bool:
    sw = block.switch_mlp
    projs = [sw.gate_proj, sw.up_proj, sw.down_proj]
    if getattr(sw, "activation", None) is not None and type(sw.activation).__name__ != "SwiGLU":
        return False
    return all("scales" not in p and "bias" not in p and mx.issubdtype(p.weight.dtype, mx.floating)
               for p in projs)


def swap_moe_blocks(lm: nn.Module) -> int:
    """Swap the supported MoE blocks of an mlx-lm model; returns how many."""
    n = 0
    for layer in lm.model.layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and type(mlp).__name__ in _MOE_BLOCKS and _dense_experts(mlp):
            layer.mlp = FusedMoeBlock.replacing(mlp)
            n += 1
    return n
