"""`negclip`: negCLIPLoss (Wang et al., NeurIPS 2024, "CLIPLoss and Norm-Based Data Selection Methods for
Multimodal Contrastive Learning"): the CLIP score minus the normalization term of the contrastive loss,
estimated over `k` random batches of `batch` rows each (a pair close to everything scores low):

    negclip(i) = x_i·y_i - τ/(2k) Σ_r [ log Σ_{j∈B_r(i)} exp(x_i·y_j/τ) + log Σ_{j∈B_r(i)} exp(x_j·y_i/τ) ]

x, y: the run's unit CLIP image and text embeddings (`RUN_DIR/embed/`, `clip_img` and `clip_txt`; the text
ones are stored only with `hype score ... embed.clip_txt=true`); B_r(i): the batch of row i in the r-th
seeded partition of the pool, whose rows are in uid order (so file order and row groups do not matter).

Byte-identical on any CPU and thread count: dot products on the exact grid of `hype.filters.embeddings`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from hype.filters.embeddings import PoolEmbeddings, PoolRule, grid_unit, on_grid
from hype.select.errors import SelectError
from hype.select.rules import RULES

CHUNK_BYTES = 32 << 20  # one block of logits (rows of a batch x the batch), float64


@RULES.register
class NegClip(PoolRule):
    name: ClassVar[str] = "negclip"
    summary: ClassVar[str] = "negCLIPLoss: cos θ minus the contrastive normalization over random batches"
    PARAMS: ClassVar = {
        "k": (int, 10, "random batch partitions averaged over (the paper's K)"),
        "batch": (int, 32768, "rows per random batch (the paper's B)"),
        "temperature": (
            float,
            0.01,
            "CLIP's τ = 1/logit_scale of the model that scored the run (OpenAI: 0.01)",
        ),
        "seed": (int, 0, "seed of the random batches"),
        "max_gb": (float, 16.0, "refuse a pool whose embeddings (float64, image and text) exceed this"),
    }
    EMBEDDINGS: ClassVar = ("clip_img", "clip_txt")
    FIX: ClassVar = {"clip_txt": "rerun hype score with embed.clip_txt=true (and --clip)"}

    def __init__(self, **params: Any):
        super().__init__(**params)
        p = self.params
        if p["k"] < 1 or p["batch"] < 2 or not p["temperature"] > 0:
            raise SelectError("rule 'negclip': k >= 1, batch >= 2 and temperature > 0, e.g. negclip:k=10")

    def pool_values(self, table, pool: PoolEmbeddings) -> np.ndarray:
        """The whole pool at once: the random batches span it."""
        p = self.params
        img, txt = pool.arrays["clip_img"], pool.arrays["clip_txt"]
        return neg_clip_loss(img, txt, p["temperature"], p["k"], p["batch"], p["seed"])


def neg_clip_loss(img: np.ndarray, txt: np.ndarray, tau: float, k: int, batch: int, seed: int) -> np.ndarray:
    """negCLIPLoss of each row of unit `img`, `txt` (rows, d) over `k` seeded partitions into batches of
    `batch` rows (the last one smaller); float64."""
    n, d = img.shape
    qi, qt, unit = on_grid(img), on_grid(txt), grid_unit(d)
    own = np.add.reduce(qi * qt, axis=1) * unit  # exact integer sums, then one rounding
    norm = np.zeros(n)
    for r in range(k):
        perm = np.random.default_rng([seed, r]).permutation(n)
        for s in range(0, n, batch):
            rows = perm[s : s + batch]
            bi, bt = qi[rows], qt[rows]
            norm[rows] += _logsumexp(bi, bt, unit / tau) + _logsumexp(bt, bi, unit / tau)
    return own - tau * norm / (2 * k)


def _logsumexp(a: np.ndarray, c: np.ndarray, scale: float) -> np.ndarray:
    """log Σ_j exp(scale · a_i·c_j) per row i of `a`, a block of rows at a time (bounded memory)."""
    out = np.empty(len(a))
    step = max(1, CHUNK_BYTES // (8 * len(c)))
    for s in range(0, len(a), step):
        logits = (a[s : s + step] @ c.T) * scale  # integer sums: exact whatever the BLAS
        top = logits.max(axis=1)
        out[s : s + step] = top + np.log(np.add.reduce(np.exp(logits - top[:, None]), axis=1))
    return out
