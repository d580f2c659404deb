"""Draws one token per row from its probabilities by inverting the CDF with the
row's own uniform (rng.py): one random number per request, no Gumbel noise
over the vocabulary, and tokens masked to -inf can never be drawn."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

# keeps the target strictly below the row's total mass under float32 rounding
_BELOW_ONE = 1.0 - 2.0**-20


def draw(weights: mx.array, u: np.ndarray) -> mx.array:
    """weights float32 [B, V]: unnormalized probabilities (0 = masked);
    u float64 [B] in [0, 1) -> int32 [B]."""
    cdf = mx.cumsum(weights, axis=-1)  # [B, V]; the target scales with the row's total
    total = cdf[:, -1:]
    target = mx.minimum(mx.array(u.astype(np.float32))[:, None] * total, total * _BELOW_ONE)
    # first index whose cdf exceeds the target; a masked token adds no mass,
    # so it is never that index
    idx = mx.sum(cdf <= target, axis=-1)
    return mx.minimum(idx, weights.shape[-1] - 1).astype(mx.int32)
