"""Comparing selection rules by the models they train: paired differences over seeds, with a verdict.

A comparison trains one model per (rule, seed) with the same seed for every rule, so seed s of rule A and
seed s of rule B start from the same initialisation and see the data in the same order; what differs is
only the subset. The seed-to-seed noise then largely cancels in the per-seed difference A_s - B_s, and
the question "is A better than B?" becomes a one-sample question about those differences:

    mean difference d = mean_s (A_s - B_s),  95% interval d ± t(0.975, n-1) · sd_s(A_s - B_s) / sqrt(n)

(Student's t on n paired differences). The verdict is "A > B" when the whole interval is above 0,
"A < B" when below, else "no difference shown".

A task at chance for every rule carries no information about the rules, only noise; `informative_tasks`
finds them (no rule's mean is above chance by more than its own 95% half-width) so that the average can
leave them out, and says which it left out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

# Two-sided 95% quantiles of Student's t, t(0.975, df), for df = 1..30; beyond 30 the interpolation to
# the normal quantile (1.960) is within 0.01. Values to 3 decimals, as printed in every statistics table.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
_Z975 = 1.959964


def t975(df: int) -> float:
    """t(0.975, df): the multiplier of the standard error for a two-sided 95% interval."""
    if df < 1:
        raise ValueError(f"a confidence interval needs at least 2 paired values (df >= 1), got df={df}")
    if df <= len(_T975):
        return _T975[df - 1]
    # 1/df interpolation between df = 30 and the normal limit (exact at both ends).
    return _Z975 + (_T975[-1] - _Z975) * len(_T975) / df


@dataclass(frozen=True)
class Interval:
    """Mean of paired values with its two-sided 95% interval and the verdict it supports."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def verdict(self) -> str:
        if self.low > 0:
            return "better"
        if self.high < 0:
            return "worse"
        return "no difference shown"

    def to_dict(self) -> dict:
        return {**asdict(self), "verdict": self.verdict}

    def __str__(self) -> str:
        return f"{self.mean:+.3f} [{self.low:+.3f}, {self.high:+.3f}]"


def mean_interval(values: Sequence[float]) -> Interval:
    """Mean of `values` with its 95% Student-t interval (the paired test when they are differences)."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or len(x) < 2:
        raise ValueError(f"need at least 2 values for an interval, got {len(x)}")
    if not np.isfinite(x).all():
        raise ValueError("values must be finite")
    mean = float(x.mean())
    half = t975(len(x) - 1) * float(x.std(ddof=1)) / math.sqrt(len(x))
    return Interval(mean, mean - half, mean + half, len(x))


def paired_difference(a: Sequence[float], b: Sequence[float]) -> Interval:
    """A - B over the same seeds: the mean per-seed difference and its 95% interval."""
    if len(a) != len(b):
        raise ValueError(f"paired comparison needs the same seeds on both sides, got {len(a)} and {len(b)}")
    return mean_interval(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))


def informative_tasks(
    per_rule: Mapping[str, Mapping[str, Sequence[float]]], chance: Mapping[str, float]
) -> tuple[list[str], list[str]]:
    """(kept, left out): a task is left out when, for every rule, the mean over seeds is not above the
    task's chance level by more than its 95% half-width. `per_rule[rule][task]` holds one value per seed."""
    tasks = sorted({t for by_task in per_rule.values() for t in by_task})
    kept, left = [], []
    for task in tasks:
        level = chance.get(task, 0.0)
        above = any(
            mean_interval(by_task[task]).low > level for by_task in per_rule.values() if task in by_task
        )
        (kept if above else left).append(task)
    return kept, left


def task_average(metrics: Mapping[str, float], tasks: Sequence[str]) -> float:
    """Unweighted mean of the given tasks' metrics (DataComp's average, over `tasks` only)."""
    if not tasks:
        raise ValueError("no task to average")
    return float(np.mean([metrics[t] for t in tasks]))
