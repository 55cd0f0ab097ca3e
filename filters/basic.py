"""`basic`: DataComp's basic filter (DataComp baselines `load_uids_with_basic_filter`).

Keeps a row when its caption is English (fastText lid.176, offline via `hype.text.language`), has more
than 2 words (whitespace split) and more than 5 characters, and its image's shorter side is >= 200 px with
an aspect ratio (long / short side) <= 3. Every threshold is a parameter, e.g. `basic:min_side=32` for the
synthetic world, whose images are small. Rows with an unknown size (null or 0) fail the size rule.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from hype.select.rules import RULES, Rule
from hype.table.reader import Batch


@RULES.register
class BasicFilter(Rule):
    name: ClassVar[str] = "basic"
    kind: ClassVar[str] = "mask"
    summary: ClassVar[str] = "DataComp basic filter: English, > 2 words, > 5 chars, side >= 200, aspect <= 3"
    PARAMS: ClassVar = {
        "english": (bool, True, "require an English caption (fastText lid.176)"),
        "min_words": (int, 3, "at least this many whitespace-separated words (DataComp: > 2)"),
        "min_chars": (int, 6, "at least this many characters (DataComp: > 5)"),
        "min_side": (float, 200.0, "shorter image side in px, at least"),
        "max_aspect": (float, 3.0, "long side / short side, at most"),
    }

    def columns(self) -> list[str]:
        return ["text", "width", "height"]

    def mask(self, batch: Batch) -> np.ndarray:
        p = self.params
        texts = batch.texts("text")
        words = np.fromiter((len(t.split()) for t in texts), dtype=np.int64, count=len(texts))
        chars = np.fromiter((len(t) for t in texts), dtype=np.int64, count=len(texts))
        w, h = batch.numeric("width"), batch.numeric("height")
        short, long = np.fmin(w, h), np.fmax(w, h)
        with np.errstate(divide="ignore", invalid="ignore"):
            aspect = long / short
        keep = (words >= p["min_words"]) & (chars >= p["min_chars"])
        keep &= (short > 0) & (short >= p["min_side"]) & (aspect <= p["max_aspect"])
        if p["english"] and keep.any():
            keep[keep] = _english([texts[i] for i in np.flatnonzero(keep)])
        return keep


def _english(texts: list[str]) -> np.ndarray:
    """Language ID once per distinct caption (web pools repeat captions a lot)."""
    from hype.text.language import is_english

    unique, inverse = np.unique(np.array(texts, dtype=object), return_inverse=True)
    return is_english(list(unique))[inverse]
