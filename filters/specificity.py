"""`specificity`: ε_i + ε_t, the specificity-only ablation of HYPE (Fig. 5)."""

from __future__ import annotations

from typing import ClassVar

from hype.filters.hype import HypeScore
from hype.select.rules import RULES


@RULES.register
class Specificity(HypeScore):
    name: ClassVar[str] = "specificity"
    summary: ClassVar[str] = "eps_i + eps_t (specificity only)"
    PARAMS: ClassVar = {"normalize": HypeScore.PARAMS["normalize"]}
    OPTIONS: ClassVar = ("normalize",)  # hype select --normalize (its weights are fixed)
    FIXED_WEIGHTS: ClassVar = {"eps_i": 1.0, "eps_t": 1.0}
