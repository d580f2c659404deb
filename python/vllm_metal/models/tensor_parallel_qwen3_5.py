"""Tensor parallelism for Qwen3.5 (hybrid: gated delta net + gated full attention): one
rank's shard of a loaded PagedQwen3_5 (models/tensor_parallel.py does the llama family).

Each rank keeps whole heads, so every per-head op runs unchanged on fewer heads:
- full attention: the rows of q_proj (each head's q and its output gate, [Hq, 2D]) and of
  k_proj / v_proj for its heads; q/k norms are per head and stay whole; o_proj keeps the
  heads' input columns and all-sums over the group;
- gated delta net: the rank's key heads and the value heads they serve (HF's grouped
  order: value head j reads key head j // (Hv / Hk), so both are contiguous ranges). In
  in_proj_qkv and the conv1d channels that is three ranges (q, k, v); in_proj_z, in_proj_b,
  in_proj_a, A_log and dt_bias one. The gated RMSNorm's weight is per head dim (whole);
  out_proj keeps the value heads' input columns and all-sums. The state pools the runner
  makes from the layer (StatePool) then hold only the rank's heads;
- the dense MLP: gate/up columns and down_proj rows, as the llama family's; Qwen3.5-MoE's
  blocks: every expert's columns, the shared expert's too (tensor_parallel_moe.py).
GGUF weights loaded in HF head order (gguf_qwen35.py) split the same way; a column split
through a GGUF block is refused naming the tensor (tensor_parallel.column_slice).
"""

from __future__ import annotations

import mlx.core as mx

from vllm_metal.models.moe import FusedMoeBlock
from vllm_metal.models.tensor_parallel import (AllSumLinear, TensorParallelError, column_slice,
                                               mlp_columns, row_ranges, row_slice,
                                               shard_gated_mlp)
from vllm_metal.models.tensor_parallel_moe import shard_moe_block


def check_divisible(loaded, size: int) -> None:
    """Refuses a size that does not divide every kind of head or the MLP columns."""
    args = loaded.model.lm.args
    # Qwen3.5-MoE: its experts' columns are checked when each block is split
    mlp = () if getattr(args, "num_experts", 0) else (("MLP columns (intermediate_size)",
                                                       args.intermediate_size),)
    for what, n in (("attention heads", args.num_attention_heads),
                    ("KV heads", args.num_key_value_heads),
                    ("linear-attention key heads (linear_num_key_heads)", args.linear_num_key_heads),
                    ("linear-attention value heads (linear_num_value_heads)",
                     args.linear_num_value_heads), *mlp):
        if n % size:
            raise TensorParallelError(f"--tensor-parallel-size {size} does not divide the model's "
                                      f"{n} {what}")


def shard_attention(attn, rank: int, size: int, group, where: str) -> None:
    """PagedGatedAttention: the rank's q (+ gate), k and v heads; o_proj all-sums."""
    hq, hkv, d = attn.num_heads // size, attn.num_kv_heads // size, attn.head_dim
    row_slice(attn.q_proj, rank * hq * 2 * d, (rank + 1) * hq * 2 * d, f"{where} q_proj")
    row_slice(attn.k_proj, rank * hkv * d, (rank + 1) * hkv * d, f"{where} k_proj")
    row_slice(attn.v_proj, rank * hkv * d, (rank + 1) * hkv * d, f"{where} v_proj")
    column_slice(attn.o_proj, rank * hq * d, (rank + 1) * hq * d, f"{where} o_proj")
    attn.o_proj = AllSumLinear(attn.o_proj, group)
    attn.num_heads, attn.num_kv_heads = hq, hkv


def shard_gated_delta_net(gdn, rank: int, size: int, group, where: str) -> None:
    """mlx-lm's GatedDeltaNet: the rank's key heads and their value heads; out_proj all-sums."""
    hk, hv = gdn.num_k_heads // size, gdn.num_v_heads // size
    dk, dv = gdn.head_k_dim, gdn.head_v_dim
    key_dim = gdn.key_dim                          # all ranks: q [0, kd), k [kd, 2kd), v after
    q = (rank * hk * dk, (rank + 1) * hk * dk)
    channels = [q, (key_dim + q[0], key_dim + q[1]),
                (2 * key_dim + rank * hv * dv, 2 * key_dim + (rank + 1) * hv * dv)]
    row_ranges(gdn.in_proj_qkv, channels, f"{where} in_proj_qkv")
    row_slice(gdn.in_proj_z, rank * hv * dv, (rank + 1) * hv * dv, f"{where} in_proj_z")
    row_slice(gdn.in_proj_b, rank * hv, (rank + 1) * hv, f"{where} in_proj_b")
    row_slice(gdn.in_proj_a, rank * hv, (rank + 1) * hv, f"{where} in_proj_a")
    conv = gdn.conv1d.weight                                               # [C, K, 1]
    gdn.conv1d.weight = mx.contiguous(mx.concatenate([conv[a:b] for a, b in channels]))
    heads = slice(rank * hv, (rank + 1) * hv)
    gdn.A_log = mx.contiguous(gdn.A_log[heads])
    gdn.dt_bias = mx.contiguous(gdn.dt_bias[heads])
    column_slice(gdn.out_proj, rank * hv * dv, (rank + 1) * hv * dv, f"{where} out_proj")
    gdn.out_proj = AllSumLinear(gdn.out_proj, group)
    gdn.num_k_heads, gdn.num_v_heads = hk, hv
    gdn.key_dim, gdn.value_dim = hk * dk, hv * dv
    gdn.conv_dim = 2 * gdn.key_dim + gdn.value_dim
    if hasattr(gdn.conv1d, "groups"):  # depthwise: one group per channel
        gdn.conv1d.groups = gdn.conv_dim


def shard_qwen3_5(loaded, rank: int, size: int, group) -> None:
    """Cuts a loaded PagedQwen3_5 down to rank `rank`'s shard of `size`, in place, and its
    state shapes (loaded.hybrid, the model's) to the rank's linear-attention heads."""
    from vllm_metal.models.qwen3_5_paged import PagedGatedAttention, StateShapes

    check_divisible(loaded, size)
    model = loaded.model
    for i, layer in enumerate(model.layers):
        where = f"layer {i}"
        if layer.is_linear:
            shard_gated_delta_net(layer.linear_attn, rank, size, group, f"{where} linear_attn")
        elif isinstance(layer.self_attn, PagedGatedAttention):
            shard_attention(layer.self_attn, rank, size, group, f"{where} self_attn")
        else:
            raise TensorParallelError(f"{where}: {type(layer.self_attn).__name__} cannot be split")
        mlp = layer.mlp
        if isinstance(mlp, FusedMoeBlock):  # Qwen3.5-MoE (tensor_parallel_moe.py)
            layer.mlp = shard_moe_block(mlp, rank, size, group, f"{where} mlp")
            continue
        if not all(n in mlp for n in ("gate_proj", "up_proj", "down_proj")):
            raise TensorParallelError(f"{where}: only gated MLPs and mixture-of-experts blocks split")
        shard_gated_mlp(mlp, mlp_columns(mlp), rank, size, group, where)
    old = model.state_shapes
    gdn = next(layer.linear_attn for layer in model.layers if layer.is_linear)
    model.state_shapes = StateShapes(conv=(gdn.conv_dim, old.conv[1]),
                                     ssm=(gdn.num_v_heads, old.ssm[1], old.ssm[2]))
    loaded.hybrid.state_shapes = model.state_shapes
    object.__setattr__(model, "tensor_parallel_size", size)
    mx.eval(model.parameters())
