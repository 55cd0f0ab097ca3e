"""`random`: a seeded uniform score per uid, for random baselines of the same size.

The score is a hash of (uid, seed), not a draw from a stream, so the same uid gets the same score whatever
the table's order or partitioning, and `--frac 0.1` is a subset of `--frac 0.2` for one seed.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from hype.data.uids import splitmix64
from hype.select.rules import RULES, Rule
from hype.table.reader import Batch


@RULES.register
class RandomScore(Rule):
    name: ClassVar[str] = "random"
    kind: ClassVar[str] = "score"
    summary: ClassVar[str] = "uniform score from a hash of (uid, seed): a random subset"
    PARAMS: ClassVar = {"seed": (int, 0, "seed of the hash")}
    OPTIONS: ClassVar = ("seed",)  # hype select --seed

    def columns(self) -> list[str]:
        return ["uid"]

    def score(self, batch: Batch) -> np.ndarray:
        hi, lo = batch.uid_pairs()
        seed = np.uint64(self.params["seed"] % 2**64)
        h = splitmix64(hi ^ splitmix64(lo ^ splitmix64(np.full_like(lo, seed))))
        return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53  # uniform in [0, 1)
