"""Named, independent random streams, with cheap scalar draws.

Every part of the world (pool, clean set, each eval task, the reference set) draws from its own stream
`SeedSequence(seed, spawn_key=(crc32(name),))`: changing the pool size changes nothing else.

Scene sampling makes many scalar draws; numpy's `Generator` costs microseconds per scalar call from
Python, so `Rng` draws uniforms in blocks and serves them one at a time (about 10x cheaper). The
sequence is still a pure function of the seed.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")
_BLOCK = 2048


class Rng:
    """A numpy `Generator` with buffered scalar draws. Array draws go straight to `self.gen`."""

    def __init__(self, gen: np.random.Generator):
        self.gen = gen
        self._buf = gen.random(_BLOCK).tolist()
        self._i = 0

    def random(self) -> float:
        if self._i == _BLOCK:
            self._buf = self.gen.random(_BLOCK).tolist()
            self._i = 0
        u = self._buf[self._i]
        self._i += 1
        return u

    def uniform(self, lo: float, hi: float) -> float:
        return lo + (hi - lo) * self.random()

    def integers(self, lo: int, hi: int | None = None) -> int:
        """An int in [lo, hi) (or [0, lo) with one argument), like `Generator.integers`."""
        if hi is None:
            lo, hi = 0, lo
        return lo + min(int(self.random() * (hi - lo)), hi - lo - 1)

    def pick(self, options: Sequence[T]) -> T:
        return options[self.integers(len(options))]

    def weighted(self, weights: Sequence[float]) -> int:
        """An index drawn with probability proportional to `weights`."""
        u = self.random() * sum(weights)
        for i, w in enumerate(weights):
            u -= w
            if u < 0:
                return i
        return len(weights) - 1

    def permutation(self, n: int) -> np.ndarray:
        return self.gen.permutation(n)

    def seed(self) -> int:
        """A fresh 63-bit seed for a sub-generator (pixel noise, jitter)."""
        return int(self.gen.integers(0, 2**63 - 1))


def stream(seed: int, name: str) -> Rng:
    """The independent stream of one named part of the world."""
    return Rng(np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(zlib.crc32(name.encode()),))))
