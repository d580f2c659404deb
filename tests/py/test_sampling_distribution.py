"""Chi-square tests: the native sampler draws from exactly vLLM's filtered
softmax (temperature, top-k, top-p, min-p, combined) on a small vocabulary."""

from __future__ import annotations

import numpy as np
import pytest
from vllm import SamplingParams

from sampling_reference import chi_square_p, filtered_probs
from vllm_metal.sampling import Sampler, SamplingTable, gather_batch

import mlx.core as mx

V = 12
DRAWS = 6000
LOGITS = np.array([2.0, 1.5, 1.4, 1.0, 0.7, 0.5, 0.0, -0.3, -1.0, -1.5, -2.5, -4.0], np.float32)


def sample_many(params: SamplingParams, logits: np.ndarray, draws: int = DRAWS, seed=0) -> np.ndarray:
    """One row per draw: each row is its own (unseeded) request."""
    table = SamplingTable(len(logits), rows=draws, seed=seed)
    for r in range(draws):
        table.add(r, f"r{r}", params, [0], 1)
    rows = np.arange(draws, dtype=np.int32)
    b = gather_batch(table, rows, np.zeros(draws, np.int32))
    x = mx.broadcast_to(mx.array(logits)[None], (draws, len(logits)))
    return np.array(Sampler()(x, b).tokens)


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.7),
    dict(temperature=1.0, top_k=4),
    dict(temperature=1.0, top_p=0.7),
    dict(temperature=1.3, min_p=0.2),
    dict(temperature=0.8, top_k=7, top_p=0.85, min_p=0.05),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_draws_follow_the_filtered_softmax(kw):
    tokens = sample_many(SamplingParams(**kw), LOGITS)
    probs = filtered_probs(LOGITS, kw.get("temperature", 1.0), kw.get("top_k", 0),
                           kw.get("top_p", 1.0), kw.get("min_p", 0.0))
    counts = np.bincount(tokens, minlength=V)
    assert counts[probs == 0].sum() == 0, (counts, probs)
    assert chi_square_p(counts, probs) > 1e-4, (counts, (probs * DRAWS).round(1))


def test_a_wrong_distribution_is_detected():
    # the test can fail: the same draws against an unfiltered softmax
    tokens = sample_many(SamplingParams(temperature=1.0, top_k=4), LOGITS)
    wrong = filtered_probs(LOGITS, 1.0)
    counts = np.bincount(tokens, minlength=V)
    with pytest.raises(AssertionError):
        assert chi_square_p(counts, wrong) > 1e-4


def test_mixed_batch_rows_follow_their_own_parameters():
    # greedy, top-k and top-p requests interleaved in one batch
    kinds = [dict(temperature=0.0), dict(temperature=1.0, top_k=3), dict(temperature=1.0, top_p=0.6)]
    n = 3000
    table = SamplingTable(V, rows=3 * n, seed=1)
    for r in range(3 * n):
        table.add(r, f"r{r}", SamplingParams(**kinds[r % 3]), [0], 1)
    b = gather_batch(table, np.arange(3 * n, dtype=np.int32), np.zeros(3 * n, np.int32))
    x = mx.broadcast_to(mx.array(LOGITS)[None], (3 * n, V))
    tokens = np.array(Sampler()(x, b).tokens)
    assert (tokens[0::3] == 0).all()
    for i, kw in ((1, kinds[1]), (2, kinds[2])):
        probs = filtered_probs(LOGITS, 1.0, kw.get("top_k", 0), kw.get("top_p", 1.0))
        assert chi_square_p(np.bincount(tokens[i::3], minlength=V), probs) > 1e-4


def test_large_vocabulary_top_k_never_leaves_the_top_k():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=49152).astype(np.float32)
    tokens = sample_many(SamplingParams(temperature=1.0, top_k=20), logits, draws=64)
    assert set(tokens) <= set(np.argsort(-logits)[:20])


@pytest.mark.parametrize("tiers", [(), (16,), (512, 4096)], ids=["sort", "sort-after-16", "tiers"])
@pytest.mark.parametrize("vocab, scale, kw", [
    (12, 1.0, dict(top_p=0.7)),
    (2000, 0.05, dict(top_p=0.9)),         # wide nucleus: needs the second tier
    (6000, 0.02, dict(top_p=0.9)),         # wider than every tier: the full sort
    (2000, 0.05, dict(top_k=700, top_p=0.8)),
    (2000, 3.0, dict(top_k=30, top_p=0.5)),
])
def test_top_k_top_p_keep_exactly_the_reference_support(vocab, scale, kw, tiers, monkeypatch):
    from vllm_metal.sampling import filters
    from vllm_metal.sampling.filters import apply_top_k_top_p

    monkeypatch.setattr(filters, "_TOPP_CANDIDATES", tiers)

    logits = (np.random.default_rng(vocab).normal(size=vocab) * scale).astype(np.float32)
    table = SamplingTable(vocab, rows=2, seed=0)
    table.add(0, "a", SamplingParams(temperature=1.0, **kw), [0], 1)
    table.add(1, "b", SamplingParams(temperature=1.0), [0], 1)  # unfiltered neighbour
    b = gather_batch(table, np.array([0, 1], np.int32), np.zeros(2, np.int32))
    x = np.array(apply_top_k_top_p(mx.array(np.stack([logits, logits])), b))
    want = filtered_probs(logits, 1.0, kw.get("top_k", 0), kw.get("top_p", 1.0)) > 0
    assert (np.isfinite(x[0]) == want).all()
    assert np.isfinite(x[1]).all()
