"""What the rules that read a run's CLIP embeddings (`negclip`, `normsim`) share: the pool's `RUN_DIR/embed/`
tables in uid order (memory checked before reading), a value per uid, and dot products on an exact grid.

Byte-identical on any CPU and thread count: the dot products are of the embeddings rounded to a 2^-b grid
with d·4^b <= 2^53, so each product and every partial sum is an integer in float64 and BLAS's order and
blocking cannot change it (the rounding moves a dot product of unit vectors by at most √d·2^-(b+1), ~7e-6
at d = 768).
"""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

from hype.data.uids import UidMultiset, arrow_to_pairs, sort_order, to_structured
from hype.io import open_input, read_parquet, read_parquet_schema, storage
from hype.scoring.embed_format import fixed_list_to_numpy
from hype.select.errors import SelectError
from hype.table.reader import Batch


class PoolEmbeddings:
    """Columns of every run's embed tables, rows in uid order (file order and row groups do not matter)."""

    def __init__(self, rule: str, table, columns: list[str], max_gb: float, fix: dict[str, str]):
        files = [
            f for folder in table.folders for f in sorted(storage.glob(f"{folder.parent}/embed/*.parquet"))
        ]
        if not files:
            raise SelectError(
                f"rule {rule!r}: no embed/*.parquet beside {table.folders[0]}; score with hype score"
            )
        rows = dim = 0
        for f in files:  # before reading: the columns exist and fit
            names = read_parquet_schema(f).names
            for c in columns:
                if c not in names:
                    raise SelectError(
                        f"rule {rule!r}: {f} has no {c} column; {fix.get(c, 'rescore the run')}"
                    )
            dim = read_parquet_schema(f).field(columns[0]).type.list_size
            with open_input(f) as fh:
                rows += pq.ParquetFile(fh).metadata.num_rows
        need = rows * dim * len(columns) * 12 / 2**30  # float32 as read, float64 on the grid
        if need > max_gb:
            raise SelectError(
                f"rule {rule!r}: {rows} rows x {dim} dims need ~{need:.1f} GB, over max_gb={max_gb:g}; "
                f"raise it ({rule}:max_gb=...) on a machine with more memory"
            )
        his, los, parts = [], [], {c: [] for c in columns}
        for f in files:
            t = read_parquet(f, columns=["uid", *columns])
            hi, lo = arrow_to_pairs(t.column("uid"), f"{f}: column 'uid'")
            his.append(hi)
            los.append(lo)
            for c in columns:
                parts[c].append(fixed_list_to_numpy(t.column(c)))
        hi, lo = np.concatenate(his), np.concatenate(los)
        order = sort_order(hi, lo)
        self.rule = rule
        self.arrays = {c: np.concatenate(parts[c])[order] for c in columns}
        self.uids = UidMultiset(to_structured(hi[order], lo[order]))
        self.first = np.r_[0, np.cumsum(self.uids.counts)[:-1]]  # a repeated uid: its first row

    def per_row(self, values: np.ndarray, batch: Batch) -> np.ndarray:
        """`values` (one per embedded row, uid order) of the batch's rows."""
        at = self.uids.find(*batch.uid_pairs())
        if (at < 0).any():
            raise SelectError(
                f"rule {self.rule!r}: {int((at < 0).sum())} scored rows have no embed/ row (e.g. uid "
                f"{batch.texts('uid')[int(np.argmax(at < 0))]}); rescore the run with hype score"
            )
        return values[self.first[at]]


def grid_bits(dim: int) -> int:
    """b of the 2^-b grid on which a dot product of `dim` components in [-1, 1] sums exactly in float64."""
    return int((53 - np.ceil(np.log2(dim))) // 2)


def on_grid(x: np.ndarray) -> np.ndarray:
    """Unit-vector rows as float64 integers on the 2^-b grid (`grid_bits`); their dot products times
    `grid_unit` are exact whatever BLAS does."""
    return np.rint(np.clip(x, -1, 1).astype(np.float64) * 2.0 ** grid_bits(x.shape[1]))


def grid_unit(dim: int) -> float:
    return 2.0 ** (-2 * grid_bits(dim))
