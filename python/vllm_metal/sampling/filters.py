"""Random-sampling filters on float32 logits [B, V], in vLLM's order:
temperature, min_p, then top-k and top-p. Masked tokens become -inf.
A filter no row of the batch uses builds no graph."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from vllm_metal.sampling import rows
from vllm_metal.sampling.batch import SamplingBatch
from vllm_metal.sampling.table import GREEDY_EPS

NEG_INF = float("-inf")
# top-k alone reads the k-th largest value through mx.topk below this k; above,
# sorting the row is cheaper than a partial selection of that many.
_TOPK_SELECT_MAX = 1024
# top-p looks for its nucleus among this many logits first, then among more
# (16 x 49152 on one Zen 4 core: topk + sort of 512 ~7 ms, 4096 ~25 ms, full sort ~100 ms)
_TOPP_CANDIDATES = (512, 4096)


def apply_temperature(x: mx.array, b: SamplingBatch) -> mx.array:
    t = np.where(b.temperature < GREEDY_EPS, 1.0, b.temperature).astype(np.float32)
    if (t == 1.0).all():
        return x
    return x / mx.array(t)[:, None]


def apply_min_p(x: mx.array, b: SamplingBatch) -> mx.array:
    """Drops tokens whose probability is below min_p x the row's top probability,
    i.e. whose logit is below max + log(min_p)."""
    if not (b.min_p > 0).any():
        return x
    with np.errstate(divide="ignore"):
        log_min_p = np.log(b.min_p).astype(np.float32)  # -inf where off
    cut = mx.max(x, axis=-1, keepdims=True) + mx.array(log_min_p)[:, None]
    return mx.where(x < cut, NEG_INF, x)


def apply_top_k_top_p(x: mx.array, b: SamplingBatch, lse: mx.array | None = None) -> mx.array:
    """Runs on the rows that use top-k or top-p only (see _top_k_top_p)."""
    v = x.shape[-1]
    used = (b.top_k < v) | (b.top_p < 1.0)
    if not used.any():
        return x
    idx = rows.subset(used)
    sub = _top_k_top_p(rows.take(x, idx), rows.batch_rows(b, idx),
                       None if lse is None else rows.take(lse, idx))
    return rows.put(sub, idx, x)


def _top_k_top_p(x: mx.array, b: SamplingBatch, lse: mx.array | None = None) -> mx.array:
    """Keeps tokens at or above a per-row threshold: the k-th largest logit
    (ties kept, as vLLM), then the smallest logit of the nucleus: vLLM drops the
    ascending-sorted prefix whose cumulative probability is <= 1 - top_p, and
    always keeps the top token. lse: [B, 1] logsumexp of x, if already known."""
    v = x.shape[-1]
    use_k = bool((b.top_k < v).any())
    use_p = bool((b.top_p < 1.0).any())
    if not use_k and not use_p:
        return x
    k = np.minimum(b.top_k, v).astype(np.int32)
    kmax = int(k[b.top_k < v].max()) if use_k else v
    if use_k and not use_p and kmax <= _TOPK_SELECT_MAX:
        # rows without top-k select kmax too; their threshold is then ignored
        top = mx.sort(mx.topk(x, kmax, axis=-1), axis=-1)  # [B, kmax] ascending
        kth = mx.take_along_axis(top, mx.array(np.clip(kmax - k, 0, kmax - 1))[:, None], axis=-1)
        kth = mx.where(mx.array(b.top_k < v)[:, None], kth, NEG_INF)
        return mx.where(x < kth, NEG_INF, x)
    # Each row's cut comes from the first candidate count that holds its nucleus, else from
    # sorting its whole row, whatever the other rows need: the candidate counts give a row
    # bit-identical cuts (a prefix of the same sorted values), the full sort does not, so a
    # row must not be sent there by another (batch invariance, docs/serving.md).
    n = x.shape[0]
    todo = np.ones(n, bool)
    parts = []  # (batch rows, their cuts [rows, 1])
    for c in _TOPP_CANDIDATES:
        fits = todo & ((b.top_k >= v) | (k <= c))
        if not fits.any():
            continue
        idx = np.flatnonzero(fits)
        sub = rows.subset(fits)
        cut, covered = _cut_in_candidates(rows.take(x, sub), rows.batch_rows(b, sub), k[idx], c,
                                          None if lse is None else rows.take(lse, sub))
        if not covered.all():
            cut, idx = cut[mx.array(np.flatnonzero(covered))], idx[covered]
        parts.append((idx, cut))
        todo[idx] = False
        if not todo.any():
            break
    if todo.any():
        sub = rows.subset(todo)
        parts.append((np.flatnonzero(todo), _cut_by_sorting(rows.take(x, sub), rows.batch_rows(b, sub),
                                                            k[todo])))
    if len(parts) == 1:
        cut = parts[0][1]
    else:
        order = np.argsort(np.concatenate([idx for idx, _ in parts]))
        cut = mx.concatenate([c for _, c in parts])[mx.array(order)]
    return mx.where(x < cut, NEG_INF, x)


def _cut_by_sorting(x: mx.array, b: SamplingBatch, k: np.ndarray) -> mx.array:
    """[B, 1] threshold of the rows' top-k and top-p from the whole sorted rows (the exact
    path for wide nuclei)."""
    v = x.shape[-1]
    xs = mx.sort(x, axis=-1)  # [B, V] ascending
    kth = mx.where(mx.array(b.top_k < v)[:, None],
                   mx.take_along_axis(xs, mx.array(v - k)[:, None], axis=-1), NEG_INF)
    xs = mx.where(xs < kth, NEG_INF, xs)
    cum = mx.cumsum(mx.softmax(xs, axis=-1), axis=-1)
    drop = cum <= mx.array(1.0 - b.top_p)[:, None]
    # number of dropped entries (a prefix, cum is non-decreasing), at most V-1
    n_drop = mx.minimum(mx.sum(drop, axis=-1, keepdims=True), v - 1)
    pcut = mx.take_along_axis(xs, n_drop.astype(mx.int32), axis=-1)
    return mx.where(mx.array(b.top_p < 1.0)[:, None], mx.maximum(kth, pcut), kth)


def _cut_in_candidates(x: mx.array, b: SamplingBatch, k: np.ndarray, c: int,
                       lse_x: mx.array | None) -> tuple[mx.array, np.ndarray]:
    """Both cuts from the top c logits (one selection, no full sort, which
    costs ~10x on MLX's CPU backend): the k-th largest, then the nucleus.
    -> ([B, 1] cuts, [B] whether the candidates hold at least top_p of the row's
    top-k mass: where not, the nucleus may lie beyond them and the cut is void).
    Reads the [B] flags back (a sync), only for top-p batches."""
    v = x.shape[-1]
    c = min(c, v)
    vs = -mx.sort(-mx.topk(x, c, axis=-1), axis=-1)  # [B, c] descending
    has_k = b.top_k < v
    kth = mx.take_along_axis(vs, mx.array(np.clip(k - 1, 0, c - 1))[:, None], axis=-1)
    kth = mx.where(mx.array(has_k)[:, None], kth, NEG_INF)
    vs = mx.where(vs < kth, NEG_INF, vs)
    # a top-k row's mass lies among the candidates; other rows need the full row's
    if lse_x is None:
        lse_x = mx.logsumexp(x, axis=-1, keepdims=True)
    lse = mx.where(mx.array(has_k)[:, None], mx.logsumexp(vs, axis=-1, keepdims=True), lse_x)
    p = mx.exp(vs - lse)
    used = mx.array(b.top_p < 1.0)
    covered = mx.logical_or(mx.sum(p, axis=-1) >= mx.array(b.top_p), mx.logical_not(used))
    # vLLM drops token i when the ascending mass up to it, 1 - before_i, is <= 1 - top_p
    before = mx.cumsum(p, axis=-1) - p  # mass of the larger candidates
    keep = mx.sum(before < mx.array(b.top_p)[:, None], axis=-1, keepdims=True)  # prefix, >= 1
    pcut = mx.take_along_axis(vs, mx.maximum(keep - 1, 0).astype(mx.int32), axis=-1)
    return mx.maximum(kth, mx.where(used[:, None], pcut, NEG_INF)), np.array(covered)


def apply_filters(x: mx.array, b: SamplingBatch) -> tuple[mx.array, mx.array]:
    """-> (filtered logits, their unnormalized probabilities exp(x - row max),
    0 where filtered). One exp over the vocabulary serves top-p's row mass and
    the draw: on MLX's CPU backend exp is the dominant cost (~15 ns/element)."""
    x = apply_temperature(x, b)
    x = apply_min_p(x, b)
    if b.custom is not None:  # argmax-invariant --logits-processors (custom_processors.py)
        x = b.custom.apply_argmax_invariant(x)
    m = mx.max(x, axis=-1, keepdims=True)
    e = mx.exp(x - m)  # [B, V]
    filtered = apply_top_k_top_p(x, b, mx.log(mx.sum(e, axis=-1, keepdims=True)) + m)
    if filtered is x:
        return x, e
    return filtered, mx.where(filtered == NEG_INF, 0.0, e)
