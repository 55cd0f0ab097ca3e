"""Paired comparison of selection rules (hype.eval.compare): intervals, verdicts, chance tasks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hype.eval.compare import (
    informative_tasks,
    mean_interval,
    paired_difference,
    t975,
    task_average,
)


def test_t_quantiles_match_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in [1, 2, 4, 5, 9, 19, 30]:
        assert t975(df) == pytest.approx(stats.t.ppf(0.975, df), abs=6e-4)
    for df in [31, 40, 60, 120, 1000]:  # the interpolation beyond the table
        assert t975(df) == pytest.approx(stats.t.ppf(0.975, df), abs=0.01)


def test_interval_covers_the_true_mean_95_percent_of_the_time():
    # The property a confidence interval promises, checked by simulation (seeded, so deterministic).
    rng = np.random.default_rng(0)
    trials = 4000
    hits = 0
    for _ in range(trials):
        iv = mean_interval(rng.normal(0.3, 1.0, 5))
        hits += iv.low <= 0.3 <= iv.high
    assert abs(hits / trials - 0.95) < 0.015


def test_pairing_cancels_the_shared_seed_noise():
    # Each seed moves both rules together (init, data order); A is better by 0.02 on every seed.
    seed_effect = np.array([0.10, -0.05, 0.08, -0.12, 0.03])
    a, b = 0.30 + seed_effect, 0.28 + seed_effect + np.array([0.001, -0.002, 0.0, 0.002, -0.001])
    paired = paired_difference(a, b)
    assert paired.verdict == "better" and paired.low > 0
    assert paired.mean == pytest.approx(0.02)
    # The unpaired view of the same numbers cannot tell them apart.
    assert mean_interval(a).low < mean_interval(b).high
    assert paired_difference(b, a).verdict == "worse"
    noise = np.array([0.01, -0.01, 0.02, -0.02, 0.0])
    assert paired_difference(a, a + noise).verdict == "no difference shown"


def test_interval_numbers_against_a_hand_computation():
    d = [0.05, 0.02, 0.04, 0.01, 0.03]
    iv = mean_interval(d)
    half = 2.776 * np.std(d, ddof=1) / math.sqrt(5)
    assert (iv.mean, iv.low, iv.high, iv.n) == pytest.approx((0.03, 0.03 - half, 0.03 + half, 5))
    assert iv.to_dict()["verdict"] == "better"
    assert str(iv) == f"+0.030 [{0.03 - half:+.3f}, {0.03 + half:+.3f}]"


def test_bad_inputs_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="at least 2"):
        mean_interval([0.1])
    with pytest.raises(ValueError, match="same seeds"):
        paired_difference([0.1, 0.2], [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="finite"):
        mean_interval([0.1, float("nan")])
    with pytest.raises(ValueError, match="df >= 1"):
        t975(0)


def test_tasks_at_chance_for_every_rule_are_left_out():
    per_rule = {
        "hype": {"color": [0.6, 0.7, 0.65], "count": [0.26, 0.24, 0.25], "shape": [0.2, 0.22, 0.21]},
        "random": {"color": [0.16, 0.15, 0.17], "count": [0.25, 0.27, 0.23], "shape": [0.12, 0.13, 0.125]},
    }
    chance = {"color": 1 / 8, "count": 1 / 4, "shape": 1 / 8}
    kept, left = informative_tasks(per_rule, chance)
    # count is at chance for both rules; shape is above chance for one rule, so it stays.
    assert kept == ["color", "shape"] and left == ["count"]
    assert task_average({"color": 0.6, "count": 0.25, "shape": 0.2}, kept) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="no task"):
        task_average({"color": 0.6}, [])
