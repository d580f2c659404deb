"""LoraLinear: a base projection plus the per-row LoRA delta of the adapter slots.

The base layer (GGUFLinear in block or dense form, MLX QuantizedLinear, nn.Linear)
is kept as it is: the delta is added to its output by ops.lora_apply, so loading
or evicting an adapter never touches base weights. Each wrapper owns its slot
buffers A [S, R, in], B [S, out, R] and scale [S] (S = --max-loras, R =
--max-lora-rank; an adapter of smaller rank is zero-padded, a slot whose adapter
lacks this projection has scale 0 and zeros).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from vllm_metal import ops
from vllm_metal.lora.adapter import TARGETS


class LoraStep:
    """The row -> slot mapping of the step being built, shared by every LoraLinear."""

    def __init__(self):
        self.row_slot: mx.array | None = None  # int32 [T], -1 = base; None: no adapter
        self.slots: frozenset = frozenset()  # the slots row_slot uses (host side)


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Module, in_dim: int, out_dim: int, slots: int, rank: int,
                 dtype: mx.Dtype, step: LoraStep):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = in_dim, out_dim
        # host copies the slots are written into; the device arrays are rebuilt from them
        # (new arrays: a step still in flight keeps the ones it was built with)
        object.__setattr__(self, "_host", (np.zeros((slots, rank, in_dim), np.float32),
                                           np.zeros((slots, out_dim, rank), np.float32),
                                           np.zeros(slots, np.float32)))
        object.__setattr__(self, "_dtype", dtype)
        object.__setattr__(self, "_step", step)
        self.sync()

    def write_slot(self, slot: int, weights) -> None:
        """weights: (A [r, in], B [out, r], scale) or None (this slot has no delta here)."""
        a_host, b_host, s_host = self._host
        a_host[slot] = 0
        b_host[slot] = 0
        s_host[slot] = 0
        if weights is not None:
            a, b, scale = weights
            r = a.shape[0]
            a_host[slot, :r] = a
            b_host[slot, :, :r] = b
            s_host[slot] = scale

    def sync(self) -> None:
        a_host, b_host, s_host = self._host
        object.__setattr__(self, "_arrays", (mx.array(a_host).astype(self._dtype),
                                             mx.array(b_host).astype(self._dtype),
                                             mx.array(s_host)))

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        row_slot = self._step.row_slot
        if row_slot is None:
            return y
        a, b, scale = self._arrays
        out = ops.lora_apply(y.reshape(-1, self.out_features), x.reshape(-1, self.in_features),
                             lora_a=a, lora_b=b, scale=scale, row_slot=row_slot)
        return out.reshape(y.shape)


def base_of(layer):
    """The base projection of a LoraLinear, else `layer` itself."""
    return layer.base if isinstance(layer, LoraLinear) else layer


def _dims(layer: nn.Module) -> tuple[int, int]:
    """(in, out) of a projection (GGUFLinear, nn.Linear or QuantizedLinear)."""
    if hasattr(layer, "in_features") and hasattr(layer, "out_features"):
        return int(layer.in_features), int(layer.out_features)
    out_dim = int(layer.weight.shape[0])
    if isinstance(layer, nn.QuantizedLinear):
        return int(layer.weight.shape[1]) * 32 // layer.bits, out_dim
    return int(layer.weight.shape[1]), out_dim


def install(model, slots: int, rank: int, step: LoraStep, first_layer: int = 0) -> dict:
    """Wraps every target projection of `model` (a PagedCausalLM or PagedQwen3_5) in a
    LoraLinear, a sparse-MoE block's shared expert's too, and every sparse-MoE block in
    an experts.LoraMoeBlock.
    Returns (layer, projection) -> LoraLinear or ExpertLoraSlots; layer: the checkpoint's
    index (a pipeline stage's layers start at first_layer)."""
    from vllm_metal.lora.experts import wrap_moe_block

    dtype = model.layers[0].input_layernorm.weight.dtype
    wrapped = {}
    for i, layer in enumerate(model.layers, start=first_layer):
        moe = wrap_moe_block(layer, i, slots, rank, dtype, step)
        if moe is not None:
            wrapped[(i, "experts")] = moe
            shared = getattr(layer.mlp.block, "shared_expert", None)
            for proj in ("gate_proj", "up_proj", "down_proj"):
                base = getattr(shared, proj, None) if shared is not None else None
                if base is not None:
                    in_dim, out_dim = _dims(base)
                    lora = LoraLinear(base, in_dim, out_dim, slots, rank, dtype, step)
                    setattr(shared, proj, lora)
                    wrapped[(i, f"shared_expert.{proj}")] = lora
        for proj, parent_name in TARGETS.items():
            parent = getattr(layer, parent_name, None)
            base = getattr(parent, proj, None) if parent is not None else None
            if base is None:
                continue
            in_dim, out_dim = _dims(base)
            lora = LoraLinear(base, in_dim, out_dim, slots, rank, dtype, step)
            setattr(parent, proj, lora)
            wrapped[(i, proj)] = lora
    if not wrapped:
        raise ValueError("[vllm-metal] LoRA: the model has none of the projections "
                         f"{', '.join(TARGETS)}")
    # the fused layers are rebuilt to hold the wrappers (fused_layers.FusedDecoderLayer
    # passes the slots of a step with adapters; other steps run the base layer as it is)
    object.__setattr__(model, "_lora_step", step)
    if hasattr(model, "reset_fused_layers"):  # PagedQwen3_5 has no fused layers
        model.reset_fused_layers()
    return wrapped
