"""Straightforward paged attention: gather each sequence's context, full softmax.

Obviously right and slow; the oracle for the CPU and Metal kernels.
"""

from __future__ import annotations

import numpy as np


def paged_attention_reference(q, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
                              scale, sliding_window=0, softcap=0.0, sinks=None):
    """All arrays NumPy float64/int; returns out [T, Hq, D] float64."""
    t, hq, d = q.shape
    _, bs, hkv, _ = key_cache.shape
    group = hq // hkv
    out = np.zeros((t, hq, d))
    for s in range(len(seq_lens)):
        q0, q1 = cu_seqlens_q[s], cu_seqlens_q[s + 1]
        ctx = int(seq_lens[s])
        if q1 == q0:
            continue
        pos = np.arange(ctx)
        blocks = block_tables[s, pos // bs]
        k = key_cache[blocks, pos % bs]  # [ctx, Hkv, D]
        v = value_cache[blocks, pos % bs]
        for i in range(q1 - q0):
            p = ctx - (q1 - q0) + i  # absolute position of this query
            allowed = pos <= p
            if sliding_window > 0:
                allowed &= pos > p - sliding_window
            for h in range(hq):
                kh = h // group
                scores = (k[:, kh] @ q[q0 + i, h]) * scale
                if softcap > 0:
                    scores = softcap * np.tanh(scores / softcap)
                scores = np.where(allowed, scores, -np.inf)
                logits = scores if sinks is None else np.append(scores, sinks[h])
                m = logits.max()
                w = np.exp(logits - m)
                w = w / w.sum()
                out[q0 + i, h] = w[:ctx] @ v[:, kh]
    return out
