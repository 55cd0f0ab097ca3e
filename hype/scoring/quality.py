"""How well each score separates clean samples from each kind of noise (synthetic world, DESIGN §5).

For a noise kind k and a metric m: AUROC = P(m(clean sample) > m(sample of kind k)), ties counting
one half: 1.0 means the metric ranks every clean sample above every noisy one, 0.5 is chance, below 0.5
means the metric prefers the noise. Computed from ranks (Mann-Whitney U) with ties averaged.
"""

from __future__ import annotations

import numpy as np

from hype.scoring.schema import METRICS
from hype.select.combine import hype_score


def average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of `x`, tied values sharing the mean of their ranks."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    # Group boundaries of equal values; each group gets the mean of its 1-based positions.
    starts = np.r_[0, np.nonzero(np.diff(sorted_x))[0] + 1]
    ends = np.r_[starts[1:], len(x)]
    mean_rank = (starts + ends + 1) / 2.0
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return ranks


def auroc(scores: np.ndarray, positive: np.ndarray) -> float:
    """Area under the ROC curve of `scores` for the boolean labels `positive` (higher = positive)."""
    scores = np.asarray(scores, dtype=np.float64)
    positive = np.asarray(positive, dtype=bool)
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"AUROC needs both classes, got {n_pos} positives and {n_neg} negatives")
    if not np.isfinite(scores).all():
        raise ValueError("scores contain NaN or inf")
    ranks = average_ranks(scores)
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def noise_auroc_table(df, noise_column: str = "noise", clean: str = "clean") -> dict[str, dict[str, float]]:
    """metric (the five terms and `hype`) -> noise kind -> AUROC of clean vs that kind."""
    kinds = sorted(k for k in df[noise_column].unique() if k != clean)
    columns = {m: df[m].to_numpy(np.float64) for m in METRICS}
    columns["hype"] = hype_score(columns)
    is_clean = (df[noise_column] == clean).to_numpy()
    table: dict[str, dict[str, float]] = {}
    for name, values in columns.items():
        table[name] = {}
        for kind in kinds:
            sel = is_clean | (df[noise_column] == kind).to_numpy()
            table[name][kind] = auroc(values[sel], is_clean[sel])
    return table
