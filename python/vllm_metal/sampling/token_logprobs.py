"""logprob_token_ids: the scores of chosen token ids at each sampled position.

vLLM's format (V2 sampler, compute_topk_scores): a row is [sampled token, its ids...]
in place of [sampled token, top n...]; the sampled token's rank is computed as usual;
columns past the request's own ids are padding (id 0, -inf), never read by vLLM's
output processor (it keeps num_logprobs + 1 = len(ids) + 1 columns of each row).
Rows of the batch without ids keep their top n. The scores are those the logprobs
mode gives (log-softmax or logits, raw or processed), gathered from the same [N, V]
matrix the top-n logprobs come from.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from vllm_metal.sampling.logprobs import gather_logprobs

NEG_INF = float("-inf")


def pad_token_ids(lists: list[np.ndarray | None]) -> np.ndarray:
    """int32 [N, K] with each row's ids and -1 past them (rows without ids: all -1)."""
    width = max([len(x) for x in lists if x is not None] or [0])
    out = np.full((len(lists), max(width, 1)), -1, np.int32)
    for i, x in enumerate(lists):
        if x is not None:
            out[i, :len(x)] = x
    return out


def gather_token_ids(scores: mx.array, ids: np.ndarray) -> tuple[mx.array, mx.array]:
    """scores float32 [N, V]; ids int32 [N, K] padded with -1 -> (ids int32 [N, K] with
    padding 0, scores float32 [N, K] with padding -inf)."""
    valid = ids >= 0
    safe = np.where(valid, ids, 0).astype(np.int32)
    got = mx.take_along_axis(scores, mx.array(safe), axis=-1)
    return mx.array(safe), mx.where(mx.array(valid), got, NEG_INF)


def gather_logprobs_with_ids(scores: mx.array, num_top: int, tokens: mx.array,
                             ids: np.ndarray):
    """Like logprobs.gather_logprobs, but rows whose ids[i] has an id (>= 0) report
    those ids in place of their top n. scores [N, V]; num_top: the top n of the other
    rows (0: none); tokens int32 [N]; ids int32 [N, K] padded with -1 -> (ids
    [N, 1 + max(n, K)], scores likewise, ranks [N])."""
    has_ids = ids[:, 0] >= 0  # [N]
    tok, chosen, ranks = gather_logprobs(scores, num_top, tokens)
    own_ids, own = gather_token_ids(scores, ids)
    width = max(num_top, ids.shape[1])
    if num_top > 0:
        top_ids, top_lp = tok[:, 1:], chosen[:, 1:]
        tok, chosen = tok[:, :1], chosen[:, :1]
    else:
        top_ids = mx.zeros((ids.shape[0], 0), mx.int32)
        top_lp = mx.zeros((ids.shape[0], 0), mx.float32)
    top_ids, top_lp = _widen(top_ids, top_lp, width)
    own_ids, own = _widen(own_ids, own, width)
    use = mx.array(has_ids)[:, None]
    return (mx.concatenate([tok, mx.where(use, own_ids, top_ids)], axis=-1),
            mx.concatenate([chosen, mx.where(use, own, top_lp)], axis=-1), ranks)


def _widen(ids: mx.array, lp: mx.array, width: int) -> tuple[mx.array, mx.array]:
    """Pads [N, k] to [N, width] with (0, -inf)."""
    k = ids.shape[1]
    if k >= width:
        return ids, lp
    n = ids.shape[0]
    return (mx.concatenate([ids, mx.zeros((n, width - k), mx.int32)], axis=-1),
            mx.concatenate([lp, mx.full((n, width - k), NEG_INF, mx.float32)], axis=-1))
