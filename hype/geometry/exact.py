"""Machine-independent float64 products of float32 rows, for the searches whose results must be the same
bytes on any CPU or GPU (k-means assignment, near-duplicate and embedding-rule searches): a fast search
(BLAS, faiss, a GPU) runs below its cut by a margin from `fp32_dot_error`, and what it finds is measured
again with `pair_dots`.

numpy only, so that the commands that never run a model (`hype select`, `download`, `reshard`) start
without importing torch.
"""

from __future__ import annotations

import numpy as np


def fp32_dot_error(dim: int) -> float:
    """d·2^-24: the bound (to first order) on the rounding error of a float32 dot product of `dim` terms,
    relative to |x||y|, whatever the summation order or blocking (BLAS, faiss, a GPU with TF32 off). The
    searches that `pair_dots` confirms run below their cut by a multiple of it, so nothing is missed."""
    return dim * 2.0**-24


def pair_dots(x: np.ndarray, y: np.ndarray, a: np.ndarray, b: np.ndarray, chunk: int = 1 << 12) -> np.ndarray:
    """float64 dot product of each pair of float32 rows (x[a[i]], y[b[i]]), the same bytes on any machine,
    for any batch: float64 products of float32 values are exact, and numpy sums each contiguous row in its
    pairwise order, which its length alone sets (no BLAS, no threads, no SIMD width: the unrolled order is
    numpy's C code's); `chunk` pairs at a time (24 MiB at 768-d)."""
    out = np.empty(len(a), np.float64)
    for i in range(0, len(a), chunk):
        prod = x[a[i : i + chunk]].astype(np.float64)
        prod *= y[b[i : i + chunk]]
        out[i : i + chunk] = np.add.reduce(prod, axis=1)
    return out
