"""NumPy float64 references of the hybrid-model ops (gated delta rule, causal conv1d,
mrope), written from the equations (docs/kernels.md), plus packed-batch helpers."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def cu_seqlens_of(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def softplus(x):
    return np.logaddexp(x, 0.0)


def gated_delta(q, k, v, a, b, A_log, dt_bias, state, cu, slots, has_init=None, eps=1e-6):
    """q, k [T, Hk, Dk], v [T, Hv, Dv], a, b [T, Hv], A_log, dt_bias [Hv], state
    [S, Hv, Dv, Dk] (float64 arrays). Returns (y [T, Hv, Dv], new state)."""
    q, k, v, a, b = (np.asarray(x, np.float64) for x in (q, k, v, a, b))
    A_log, dt_bias = np.asarray(A_log, np.float64), np.asarray(dt_bias, np.float64)
    state = np.array(state, np.float64)
    t_all, hk, dk = q.shape
    hv, dv = v.shape[1:]
    rep = hv // hk
    y = np.zeros((t_all, hv, dv))
    for n in range(len(slots)):
        s = state[slots[n]] if has_init is None or has_init[n] else np.zeros((hv, dv, dk))
        for t in range(cu[n], cu[n + 1]):
            qn = q[t] / np.sqrt((q[t] ** 2).sum(-1, keepdims=True) + eps) / np.sqrt(dk)
            kn = k[t] / np.sqrt((k[t] ** 2).sum(-1, keepdims=True) + eps)
            qn, kn = np.repeat(qn, rep, 0), np.repeat(kn, rep, 0)  # [Hv, Dk]
            g = np.exp(-np.exp(A_log) * softplus(a[t] + dt_bias))  # [Hv]
            beta = 1.0 / (1.0 + np.exp(-b[t]))
            s = s * g[:, None, None]
            kv = np.einsum("hvk,hk->hv", s, kn)
            delta = (v[t] - kv) * beta[:, None]
            s = s + delta[:, :, None] * kn[:, None, :]
            y[t] = np.einsum("hvk,hk->hv", s, qn)
        state[slots[n]] = s
    return y, state


def causal_conv1d(x, weight, bias, state, cu, slots, has_init=None, silu=True):
    """x [T, C], weight [C, K], bias [C] or None, state [S, C, K-1] (float64)."""
    x, weight = np.asarray(x, np.float64), np.asarray(weight, np.float64)
    state = np.array(state, np.float64)
    c, kw = weight.shape
    out = np.zeros_like(x)
    for n in range(len(slots)):
        past = state[slots[n]] if has_init is None or has_init[n] else np.zeros((c, kw - 1))
        seq = np.concatenate([past.T, x[cu[n]:cu[n + 1]]], axis=0)  # [K-1+L, C]
        for i in range(cu[n + 1] - cu[n]):
            acc = (seq[i:i + kw] * weight.T).sum(0) + (0 if bias is None else bias)
            out[cu[n] + i] = acc / (1 + np.exp(-acc)) if silu else acc
        state[slots[n]] = seq[-(kw - 1):].T
    return out, state


def mrope(x, positions, sections, interleaved, rotary_dim, base=10000.0):
    """x [T, H, D] float64, positions [3, T]; the HF formulation: per-stream freqs
    [3, T, half], merged per layout, emb = cat(freqs, freqs), x * cos + rotate_half(x) * sin."""
    half = rotary_dim // 2
    inv = 1.0 / base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    freqs = np.asarray(positions, np.float64)[:, :, None] * inv[None, None, :]  # [3, T, half]
    if interleaved:  # transformers Qwen3-VL apply_interleaved_mrope
        merged = freqs[0].copy()
        for dim, offset in ((1, 1), (2, 2)):
            idx = slice(offset, sections[dim] * 3, 3)
            merged[:, idx] = freqs[dim][:, idx]
        emb = np.concatenate([merged, merged], -1)
        cos, sin = np.cos(emb), np.sin(emb)
    else:  # Qwen2-VL: cos.split(sections * 2) and chunk i takes stream i % 3
        emb = np.concatenate([freqs, freqs], -1)  # [3, T, rotary_dim]
        bounds = np.cumsum(list(sections) * 2)[:-1]
        cos = np.concatenate([np.cos(m[i % 3]) for i, m in
                              enumerate(np.split(emb, bounds, axis=-1))], -1)
        sin = np.concatenate([np.sin(m[i % 3]) for i, m in
                              enumerate(np.split(emb, bounds, axis=-1))], -1)
    x = np.asarray(x, np.float64)
    rot = x[:, :, :rotary_dim]
    rotated = np.concatenate([-rot[:, :, half:], rot[:, :, :half]], -1)
    out = x.copy()
    out[:, :, :rotary_dim] = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return out


def i32(a) -> mx.array:
    return mx.array(np.asarray(a, dtype=np.int32))
