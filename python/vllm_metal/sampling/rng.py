"""Per-request random numbers that do not depend on the batch.

A request's draw at output index ``step`` is the ``step``-th output of a
SplitMix64 stream seeded with the request's seed (the key is (seed, step)), so
a seeded request samples the same tokens whatever else is in the batch and
after preemption. MLX 0.32.4's ``mx.random`` takes one key per call
(``[bits] Expected key shape (2)``), so per-row keys through it would cost one
op per request; this counter-based hash is vectorized over the batch in NumPy.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """uint64 [B]: output ``steps`` of the SplitMix64 stream of each seed."""
    with np.errstate(over="ignore"):
        z = seeds.astype(np.uint64) + (steps.astype(np.uint64) + np.uint64(1)) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def uniforms(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """float64 [B] in [0, 1): 53 random bits of each (seed, step)."""
    return (splitmix64(seeds, steps) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


# speculative decoding's acceptance tests draw from a second stream of the same seed
# (sampling/verify.py), independent of the stream that picks tokens
_ACCEPT_STREAM = np.uint64(0xA5A5A5A5DEADBEEF)


def accept_uniforms(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """float64 [B] in [0, 1): the acceptance test's number of each (seed, step)."""
    return uniforms(seeds.astype(np.uint64) ^ _ACCEPT_STREAM, steps)


def fresh_seed(rng: np.random.Generator) -> int:
    """A seed for an unseeded request: random, but fixed for its lifetime."""
    return int(rng.integers(0, 2**63, dtype=np.int64))
