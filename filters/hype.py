"""`hype`: the weighted sum of the HYPE terms (paper Eq. 1; equal weights, no normalization by default)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from hype.select.rules import RULES, Rule
from hype.table.combine import PAPER_WEIGHTS, Combiner, format_weights, parse_weights
from hype.table.reader import Batch


@RULES.register
class HypeScore(Rule):
    name: ClassVar[str] = "hype"
    kind: ClassVar[str] = "score"
    summary: ClassVar[str] = "weighted sum of eps_i, eps_t, neg_d_l, cos_theta, c_in (HYPE Eq. 1)"
    PARAMS: ClassVar = {
        "weights": (str, format_weights(PAPER_WEIGHTS), "METRIC=W,... (unnamed metrics get 0)"),
        "normalize": (str, "none", "none | zscore | rank, over the whole pool before weighting"),
    }
    OPTIONS: ClassVar = ("weights", "normalize")  # hype select --weights, --normalize
    FIXED_WEIGHTS: ClassVar[Mapping[str, float] | None] = None  # subclasses that are one fixed sum
    ANY_COLUMN: ClassVar[bool] = False  # weights on other columns than the HYPE terms (`combine`)

    def __init__(self, weights: str | Mapping[str, Any] | None = None, **params: Any):
        if weights is not None and not isinstance(weights, str):
            weights = format_weights(parse_weights(weights, any_column=self.ANY_COLUMN))
        if weights is not None:
            params["weights"] = weights
        super().__init__(**params)
        fixed = self.FIXED_WEIGHTS
        self.weights = dict(
            parse_weights(fixed if fixed is not None else self.params["weights"], any_column=self.ANY_COLUMN)
        )
        if "weights" in self.params:
            self.params["weights"] = format_weights(self.weights)
        self.combiner = Combiner(self.weights, self.params["normalize"])

    def columns(self) -> list[str]:
        return list(self.combiner.metrics)

    @property
    def needs_pool_pass(self) -> bool:
        return self.combiner.needs_pool_pass

    def observe(self, batch: Batch) -> None:
        self.combiner.observe({m: batch.numeric(m) for m in self.combiner.metrics})

    def finish_observe(self) -> None:
        self.combiner.finish_observe()

    def score(self, batch: Batch) -> np.ndarray:
        return self.combiner.score({m: batch.raw(m) for m in self.combiner.metrics})

    def terms(self) -> list[str]:
        return list(self.combiner.metrics)

    def contribution(self, metric: str, values: np.ndarray) -> np.ndarray:
        # weight * normalized value, exactly the addend `weighted_sum` adds for this metric
        w = self.combiner.weights[metric]
        x = values if self.combiner.normalize == "none" else self.combiner.transform(metric, values)
        return np.multiply(x, w, dtype=np.float64)

    def describe(self) -> dict:
        out = {"rule": self.name, "weights": self.weights, "normalize": self.params["normalize"]}
        if self.combiner.params:
            out["normalization"] = self.combiner.params
        return out

    @classmethod
    def headline(cls, record: Mapping[str, Any]) -> str:
        if "weights" not in cls.OPTIONS:  # one fixed sum (clip_score, specificity): its name says which
            return super().headline(record)
        w = " + ".join(f"{v:g}*{m}" if v != 1 else m for m, v in record["weights"].items() if v)
        return f"{record['rule']} ({w}; normalize {record['normalize']})"
