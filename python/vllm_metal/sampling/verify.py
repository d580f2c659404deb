"""Speculative decoding's verification: which proposed tokens a step keeps.

A request with d draft tokens has d + 1 rows of logits in the step: row j scores
the token after the request's j-th draft (row 0: after its last real token), and
carries draft j as its `draft_token` (-1 on the last, "bonus", row, and on rows
whose draft is padding that must never be kept).

Greedy rows keep a draft while it is the row's argmax. Random rows use the
rejection rule of speculative sampling (Leviathan et al. 2023; Chen et al. 2023),
as vLLM does. The proposers here (n-gram) propose one token for certain, a point
mass q, so draft t is kept with probability p(t) (the target's probability of t
after every sampling parameter), and a rejected row draws instead from the residual
max(p - q, 0), which is p without t. The host keeps a request's drafts up to its
first rejected row and appends that row's token (or, all kept, the bonus row's
draw): the kept tokens are distributed exactly as the target's own samples.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from vllm_metal.sampling.draw import draw


def verify(x: mx.array, weights: mx.array | None, draft_tokens: np.ndarray, greedy: np.ndarray,
           uniforms: np.ndarray, accept_uniforms: np.ndarray) -> tuple[mx.array, mx.array]:
    """x: float32 [L, V] processed logits (greedy rows take their argmax);
    weights: [L, V] unnormalized target probabilities of the random rows (None when
    every row is greedy); draft_tokens int32 [L]; greedy bool [L]; uniforms and
    accept_uniforms float64 [L]: each row's draw and acceptance test.
    -> (tokens int32 [L]: the draft where kept, else the row's own token; kept bool [L])."""
    has = draft_tokens >= 0
    d = mx.array(np.where(has, draft_tokens, 0).astype(np.int32))
    has_m = mx.array(has)
    argmax = mx.argmax(x, axis=-1).astype(mx.int32)
    if weights is None:
        kept = mx.logical_and(argmax == d, has_m)
        return mx.where(kept, d, argmax), kept
    total = mx.sum(weights, axis=-1)
    p_draft = mx.take_along_axis(weights, d[:, None], axis=-1)[:, 0] / total
    kept_random = mx.array(accept_uniforms.astype(np.float32)) < p_draft
    vocab = mx.arange(weights.shape[-1], dtype=mx.int32)[None, :]
    residual = mx.where(mx.logical_and(vocab == d[:, None], has_m[:, None]), 0.0, weights)
    own = mx.where(mx.array(greedy), argmax, draw(residual, uniforms))
    kept = mx.logical_and(mx.where(mx.array(greedy), argmax == d, kept_random), has_m)
    return mx.where(kept, d, own), kept


def kept_tokens(tokens: np.ndarray, kept: np.ndarray, cu_num_logits: np.ndarray) -> list[list[int]]:
    """Each request's output of the step: its rows' tokens up to and including the
    first row not kept (the bonus row is never kept). cu_num_logits int32 [S + 1]."""
    out = []
    for s in range(len(cu_num_logits) - 1):
        a, b = int(cu_num_logits[s]), int(cu_num_logits[s + 1])
        rejected = np.flatnonzero(~kept[a:b])
        end = a + (int(rejected[0]) if len(rejected) else b - a - 1) + 1
        out.append(tokens[a:end].tolist())
    return out
