"""Combining the HYPE terms into one score: weights and pool-level normalization.

`HYPE = ε_i + ε_t + (−d_L) + cos θ + c_IN` (paper Eq. 1) is the default: every weight 1, no
normalization. `zscore` and `rank` rescale each metric over the whole scored pool before weighting, so that
weights mean the same thing whatever the metrics' units; their statistics take one extra streaming pass.

- `zscore`: (x − mean) / std with the pool's mean and population std (a constant metric maps to 0).
- `rank`: the pool mid-rank of x as a fraction in (0, 1): (#values below x + #values equal to x / 2) / n,
  with values compared after rounding to a 22-bit key (values within a relative 2^-13 count as equal).

The sum is accumulated in float64, in the fixed order of `METRICS`, so a score depends only on its row.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np

from hype.data.errors import SelectError
from hype.table.keys import KeyHistogram
from hype.table.schema import METRICS

NORMALIZATIONS = ("none", "zscore", "rank")
RANK_BITS = 22

PAPER_WEIGHTS = dict.fromkeys(METRICS, 1.0)


def weighted_sum(
    columns: Mapping[str, np.ndarray],
    weights: Mapping[str, float],
    transform: Callable[[str, np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """Σ weight·column over METRICS, in that order, in float64; metrics with weight 0 (or none) are not
    read, and `transform(metric, column)` (a normalization) is applied to each as it is read. float32
    columns are widened exactly inside the ufuncs (no float64 copy of each column), so the result is the
    same as summing float64 copies."""
    total: np.ndarray | None = None
    for m in summed_order(weights):
        w = float(weights.get(m, 0.0))
        if w == 0.0:
            continue
        x = columns[m] if transform is None else transform(m, columns[m])
        if total is None:
            total = np.multiply(x, w, dtype=np.float64) if w != 1.0 else np.array(x, dtype=np.float64)
        elif w == 1.0:
            np.add(total, x, out=total, dtype=np.float64)
        else:
            total += np.multiply(x, w, dtype=np.float64)
    if total is None:
        raise SelectError("every weight is 0, so every sample would tie; give a metric a weight")
    return total


def summed_order(weights: Mapping[str, float]) -> list[str]:
    """The order of a weighted sum: METRICS in theirs, then any other column (`combine`) by name."""
    return [*METRICS, *sorted(k for k in weights if k not in METRICS)]


def hype_score(columns: Mapping[str, np.ndarray]) -> np.ndarray:
    """The HYPE score of paper Eq. 1, ε_i + ε_t + (−d_L) + cos θ + c_IN: `weighted_sum` at PAPER_WEIGHTS."""
    return weighted_sum(columns, PAPER_WEIGHTS)


def parse_weights(spec: str | Mapping[str, object], *, any_column: bool = False) -> dict[str, float]:
    """`"eps_i=1,eps_t=0.5"` or a mapping -> {metric: weight} over all of METRICS (unnamed metrics: 0);
    `any_column`: other names too (`combine`, which checks them against the table)."""
    if isinstance(spec, Mapping):
        items = [(str(k), v) for k, v in spec.items()]
    else:
        items = []
        for part in str(spec).split(","):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise SelectError(
                    f"--weights: {part!r} is not METRIC=WEIGHT; write e.g. --weights eps_i=1,eps_t=1"
                )
            k, v = part.split("=", 1)
            items.append((k.strip(), v.strip()))
    weights = dict.fromkeys(METRICS, 0.0)
    seen = set()
    for name, value in items:
        if name not in METRICS and not any_column:
            raise SelectError(f"--weights: unknown metric {name!r}; the metrics are {', '.join(METRICS)}")
        if name in seen:
            raise SelectError(f"--weights: {name} is given twice")
        seen.add(name)
        try:
            w = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise SelectError(f"--weights: weight of {name} is {value!r}, not a number") from None
        if not math.isfinite(w):
            raise SelectError(f"--weights: weight of {name} is {w}; weights must be finite")
        weights[name] = w
    if not any(weights.values()):
        raise SelectError(
            "--weights: every weight is 0, so every sample would tie; give at least one metric a weight"
        )
    return weights


def format_weights(weights: Mapping[str, float]) -> str:
    return ",".join(f"{m}={_num(w)}" for m, w in weights.items() if w)


def _num(w: float) -> str:
    return str(int(w)) if float(w).is_integer() else repr(float(w))


class Combiner:
    """Weighted sum of (optionally normalized) metrics; `observe` every pool batch first unless `none`."""

    def __init__(self, weights: Mapping[str, float], normalize: str = "none"):
        if normalize not in NORMALIZATIONS:
            raise SelectError(f"--normalize: {normalize!r} is not one of {', '.join(NORMALIZATIONS)}")
        self.weights = {m: float(weights.get(m, 0.0)) for m in summed_order(weights)}
        self.metrics = [m for m in self.weights if self.weights[m] != 0.0]
        if not self.metrics:
            raise SelectError("every weight is 0, so every sample would tie; give a metric a weight")
        self.normalize = normalize
        self._n = dict.fromkeys(self.metrics, 0)
        self._sum = dict.fromkeys(self.metrics, 0.0)
        self._mean = dict.fromkeys(self.metrics, 0.0)
        self._m2 = dict.fromkeys(self.metrics, 0.0)
        self._hist = {m: KeyHistogram(RANK_BITS) for m in self.metrics} if normalize == "rank" else {}
        self._midranks: dict[str, np.ndarray] = {}
        self.params: dict[str, dict[str, float]] = {}

    @property
    def needs_pool_pass(self) -> bool:
        return self.normalize != "none"

    def observe(self, columns: Mapping[str, np.ndarray]) -> None:
        for m in self.metrics:
            x = np.asarray(columns[m], dtype=np.float64)
            if self.normalize == "zscore" and len(x):
                n, mean = len(x), float(x.mean())
                m2 = float(np.square(x - mean).sum())
                total = self._n[m] + n
                delta = mean - self._mean[m]
                self._mean[m] += delta * n / total
                self._m2[m] += m2 + delta * delta * self._n[m] * n / total
                self._n[m] = total
            elif self.normalize == "rank":
                self._hist[m].add(x)

    def finish_observe(self) -> None:
        for m in self.metrics:
            if self.normalize == "zscore":
                n = self._n[m]
                std = math.sqrt(self._m2[m] / n) if n else 0.0
                self.params[m] = {"mean": self._mean[m], "std": std}
            elif self.normalize == "rank":
                self._midranks[m] = self._hist[m].midranks()
                self.params[m] = {"bins": float(1 << RANK_BITS)}

    def transform(self, metric: str, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        if self.normalize == "zscore":
            p = self.params[metric]
            return (x - p["mean"]) / p["std"] if p["std"] > 0 else np.zeros_like(x)
        if self.normalize == "rank":
            return self._midranks[metric][self._hist[metric].bins(x)]
        return x

    def score(self, columns: Mapping[str, np.ndarray]) -> np.ndarray:
        """`weighted_sum` of the (normalized) metrics."""
        return weighted_sum(columns, self.weights, None if self.normalize == "none" else self.transform)
