"""Bounded-memory running selections over a stream of per-shard arrays.

Rows are identified by a global order id (`order_id(shard index, row)`), which is also the tie-break, so
a streamed selection equals a stable sort of the whole pool: highest score first and, among equal
scores, the earlier sample (by shard order, then row) first.
"""

from __future__ import annotations

import numpy as np


def order_id(shard_index: int, rows: np.ndarray) -> np.ndarray:
    """Global pool-order ids: shard index in the high 32 bits, row in the low 32."""
    return (np.int64(shard_index) << np.int64(32)) | np.asarray(rows, dtype=np.int64)


def split_order_id(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(ids, dtype=np.int64)
    return ids >> np.int64(32), ids & np.int64(0xFFFFFFFF)


class RunningTopK:
    """The k best rows seen so far: largest `score` (or smallest with `largest=False`), ties by id.

    Optional `payload` arrays (e.g. embeddings) travel with their rows. Memory: k + one block.
    """

    def __init__(self, k: int, *, largest: bool = True):
        self.k = k
        self.largest = largest
        self.scores: np.ndarray | None = None
        self.ids = np.zeros(0, dtype=np.int64)
        self.payload: np.ndarray | None = None

    def add(self, scores: np.ndarray, ids: np.ndarray, payload: np.ndarray | None = None) -> None:
        if len(ids) == 0:
            return
        scores = np.asarray(scores)
        if self.scores is None:
            self.scores = scores[:0].copy()
            if payload is not None:
                self.payload = payload[:0].copy()
        s = np.concatenate([self.scores, scores])
        i = np.concatenate([self.ids, np.asarray(ids, dtype=np.int64)])
        key = -s.astype(np.float64) if self.largest and s.dtype.kind == "f" else s
        if self.largest and s.dtype.kind != "f":
            raise TypeError("largest=True needs float scores")
        order = np.lexsort((i, key))[: self.k]
        self.scores, self.ids = s[order], i[order]
        if payload is not None:
            self.payload = np.concatenate([self.payload, payload])[order]

    def __len__(self) -> int:
        return len(self.ids)
