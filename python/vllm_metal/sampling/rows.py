"""Running a stage on the rows that use it only: on MLX's CPU backend every
element-wise pass over [B, V] costs, so a stage one request in six uses should
not touch the other five rows."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np


def subset(used: np.ndarray) -> np.ndarray | None:
    """Batch indices of the rows that use a stage; None when all do."""
    return None if used.all() else np.flatnonzero(used)


def take(a: mx.array, idx: np.ndarray | None) -> mx.array:
    return a if idx is None else a[mx.array(idx)]


def put(sub: mx.array, idx: np.ndarray | None, like: mx.array) -> mx.array:
    """Rows idx of `like` replaced by `sub` (a functional scatter; -inf safe)."""
    if idx is None:
        return sub
    full = mx.zeros(like.shape, sub.dtype).at[mx.array(idx)].add(sub)
    used = np.zeros(like.shape[0], bool)
    used[idx] = True
    return mx.where(mx.array(used).reshape((-1,) + (1,) * (like.ndim - 1)), full, like)


def put_new(sub: mx.array, idx: np.ndarray | None, size: int) -> mx.array:
    """[size, ...] with rows idx from sub and zeros elsewhere."""
    if idx is None:
        return sub
    return mx.zeros((size,) + sub.shape[1:], sub.dtype).at[mx.array(idx)].add(sub)


def batch_rows(b, idx: np.ndarray | None):
    """The SamplingBatch's per-row arrays cut to rows idx."""
    if idx is None:
        return b
    cut = {f.name: getattr(b, f.name)[idx] for f in dataclasses.fields(b)
           if isinstance(getattr(b, f.name), np.ndarray) and getattr(b, f.name).ndim >= 1
           and len(getattr(b, f.name)) == b.size}
    return dataclasses.replace(b, **cut)
