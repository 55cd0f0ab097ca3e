"""What the rules that read a run's CLIP embeddings (`negclip`, `normsim`, `dbp`) share: `PoolRule`, a
ranking rule that reads the pool's `RUN_DIR/embed/` tables in uid order (`PoolEmbeddings`, memory checked
before reading), computes a value per uid once, and scores each row by its uid; and dot products on an
exact grid.

The pool is the scores table's: the embed outputs of the shards `plan.json` lists (a run directory keeps those
of shards it no longer has: a pool moved or copied and scored again, a rerun of fewer shards), and one row
per uid, the first in shard order (a uid repeated across or within shards is scored once, as the dedup
stage keeps it). A table `hype score` did not write (no plan.json or summary.json) is read whole.

Byte-identical on any CPU and thread count: the dot products are of the embeddings rounded to a 2^-b grid
with d·4^b <= 2^53, so each product and every partial sum is an integer in float64 and BLAS's order and
blocking cannot change it (the rounding moves a dot product of unit vectors by at most √d·2^-(b+1), ~7e-6
at d = 768).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pyarrow.parquet as pq

from hype.data.uids import UidMultiset, arrow_to_pairs, sort_order, to_structured
from hype.geometry.exact import fp32_dot_error
from hype.io import StorageError, open_input, read_json, read_parquet, read_parquet_schema, storage
from hype.scoring.embed_format import fixed_list_to_numpy
from hype.scoring.rundir import RunDir, plan_tasks
from hype.select.errors import SelectError
from hype.select.rules import Rule
from hype.table.reader import Batch


class PoolEmbeddings:
    """Columns of every run's embed tables, rows in uid order (file order and row groups do not matter)."""

    def __init__(self, rule: str, table, columns: list[str], max_gb: float, fix: dict[str, str]):
        files = [f for folder in table.folders for f in embed_files(rule, folder.parent)]
        if not files:
            raise SelectError(
                f"rule {rule!r}: no embed/*.parquet beside {table.folders[0]}; score with hype score"
            )
        rows = dim = 0
        for f in files:  # before reading: the columns exist and fit
            try:
                names = read_parquet_schema(f).names
            except (OSError, StorageError) as e:
                raise SelectError(
                    f"rule {rule!r}: cannot read {f}, the embed output of a shard its run lists ({e}); "
                    "rescore the run with hype score"
                ) from None
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
        his, los, full, at = [], [], {}, 0  # each column read into one array: no list of parts to join
        for f in files:
            t = read_parquet(f, columns=["uid", *columns])
            hi, lo = arrow_to_pairs(t.column("uid"), f"{f}: column 'uid'")
            his.append(hi)
            los.append(lo)
            for c in columns:
                part = fixed_list_to_numpy(t.column(c))
                full.setdefault(c, np.empty((rows, part.shape[1]), part.dtype))[at : at + len(part)] = part
            at += len(hi)
        hi, lo = np.concatenate(his), np.concatenate(los)
        order = sort_order(hi, lo)  # stable: a repeated uid's rows in shard order
        repeats = UidMultiset(to_structured(hi[order], lo[order]))
        keep = order[np.r_[0, np.cumsum(repeats.counts)[:-1]]]  # each uid's first row
        self.rule = rule
        self.arrays = {c: full.pop(c)[keep] for c in columns}  # one column's copy at a time
        self.uids = UidMultiset.from_unique(repeats.hi, repeats.lo, np.ones(len(keep), np.int64))

    def per_row(self, values: np.ndarray, batch: Batch) -> np.ndarray:
        """`values` (one per embedded row, uid order) of the batch's rows."""
        at = self.uids.find(*batch.uid_pairs())
        if (at < 0).any():
            raise SelectError(
                f"rule {self.rule!r}: {int((at < 0).sum())} scored rows have no embed/ row (e.g. uid "
                f"{batch.texts('uid')[int(np.argmax(at < 0))]}); rescore the run with hype score"
            )
        return values[at]


