"""Logprobs in vLLM's format: per position the chosen token first, then the
top n in descending order, and the chosen token's rank (1 + the number of
tokens with a larger logprob, counting ties as vLLM: #(logprob >= chosen))."""

from __future__ import annotations

import mlx.core as mx


def log_softmax(x: mx.array) -> mx.array:
    x = x.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def gather_logprobs(lp: mx.array, n: int, token_ids: mx.array):
    """lp float32 [N, V], token_ids int32 [N] -> (ids int32 [N, n+1],
    logprobs float32 [N, n+1], ranks int32 [N])."""
    tok = token_ids.astype(mx.int32)[:, None]
    chosen = mx.take_along_axis(lp, tok, axis=-1)  # [N, 1]
    ranks = mx.sum(lp >= chosen, axis=-1).astype(mx.int32)
    if n <= 0:
        return tok, chosen, ranks
    n = min(n, lp.shape[-1])
    top_ids = mx.argpartition(-lp, n - 1, axis=-1)[:, :n]
    top_lp = mx.take_along_axis(lp, top_ids, axis=-1)
    order = mx.argsort(-top_lp, axis=-1)
    top_ids = mx.take_along_axis(top_ids, order, axis=-1).astype(mx.int32)
    top_lp = mx.take_along_axis(top_lp, order, axis=-1)
    return (mx.concatenate([tok, top_ids], axis=-1), mx.concatenate([chosen, top_lp], axis=-1),
            ranks)
