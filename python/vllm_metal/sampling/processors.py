"""Logits edits that can change the greedy choice, in vLLM's order:
allowed_token_ids, bad words, min_tokens and logit_bias, custom processors
(custom_processors.py), then penalties.
Each is a no-op (and builds no graph) when the batch does not use it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from vllm_metal.sampling import rows
from vllm_metal.sampling.batch import SamplingBatch

NEG_INF = float("-inf")


def apply_allowed(x: mx.array, b: SamplingBatch) -> mx.array:
    """Rows with allowed_token_ids keep only those tokens."""
    if b.allowed is None:
        return x
    rows, toks = b.allowed
    # functional scatters only: x may alias the caller's logits
    hits = mx.zeros(x.shape, mx.int32).at[mx.array(rows), mx.array(toks)].add(1)
    keep = mx.logical_or(hits > 0, mx.array(~b.allowed_rows)[:, None])
    return mx.where(keep, x, NEG_INF)


def apply_banned(x: mx.array, b: SamplingBatch) -> mx.array:
    """Bad words whose prefix was just generated, and stop tokens before min_tokens."""
    if b.banned is None:
        return x
    rows, toks = b.banned
    return x.at[mx.array(rows), mx.array(toks)].minimum(NEG_INF)


def apply_bias(x: mx.array, b: SamplingBatch) -> mx.array:
    if b.bias is None:
        return x
    rows, toks, vals = b.bias
    return x.at[mx.array(rows), mx.array(toks)].add(mx.array(vals))


def token_counts(tokens: np.ndarray, vocab_size: int) -> mx.array:
    """int32 [B, V]: occurrences of each token; tokens [B, L] padded with V."""
    t = mx.array(tokens)
    rows = mx.broadcast_to(mx.arange(t.shape[0])[:, None], t.shape)
    counts = mx.zeros((t.shape[0], vocab_size + 1), mx.int32)
    counts = counts.at[rows, t].add(mx.ones(t.shape, mx.int32))
    return counts[:, :vocab_size]


def apply_penalties(x: mx.array, b: SamplingBatch) -> mx.array:
    """vLLM's definitions: repetition over prompt + output tokens (divide a
    positive logit, multiply a negative one), frequency and presence (OpenAI)
    over output tokens."""
    if not b.uses_penalties:
        return x
    idx = rows.subset((b.repetition_penalty != 1.0) | (b.frequency_penalty != 0.0)
                      | (b.presence_penalty != 0.0))
    return rows.put(_penalize(rows.take(x, idx), rows.batch_rows(b, idx)), idx, x)


def _penalize(x: mx.array, b: SamplingBatch) -> mx.array:
    v = x.shape[-1]
    out_counts = token_counts(b.output_tokens, v)
    seen_out = out_counts > 0
    if (b.repetition_penalty != 1.0).any():
        seen = mx.logical_or(token_counts(b.prompt_tokens, v) > 0, seen_out)
        rep = mx.array(b.repetition_penalty)[:, None]
        x = mx.where(seen, mx.where(x > 0, x / rep, x * rep), x)
    if (b.frequency_penalty != 0.0).any():
        x = x - mx.array(b.frequency_penalty)[:, None] * out_counts.astype(mx.float32)
    if (b.presence_penalty != 0.0).any():
        x = x - mx.array(b.presence_penalty)[:, None] * seen_out.astype(mx.float32)
    return x


def process(x: mx.array, b: SamplingBatch) -> mx.array:
    """float32 [B, V] -> the logits greedy rows take the argmax of."""
    x = apply_allowed(x, b)
    x = apply_banned(x, b)
    x = apply_bias(x, b)
    if b.custom is not None:  # --logits-processors, where vLLM's Sampler runs them
        x = b.custom.apply_edits(x)
    x = apply_penalties(x, b)
    if b.custom is not None:  # V2-interface processors: after the penalties, as vLLM V2
        x = b.custom.apply_after_penalties(x)
    return x