class PoolRule(Rule):
    """A ranking rule over the pool's embeddings: `attach` reads the `EMBEDDINGS` columns (a `max_gb`
    parameter bounds them) and `pool_values` computes one value per uid from them; `score` looks each
    row's up. A subclass sets its name, params and maths; `found` goes into its description."""

    kind: ClassVar[str] = "score"
    EMBEDDINGS: ClassVar[tuple[str, ...]] = ("clip_img",)
    FIX: ClassVar[dict[str, str]] = {}  # column -> how to get it, when a run lacks it

    def __init__(self, **params: Any):
        super().__init__(**params)
        self.pool: PoolEmbeddings | None = None
        self.values = np.zeros(0)
        self.found: dict = {}

    def columns(self) -> list[str]:
        return ["uid"]

    def attach(self, table) -> None:
        """Read every run's embeddings and compute the whole pool's values (they depend on all rows)."""
        pool = PoolEmbeddings(self.name, table, list(self.EMBEDDINGS), self.params["max_gb"], self.FIX)
        self.values = self.pool_values(table, pool)
        self.pool = pool

    def pool_values(self, table, pool: PoolEmbeddings) -> np.ndarray:
        """The value of each of `pool`'s uids (uid order)."""
        raise NotImplementedError

    def score(self, batch: Batch) -> np.ndarray:
        if self.pool is None:
            raise SelectError(f"rule {self.name!r} reads the run's embeddings first (Rule.attach)")
        return self.pool.per_row(self.values, batch)

    def describe(self) -> dict:
        return {**super().describe(), **self.found}


def embed_files(rule: str, run: storage.AnyPath) -> list:
    """The embed outputs of the shards `run`'s plan.json lists, in shard order (the module docstring)."""
    plan = read_json(run / "plan.json")
    try:
        tasks = None if plan is None else plan_tasks(plan)
    except (KeyError, TypeError, ValueError):
        tasks = None  # not the shape hype score writes: as unreadable
    if tasks is not None:
        return [RunDir(run).shard_output("embed", t) for t in tasks]
    if storage.exists(run / "summary.json"):  # hype score's: a run it completed has a plan.json
        raise SelectError(
            f"rule {rule!r}: {run / 'plan.json'} is missing or unreadable, so which embed/ tables are the "
            "run's shards is unknown; rerun hype score on the run to rewrite it"
        )
    return sorted(storage.glob(f"{run}/embed/*.parquet"))


def grid_bits(dim: int) -> int:
    """b of the 2^-b grid on which a dot product of `dim` components in [-1, 1] sums exactly in float64."""
    return int((53 - np.ceil(np.log2(dim))) // 2)


def on_grid(x: np.ndarray) -> np.ndarray:
    """Unit-vector rows as float64 integers on the 2^-b grid (`grid_bits`); their dot products times
    `grid_unit` are exact whatever BLAS does."""
    return np.rint(np.clip(x, -1, 1).astype(np.float64) * 2.0 ** grid_bits(x.shape[1]))


def grid_unit(dim: int) -> float:
    return 2.0 ** (-2 * grid_bits(dim))


def grid_values32(x: np.ndarray, rows: int = 65536) -> np.ndarray:
    """The grid values of `on_grid` themselves (k·2^-b, not k), float32, made `rows` rows at a time (no
    float64 copy of a whole pool): exact, as |k| <= 2^b < 2^24 fits float32's significand. In float64
    their dot products are the exact grid dot products; in float32, within `float32_dot_error` of them."""
    out = np.empty(x.shape, np.float32)
    scale = 2.0 ** -grid_bits(x.shape[1])
    for s in range(0, len(x), rows):
        out[s : s + rows] = on_grid(x[s : s + rows]) * scale
    return out


def float32_dot_error(dim: int, norm_a: float, norm_b: float) -> float:
    """A bound on |float32 dot product - exact| of two `dim`-vectors of float32 values (those of
    `grid_values32`) of norms at most `norm_a`, `norm_b`, whatever the summation order or FMA:
    γ_d·‖a‖‖b‖, γ_d = d·u/(1 - d·u), u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms,
    §3.1), widened by 1e-6 for the rounding of the norms themselves."""
    du = fp32_dot_error(dim)  # d·u, u = 2^-24: hype's one first-order bound, made rigorous here (γ_d)
    return float(du / (1 - du) * norm_a * norm_b * (1 + 1e-6))


def max_norm(a: np.ndarray, rows: int = 65536) -> float:
    """The largest row norm of `a`, in float64, `rows` rows at a time."""
    top = 0.0
    for s in range(0, len(a), rows):
        c = np.asarray(a[s : s + rows], np.float64)
        top = max(top, float(np.sqrt(np.einsum("ij,ij->i", c, c).max(initial=0.0))))
    return top
