"""NumPy references for the sampling tests: vLLM's definitions, written out
plainly (float64) and independent of the MLX code under test."""

from __future__ import annotations

import math

import numpy as np


def softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=-1, keepdims=True)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def filtered_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The distribution vLLM samples one row from: temperature, min_p, top-k, top-p."""
    x = np.asarray(logits, np.float64) / temperature
    p = softmax(x)
    keep = np.ones(len(x), bool)
    if min_p > 0:
        keep &= p >= min_p * p.max()
    if top_k:
        kth = np.sort(x[keep])[::-1][min(top_k, keep.sum()) - 1]
        keep &= x >= kth
    if top_p < 1:
        q = np.where(keep, p, 0)
        q = q / q.sum()
        order = np.argsort(q, kind="stable")  # ascending
        cum = np.cumsum(q[order])
        drop = cum <= 1 - top_p
        drop[-1] = False
        keep[order[drop]] = False
    q = np.where(keep, p, 0)
    return q / q.sum()


def penalized(logits, prompt, output, rep=1.0, freq=0.0, pres=0.0) -> np.ndarray:
    x = np.array(logits, np.float64)
    counts = np.bincount(np.asarray(output, np.int64), minlength=len(x))[:len(x)]
    seen = np.zeros(len(x), bool)
    seen[list(prompt) + list(output)] = True
    for t in np.flatnonzero(seen):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    return x - freq * counts - pres * (counts > 0)


def chi_square_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for chi-square(dof): scipy if present, else the regularized
    upper incomplete gamma Q(dof/2, stat/2) by series / continued fraction."""
    try:
        from scipy.stats import chi2
        return float(chi2.sf(stat, dof))
    except ImportError:
        pass
    a, x = dof / 2.0, stat / 2.0
    if x <= 0:
        return 1.0
    lg = math.lgamma(a)
    if x < a + 1:  # series for P, then Q = 1 - P
        term = total = 1.0 / a
        n = a
        for _ in range(1000):
            n += 1
            term *= x / n
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return 1.0 - total * math.exp(-x + a * math.log(x) - lg)
    b, c, d = x + 1 - a, 1e300, 1 / (x + 1 - a)  # Lentz continued fraction for Q
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return h * math.exp(-x + a * math.log(x) - lg)


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of observed counts against probs (cells of tiny expectation merged)."""
    n = counts.sum()
    exp = probs * n
    assert counts[probs == 0].sum() == 0, "a token of probability 0 was drawn"
    big = exp >= 5
    obs_c = list(counts[big]) + [counts[~big & (probs > 0)].sum()]
    exp_c = list(exp[big]) + [exp[~big & (probs > 0)].sum()]
    pairs = [(o, e) for o, e in zip(obs_c, exp_c) if e > 0]
    stat = sum((o - e) ** 2 / e for o, e in pairs)
    return chi_square_sf(stat, len(pairs) - 1)
