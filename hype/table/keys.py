"""Order-preserving integer keys of floats, and histograms over their top bits.

Mapping a float's bit pattern to an unsigned integer that sorts the same way (flip every bit of negatives,
the sign bit of positives) turns "which values are above x" into integer comparisons and lets a fixed-size
`np.bincount` over the key's top bits stand in for a sort: exact counts per bin, a few MB whatever the
table size. The reducer, the pool statistics and rank normalization are all built on this.
"""

from __future__ import annotations

import numpy as np

_SIGN64 = np.uint64(1 << 63)
_SIGN32 = np.uint32(1 << 31)


def key64(x: np.ndarray) -> np.ndarray:
    """float64 -> uint64 with the same order (`a < b` iff `key64(a) < key64(b)`); no NaNs allowed.

    -0.0 is folded onto +0.0 first: they compare equal as floats and must share a key.
    """
    bits = (np.asarray(x, dtype=np.float64) + 0.0).view(np.uint64)
    return bits ^ ((bits.view(np.int64) >> 63).view(np.uint64) | _SIGN64)


def bins64(x: np.ndarray, bits: int) -> np.ndarray:
    """`key64(x) >> (64 - bits)` as int64 bin numbers, computed in place on one copy (this runs on every
    row of a pass: six temporaries of n x 8 bytes would cost as much as sorting)."""
    k = np.add(x, 0.0, dtype=np.float64).view(np.uint64)  # the one copy; + 0.0 folds -0.0 onto +0.0
    mask = (k.view(np.int64) >> 63).view(np.uint64)
    mask |= _SIGN64
    k ^= mask
    k >>= np.uint64(64 - bits)
    return k.view(np.int64)


def unkey64(k: np.ndarray | int) -> np.ndarray:
    """Inverse of `key64`."""
    k = np.asarray(k, dtype=np.uint64)
    neg = (k & _SIGN64) == 0
    return np.where(neg, ~k, k ^ _SIGN64).view(np.float64)


def key32(x: np.ndarray) -> np.ndarray:
    """float32 -> uint32 with the same order (values are rounded to float32 first)."""
    bits = np.add(x, np.float32(0.0), dtype=np.float32).view(np.uint32)
    return bits ^ ((bits.view(np.int32) >> 31).view(np.uint32) | _SIGN32)


def unkey32(k: np.ndarray | int) -> np.ndarray:
    k = np.asarray(k, dtype=np.uint32)
    neg = (k & _SIGN32) == 0
    return np.where(neg, ~k, k ^ _SIGN32).view(np.float32)


class KeyHistogram:
    """Exact counts of float32-rounded values per bin of the top `bits` bits of their `key32`.

    Bins are narrow in relative terms (2^-(bits-9) of a value's binade: 2^-11 for 20 bits), so quantiles
    read from it are within that relative error, and equal values always share a bin.
    """

    def __init__(self, bits: int = 20):
        self.bits = bits
        self.shift = 32 - bits
        self.counts = np.zeros(1 << bits, dtype=np.int64)

    def bins(self, values: np.ndarray) -> np.ndarray:
        return (key32(values) >> np.uint32(self.shift)).astype(np.intp)

    def add(self, values: np.ndarray) -> None:
        if len(values):
            self.counts += np.bincount(self.bins(values), minlength=len(self.counts))

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def lower_edge(self, b: np.ndarray | int) -> np.ndarray:
        """Smallest float32 value that falls in bin `b`."""
        return unkey32(np.asarray(b, dtype=np.uint32) << np.uint32(self.shift))

    def quantiles(self, qs: tuple[float, ...]) -> list[float]:
        """Lower edges of the bins holding each quantile (the value of rank ceil(q * n), 1-based)."""
        n = self.total
        if n == 0:
            return [float("nan")] * len(qs)
        cum = np.cumsum(self.counts)
        out = []
        for q in qs:
            rank = max(1, int(np.ceil(q * n)))
            out.append(float(self.lower_edge(int(np.searchsorted(cum, rank)))))
        return out

    def midranks(self) -> np.ndarray:
        """Per bin, the mid-rank of its values as a fraction of the total, in (0, 1) (rank normalization)."""
        n = max(self.total, 1)
        below = np.cumsum(self.counts) - self.counts
        return (below + 0.5 * self.counts) / n
