"""`random`: a seeded uniform score per uid, for random baselines of the same size.

The score is a hash of (uid, seed), not a draw from a stream, so the same uid gets the same score whatever
the table's order or partitioning, and `--frac 0.1` is a subset of `--frac 0.2` for one seed.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from filters.base import Rule
from hype.select.table import Batch

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer, vectorised (uint64 arithmetic wraps modulo 2^64, as intended)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


class RandomScore(Rule):
    name: ClassVar[str] = "random"
    kind: ClassVar[str] = "score"
    summary: ClassVar[str] = "uniform score from a hash of (uid, seed): a random subset"
    PARAMS: ClassVar = {"seed": (int, 0, "seed of the hash")}

    def columns(self) -> list[str]:
        return ["uid"]

    def score(self, batch: Batch) -> np.ndarray:
        hi, lo = batch.uid_pairs()
        seed = np.uint64(self.params["seed"] % 2**64)
        h = splitmix64(hi ^ splitmix64(lo ^ splitmix64(np.full_like(lo, seed))))
        return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53  # uniform in [0, 1)
