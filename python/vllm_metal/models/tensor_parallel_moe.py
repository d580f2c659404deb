"""Tensor parallelism for a mixture-of-experts block (models/moe.FusedMoeBlock): every rank
keeps every expert, each with a slice of its intermediate columns.

The router stays whole, so every rank picks the same experts with the same weights for a
token. Each expert's gate/up keep the rank's rows and its down projection the matching
input columns, as a dense gated MLP splits (tensor_parallel.shard_gated_mlp); a shared
expert splits the same way, and its sigmoid gate stays whole (a per-token scalar times a
partial sum is a partial sum). The block's output, routed plus shared, is then a partial
sum on each rank, summed over the group once per layer (AllSumMoe). The fused op runs
unchanged on the narrower experts (ops.fused_moe / fused_moe_gguf take `inter` from them).

Not split: streamed experts (the expert cache reads whole experts from disk),
MLX-quantized experts, and experts with biases (gpt-oss).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from vllm_metal.models.moe import FusedMoeBlock, GGUFExperts, GGUFSwitchGLU, _is_streamed
from vllm_metal.models.tensor_parallel import (TensorParallelError, block_bytes, column_slice,
                                               row_slice)


class AllSumMoe(nn.Module):
    """A split MoE block whose partial output is summed over `group`."""

    def __init__(self, inner: FusedMoeBlock, group):
        super().__init__()
        self.inner = inner
        self._group = group  # underscore: nn.Module would otherwise treat it as a child

    def __call__(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(self.inner(x), group=self._group)


def expert_columns(block: FusedMoeBlock) -> int:
    """Each routed expert's intermediate size."""
    sw = block.switch_mlp
    return sw.gate_proj.rows if isinstance(sw, GGUFSwitchGLU) else sw.gate_proj.weight.shape[1]


def _slice_experts(proj, start: int, stop: int, *, columns: bool, name: str) -> None:
    """Rows (gate/up) or input columns (down) [start, stop) of every expert."""
    if isinstance(proj, GGUFExperts):
        # the file's bytes, one row of blocks per (expert, row): [E * rows, row_bytes]
        w = proj.weight.reshape(proj.num_experts, proj.rows, -1)
        if not columns:
            proj.weight = mx.contiguous(w[:, start:stop]).reshape(-1, w.shape[2])
            proj.rows = stop - start
            return
        first, last = block_bytes(proj.type_id, start, stop, proj.cols, name)
        kept = w[:, :, first:last]
        proj.weight = mx.contiguous(kept).reshape(-1, kept.shape[2])
        proj.cols = stop - start
        return
    if type(proj).__name__ != "SwitchLinear" or "bias" in proj:
        raise TensorParallelError(f"{name}: {type(proj).__name__} experts"
                                  f"{' with biases' if 'bias' in proj else ''} cannot be split "
                                  "(MLX-quantized or biased experts); use --pipeline-parallel-size")
    w = proj.weight  # [E, out, in]
    proj.weight = mx.contiguous(w[:, :, start:stop] if columns else w[:, start:stop])


def shard_moe_block(block: FusedMoeBlock, rank: int, size: int, group, where: str) -> AllSumMoe:
    """Cuts `block` to rank `rank`'s columns of every expert (and of its shared expert), in
    place; returns it wrapped in the all-sum that completes its output."""
    sw = block.switch_mlp
    if _is_streamed(sw):
        raise TensorParallelError(f"{where}: streamed experts (moe_expert_offload) cannot be split")
    for what, n in (("expert columns (moe_intermediate_size)", expert_columns(block)),
                    *((("shared-expert columns", _shared_columns(block)),) if "shared_expert" in block else ())):
        if n % size:
            raise TensorParallelError(f"--tensor-parallel-size {size} does not divide the model's "
                                      f"{n} {what}")
    cols = expert_columns(block) // size
    lo, hi = rank * cols, (rank + 1) * cols
    _slice_experts(sw.gate_proj, lo, hi, columns=False, name=f"{where} experts gate_proj")
    _slice_experts(sw.up_proj, lo, hi, columns=False, name=f"{where} experts up_proj")
    _slice_experts(sw.down_proj, lo, hi, columns=True, name=f"{where} experts down_proj")
    if "shared_expert" in block:
        shared = block.shared_expert
        cols = _shared_columns(block) // size
        lo, hi = rank * cols, (rank + 1) * cols
        row_slice(shared.gate_proj, lo, hi, f"{where} shared_expert gate_proj")
        row_slice(shared.up_proj, lo, hi, f"{where} shared_expert up_proj")
        column_slice(shared.down_proj, lo, hi, f"{where} shared_expert down_proj")
    return AllSumMoe(block, group)


def _shared_columns(block: FusedMoeBlock) -> int:
    down = block.shared_expert.down_proj
    return down.in_features if hasattr(down, "in_features") else down.weight.shape[1]
