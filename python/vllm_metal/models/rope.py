"""Rotary embedding of packed rows: every token carries its own position.

`apply_rope` runs `ops.rope` (our kernel) for the rope types it knows
(default, linear, llama3, yarn). Anything else falls back to the mlx-lm rope
module the architecture built, called with one offset per token: x [T, H, D]
is viewed as T batches of one row, and mx.fast.rope takes a [T] offset vector,
so the fallback is exact for packed batches too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

# Keys ops.rope accepts per scaling type (it rejects unknown keys).
_OPS_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "attention_factor", "truncate"),
}


@dataclass(frozen=True)
class RopeConfig:
    rotary_dim: int
    is_neox: bool                   # pairs (i, i + d/2); False: (2i, 2i + 1)
    base: float
    scaling: dict | None = None     # HF rope_scaling restricted to what ops.rope reads
    fallback: Any = None            # an mlx-lm rope module; set when ops.rope cannot do it


def _ops_rope():
    from vllm_metal import ops

    return getattr(ops, "rope", None)


def rope_config(module: nn.Module, base: float, scaling: dict | None) -> RopeConfig:
    """What `module` (an mlx-lm rope built with `base` and `scaling`) computes."""
    if isinstance(module, nn.RoPE):
        # default and linear: mlx-lm folds the linear factor into `scale`.
        linear = None if module.scale == 1.0 else {"rope_type": "linear", "factor": 1.0 / module.scale}
        return RopeConfig(module.dims, not module.traditional, float(module.base), linear)
    rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if rope_type == "dynamic":  # its frequencies depend on the whole sequence's length
        raise ValueError("[vllm-metal] rope type 'dynamic' is not supported for packed batches")
    dims = getattr(module, "dims", None) or getattr(module, "dim", None)
    if rope_type in ("llama3", "yarn") and dims is not None and _ops_rope() is not None:
        keys = _OPS_SCALING_KEYS[rope_type]
        filtered = {"rope_type": rope_type}
        filtered.update({k: float(scaling[k]) for k in keys if scaling.get(k) is not None})
        return RopeConfig(dims, not getattr(module, "traditional", False), float(base), filtered)
    return RopeConfig(dims or 0, not getattr(module, "traditional", False), float(base), None, module)


def apply_rope(x: mx.array, positions: mx.array, config: RopeConfig) -> mx.array:
    """x [T, H, D], positions int32 [T] -> x rotated, same shape and dtype."""
    rope = None if config.fallback is not None else _ops_rope()
    if rope is not None:
        return rope(x, positions, rotary_dim=config.rotary_dim, is_neox=config.is_neox,
                    base=config.base, scaling=config.scaling)
    return rope_fallback(x, positions, config)


def rope_fallback(x: mx.array, positions: mx.array, config: RopeConfig) -> mx.array:
    """The same rotation from MLX ops: T batches of one row, one offset each."""
    t, h, d = x.shape
    rows = x.reshape(t, h, 1, d)  # (B, *, L, D) with B = T, L = 1
    if config.fallback is not None:
        out = config.fallback(rows, offset=positions)
    else:
        factor = (config.scaling or {}).get("factor", 1.0)
        if config.scaling and config.scaling.get("rope_type") not in ("linear",):
            raise ValueError(f"[rope] the fallback needs an mlx-lm module for {config.scaling}")
        out = mx.fast.rope(rows, config.rotary_dim, traditional=not config.is_neox,
                           base=config.base, scale=1.0 / factor, offset=positions)
    return out.reshape(t, h, d)
