"""`clip_score`: cos θ alone, DataComp's CLIP-score baseline (HYPE Table 3's "CLIP" row)."""

from __future__ import annotations

from typing import ClassVar

from hype.filters.hype import HypeScore
from hype.select.rules import RULES


@RULES.register
class ClipScore(HypeScore):
    name: ClassVar[str] = "clip_score"
    summary: ClassVar[str] = "cos θ (CLIP score), DataComp's CLIP-score baseline"
    PARAMS: ClassVar = {"normalize": HypeScore.PARAMS["normalize"]}
    OPTIONS: ClassVar = ("normalize",)  # hype select --normalize (its weights are fixed)
    FIXED_WEIGHTS: ClassVar = {"cos_theta": 1.0}
