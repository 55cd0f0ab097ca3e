"""`negclip`: negCLIPLoss (Wang et al., NeurIPS 2024, "CLIPLoss and Norm-Based Data Selection Methods for
Multimodal Contrastive Learning"): the CLIP score minus the normalization term of the contrastive loss,
estimated over `k` random batches of `batch` rows each (a pair close to everything scores low):

    negclip(i) = x_i·y_i - τ/(2k) Σ_r [ log Σ_{j∈B_r(i)} exp(x_i·y_j/τ) + log Σ_{j∈B_r(i)} exp(x_j·y_i/τ) ]

x, y: the run's unit CLIP image and text embeddings (`RUN_DIR/embed/`, `clip_img` and `clip_txt`; the text
ones are stored only with `hype score ... embed.clip_txt=true`); B_r(i): the batch of row i in the r-th
seeded partition of the pool, whose rows are in uid order (so file order and row groups do not matter).

Byte-identical on any CPU and thread count: every dot product is of the embeddings rounded to a 2^-b grid
with d·4^b <= 2^53, so each product and every partial sum is an integer in float64 and BLAS's order and
blocking cannot change it (the rounding moves a dot product by at most √d·2^-(b+1), ~7e-6 at d = 768).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pyarrow.parquet as pq

from hype.data.uids import UidMultiset, arrow_to_pairs, sort_order, to_structured
from hype.io import open_input, read_parquet, read_parquet_schema, storage
from hype.scoring.embed_format import fixed_list_to_numpy
from hype.select.errors import SelectError
from hype.select.rules import RULES, Rule
from hype.table.reader import Batch

CHUNK_BYTES = 32 << 20  # one block of logits (rows of a batch x the batch), float64


@RULES.register
class NegClip(Rule):
    name: ClassVar[str] = "negclip"
    kind: ClassVar[str] = "score"
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

    def __init__(self, **params: Any):
        super().__init__(**params)
        p = self.params
        if p["k"] < 1 or p["batch"] < 2 or not p["temperature"] > 0:
            raise SelectError("rule 'negclip': k >= 1, batch >= 2 and temperature > 0, e.g. negclip:k=10")
        self.found: UidMultiset | None = None
        self.values = np.zeros(0)

    def columns(self) -> list[str]:
        return ["uid"]

    def attach(self, table) -> None:
        """Read every run's CLIP embeddings and score the whole pool (the batches span it)."""
        his, los, imgs, txts = [], [], [], []
        files = [
            f for folder in table.folders for f in sorted(storage.glob(f"{folder.parent}/embed/*.parquet"))
        ]
        if not files:
            raise SelectError(
                f"rule 'negclip': no embed/*.parquet beside {table.folders[0]}; score with hype score"
            )
        _check_memory(files, self.params["max_gb"])
        for f in files:
            t = read_parquet(f, columns=["uid", "clip_img", "clip_txt"])
            hi, lo = arrow_to_pairs(t.column("uid"), f"{f}: column 'uid'")
            his.append(hi)
            los.append(lo)
            imgs.append(fixed_list_to_numpy(t.column("clip_img")))
            txts.append(fixed_list_to_numpy(t.column("clip_txt")))
        hi, lo = np.concatenate(his), np.concatenate(los)
        order = sort_order(hi, lo)  # uid order: the batches do not depend on file order
        img, txt = np.concatenate(imgs)[order], np.concatenate(txts)[order]
        p = self.params
        values = neg_clip_loss(img, txt, p["temperature"], p["k"], p["batch"], p["seed"])
        self.found = UidMultiset(to_structured(hi[order], lo[order]))
        first = np.r_[0, np.cumsum(self.found.counts)[:-1]]  # a repeated uid keeps its first row's value
        self.values = values[first]

    def score(self, batch: Batch) -> np.ndarray:
        if self.found is None:
            raise SelectError("rule 'negclip' reads the run's embeddings first (Rule.attach)")
        at = self.found.find(*batch.uid_pairs())
        if (at < 0).any():
            raise SelectError(
                f"rule 'negclip': {int((at < 0).sum())} scored rows have no embed/ row (e.g. uid "
                f"{batch.texts('uid')[int(np.argmax(at < 0))]}); rescore the run with hype score"
            )
        return self.values[at]


def _check_memory(files: list[str], max_gb: float) -> None:
    """Refuse, before reading, a pool whose embeddings would not fit `max_gb`; name the fix."""
    rows = dim = 0
    for f in files:
        schema = read_parquet_schema(f)
        if "clip_txt" not in schema.names:
            raise SelectError(
                f"rule 'negclip': {f} has no clip_txt column (CLIP text embeddings); rerun hype score with "
                "embed.clip_txt=true (and --clip)"
            )
        dim = schema.field("clip_txt").type.list_size
        rows += _rows(f)
    need = rows * dim * 8 * 3 / 2**30  # float32 as read, then the float64 grid copies
    if need > max_gb:
        raise SelectError(
            f"rule 'negclip': {rows} rows x {dim} dims need ~{need:.1f} GB, over max_gb={max_gb:g}; "
            "raise it (negclip:max_gb=...) on a larger machine"
        )


def _rows(path: str) -> int:
    with open_input(path) as fh:
        return pq.ParquetFile(fh).metadata.num_rows


def grid_bits(dim: int) -> int:
    """b of the 2^-b grid on which a dot product of `dim` components in [-1, 1] sums exactly in float64."""
    return int((53 - np.ceil(np.log2(dim))) // 2)


def neg_clip_loss(img: np.ndarray, txt: np.ndarray, tau: float, k: int, batch: int, seed: int) -> np.ndarray:
    """negCLIPLoss of each row of unit `img`, `txt` (rows, d) over `k` seeded partitions into batches of
    `batch` rows (the last one smaller); float64."""
    n, d = img.shape
    b = grid_bits(d)
    qi = np.rint(np.clip(img, -1, 1).astype(np.float64) * 2.0**b)
    qt = np.rint(np.clip(txt, -1, 1).astype(np.float64) * 2.0**b)
    unit = 2.0 ** (-2 * b)
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
