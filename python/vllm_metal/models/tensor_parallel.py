"""Tensor parallelism: one rank's shard of a loaded decoder, with mx.distributed all-sums
(mixture-of-experts blocks: tensor_parallel_moe.py).

Megatron's split, as MLX's sharded linear layers do it (mlx.nn.layers.distributed):
q/k/v and gate/up are split by output rows ("all-to-sharded": each rank keeps whole
attention heads and a slice of the MLP columns), o_proj and down_proj by input columns
("sharded-to-all"), and their partial outputs are summed over the group. Embeddings,
norms and lm_head stay whole on every rank, so every rank ends a step with the same
logits. Each rank's KV cache then holds only its own KV heads.

The layers are our own (GGUFLinear on the CPU, GGUF blocks), not MLX's nn.Linear, so the
weights are sliced here and the all-sum wraps the row-split projection (AllSumLinear):
MLX's layer classes would put the dense nn.Linear back. A block-form GGUF weight splits
by rows freely (rows are independent); by columns only at whole GGUF blocks.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from vllm_metal.models.gguf_linear import GGUFLinear


class TensorParallelError(ValueError):
    """A model this world size cannot split (the message says why)."""


class AllSumLinear(nn.Module):
    """A column-split projection whose partial outputs are summed over `group`; the bias,
    if any, is added once after the sum (MLX's ShardedToAllLinear does the same)."""

    def __init__(self, inner: nn.Module, group):
        super().__init__()
        self.inner = inner
        if "bias" in inner:
            self.bias = inner.bias
            del inner["bias"]
        self._group = group  # underscore: nn.Module would otherwise treat it as a child

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.distributed.all_sum(self.inner(x), group=self._group)
        return y + self.bias if "bias" in self else y


def row_slice(layer: nn.Module, start: int, stop: int, name: str) -> None:
    """Keep output rows [start, stop) of a projection (and of its bias)."""
    row_ranges(layer, [(start, stop)], name)


def row_ranges(layer: nn.Module, ranges: list[tuple[int, int]], name: str) -> None:
    """Keep the output rows of each [start, stop) in `ranges`, in order (and of the
    bias): a fused projection (Qwen3.5's in_proj_qkv) keeps one range per part."""

    def keep(w: mx.array) -> mx.array:
        parts = [w[a:b] for a, b in ranges]
        return mx.contiguous(parts[0] if len(parts) == 1 else mx.concatenate(parts))

    if isinstance(layer, GGUFLinear):
        layer.weight = keep(layer.weight)
        layer.out_features = layer.weight.shape[0]
    elif type(layer) is nn.Linear:
        layer.weight = keep(layer.weight)
    else:
        raise TensorParallelError(f"{name}: {type(layer).__name__} layers cannot be split yet "
                                  "(MLX-quantized checkpoints are not supported with tensor parallelism)")
    if "bias" in layer:
        layer.bias = keep(layer.bias)


def column_slice(layer: nn.Module, start: int, stop: int, name: str) -> None:
    """Keep input columns [start, stop) of a projection; block-form GGUF weights only at
    whole blocks."""
    if isinstance(layer, GGUFLinear) and layer.is_blocks:
        first, last = block_bytes(layer.qtype, start, stop, layer.in_features, name)
        layer.weight = mx.contiguous(layer.weight[:, first:last])
        layer.in_features = stop - start
    elif isinstance(layer, GGUFLinear):
        layer.weight = mx.contiguous(layer.weight[:, start:stop])
        layer.in_features = stop - start
    elif type(layer) is nn.Linear:
        layer.weight = mx.contiguous(layer.weight[:, start:stop])
    else:
        raise TensorParallelError(f"{name}: {type(layer).__name__} layers cannot be split yet "
                                  "(MLX-quantized checkpoints are not supported with tensor parallelism)")


def block_bytes(type_id: int, start: int, stop: int, cols: int, name: str) -> tuple[int, int]:
    """The byte range of a GGUF row's columns [start, stop); a split through a block is
    refused, naming the tensor."""
    from vllm_metal import _core

    type_name, block, nbytes, _ = _core.gguf_type_info(type_id)
    if start % block or stop % block:
        raise TensorParallelError(
            f"{name}: its {type_name} blocks hold {block} columns, and a split at columns "
            f"{start}:{stop} cuts through a block; use a tensor-parallel size that divides "
            f"{cols // block} blocks")
    return start // block * nbytes, stop // block * nbytes


def check_divisible(num_heads: int, num_kv_heads: int, intermediate: int | None, size: int) -> None:
    """Refuses a world size that does not divide the heads or the MLP columns (None: no
    dense MLP)."""
    for what, n in (("attention heads", num_heads), ("KV heads", num_kv_heads),
                    ("MLP columns (intermediate_size)", intermediate)):
        if n is not None and n % size:
            raise TensorParallelError(f"--tensor-parallel-size {size} does not divide the model's "
                                      f"{n} {what}")


def mlp_columns(mlp: nn.Module) -> int:
    """The intermediate size of a gated MLP (down_proj's input columns)."""
    down = mlp.down_proj
    return down.in_features if hasattr(down, "in_features") else down.weight.shape[1]


def shard_gated_mlp(mlp: nn.Module, inter: int, rank: int, size: int, group, where: str) -> None:
    """gate/up keep the rank's MLP columns, down_proj its input columns and all-sums."""
    cols = inter // size
    row_slice(mlp.gate_proj, rank * cols, (rank + 1) * cols, f"{where} gate_proj")
    row_slice(mlp.up_proj, rank * cols, (rank + 1) * cols, f"{where} up_proj")
    column_slice(mlp.down_proj, rank * cols, (rank + 1) * cols, f"{where} down_proj")
    mlp.down_proj = AllSumLinear(mlp.down_proj, group)


def shard_model(model, rank: int, size: int, group) -> None:
    """Cuts a PagedCausalLM (llama family, weights loaded) down to rank `rank`'s shard of
    `size`, in place; o_proj and down_proj then all-sum over `group`."""
    from vllm_metal.models.layers import PagedAttention
    from vllm_metal.models.moe import FusedMoeBlock
    from vllm_metal.models.tensor_parallel_moe import shard_moe_block

    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn, PagedAttention):
            raise TensorParallelError(f"layer {i}: {type(attn).__name__} cannot be split")
        if attn.qk_norm_whole:  # OLMoE: one norm over every head's q (and k)
            raise TensorParallelError(f"layer {i}: q/k norms over all heads together cannot be split")
        moe = isinstance(mlp, FusedMoeBlock)
        if not moe and not all(n in mlp for n in ("gate_proj", "up_proj", "down_proj")):
            raise TensorParallelError(f"layer {i}: only gated MLPs and mixture-of-experts blocks split")
        inter = None if moe else mlp_columns(mlp)  # a block's experts are checked when split
        check_divisible(attn.num_heads, attn.num_kv_heads, inter, size)
        hq, hkv, d = attn.num_heads // size, attn.num_kv_heads // size, attn.head_dim
        row_slice(attn.q_proj, rank * hq * d, (rank + 1) * hq * d, f"layer {i} q_proj")
        row_slice(attn.k_proj, rank * hkv * d, (rank + 1) * hkv * d, f"layer {i} k_proj")
        row_slice(attn.v_proj, rank * hkv * d, (rank + 1) * hkv * d, f"layer {i} v_proj")
        column_slice(attn.o_proj, rank * hq * d, (rank + 1) * hq * d, f"layer {i} o_proj")
        attn.o_proj = AllSumLinear(attn.o_proj, group)
        attn.num_heads, attn.num_kv_heads = hq, hkv
        if moe:
            layer.mlp = shard_moe_block(mlp, rank, size, group, f"layer {i} mlp")
        else:
            shard_gated_mlp(mlp, inter, rank, size, group, f"layer {i}")
    model.reset_fused_layers()
    object.__setattr__(model, "tensor_parallel_size", size)  # fused_layers.why_not_fused
    mx.eval(model.parameters())


def shard_loaded(loaded, group) -> None:
    """shard_model (Qwen3.5: tensor_parallel_qwen3_5.shard_qwen3_5) on a LoadedModel for
    rank group.rank() of group.size(), and its KV spec cut to the rank's KV heads."""
    if loaded.hybrid is not None:
        from vllm_metal.models.tensor_parallel_qwen3_5 import shard_qwen3_5

        shard_qwen3_5(loaded, group.rank(), group.size(), group)
    else:
        shard_model(loaded.model, group.rank(), group.size(), group)
    loaded.spec.num_kv_heads //= group.size()
