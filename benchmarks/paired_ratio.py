"""The median of paired ratios with a distribution-free confidence interval.

Two engines timed back to back, repetition after repetition, give one ratio per
repetition. On a shared VM single ratios swing 0.5-2x with the neighbours' load, so the
lowest and highest say little; what a claim like "ahead" needs is an interval for the
median. The sign-test interval assumes only independent repetitions: the median lies
between the l-th and (n + 1 - l)-th smallest ratios with probability 1 - 2 P(B <= l - 1),
B ~ Binomial(n, 1/2), for the largest l that keeps that at least the confidence asked.
"""

from __future__ import annotations

import math
import statistics


def median_interval(values, confidence: float = 0.95) -> tuple[float, float] | None:
    """(low, high) holding the median of the values' distribution with at least this
    confidence; None with too few values for it (fewer than 6 at 95 %)."""
    xs = sorted(values)
    n = len(xs)
    tail, l = 0.0, 0  # tail = P(B <= l - 1)
    while True:
        nxt = tail + math.comb(n, l) / 2.0 ** n  # P(B <= l)
        if 1.0 - 2.0 * nxt < confidence:
            break
        tail, l = nxt, l + 1
    if l == 0:
        return None
    return xs[l - 1], xs[n - l]


def summarise(ratios) -> dict:
    """median, the 95 % interval of the median, and how many ratios exceed 1."""
    interval = median_interval(ratios)
    return {"median": statistics.median(ratios), "interval95": interval,
            "above_one": sum(r > 1.0 for r in ratios), "n": len(ratios)}
