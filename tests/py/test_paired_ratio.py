"""benchmarks/paired_ratio.py: the sign-test interval of a median, against the published
order statistics and by its coverage on simulated runs."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from paired_ratio import median_interval, summarise  # noqa: E402


@pytest.mark.parametrize("n, ranks", [(6, (1, 6)), (10, (2, 9)), (20, (6, 15)), (60, (22, 39)),
                                      (100, (40, 61))])
def test_interval_is_the_sign_test_order_statistics(n, ranks):
    # the 95 % ranks of the standard sign-test tables (1-based)
    values = np.arange(1.0, n + 1)[::-1]  # any order in
    assert median_interval(values) == ranks


def test_too_few_values_for_the_confidence():
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    assert median_interval([1.0, 2.0, 3.0], confidence=0.70) == (1.0, 3.0)


def test_coverage_holds_on_skewed_noisy_ratios():
    rng = np.random.default_rng(7)
    true_median = np.exp(0.05)
    trials, hits = 2000, 0
    for _ in range(trials):
        lo, hi = median_interval(rng.lognormal(0.05, 0.5, 40))
        hits += lo <= true_median <= hi
    assert hits / trials >= 0.94  # at least 95 % by construction, less a trial's noise


def test_summary_counts_the_wins():
    s = summarise([0.9, 1.1, 1.2, 1.3, 0.8, 1.05])
    assert s["above_one"] == 4 and s["n"] == 6 and s["median"] == pytest.approx(1.075)
    assert s["interval95"] == (0.8, 1.3)
