"""What the report shows, gathered from the scores table in two streaming passes (bounded memory).

Pass 1: per metric, pool and subset statistics (moments, a key histogram for quantiles) and the pool's
correlation matrix (centred cross-products). Pass 2: fixed-bin histograms over a robust range (pool
quantiles 0.1%..99.9%, values outside counted in the edge bins), and for each 20% percentile bucket of
ε_i and ε_t a deterministic sample of rows (the smallest hashes of the uid), whose images are then read
from the pool tars.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hype.data.errors import SelectError
from hype.data.uids import UidError, UidMultiset, load_subset, splitmix64
from hype.table.reader import ScoresTable
from hype.table.stats import RunningStats

BUCKETS = 5  # HYPE Fig. 3: percentile groups of 20%
BUCKET_METRICS = ("eps_i", "eps_t")


@dataclass
class Sample:
    uid: str
    shard: str
    key: str
    text: str
    values: dict[str, float]
    in_subset: bool
    image: str | None = None  # data: URL of the thumbnail, filled in later


@dataclass
class ReportData:
    run_dir: str
    metrics: list[str]
    pool_rows: int
    subset_path: str | None = None
    subset_rows: int = 0
    subset_unique: int = 0
    subset_in_pool: int = 0  # scored rows whose uid is in the subset
    pool_stats: dict[str, dict] = field(default_factory=dict)
    subset_stats: dict[str, dict] = field(default_factory=dict)
    edges: dict[str, np.ndarray] = field(default_factory=dict)
    pool_hist: dict[str, np.ndarray] = field(default_factory=dict)
    subset_hist: dict[str, np.ndarray] = field(default_factory=dict)
    correlation: np.ndarray | None = None
    bucket_edges: dict[str, list[float]] = field(default_factory=dict)
    buckets: dict[str, list[list[Sample]]] = field(default_factory=dict)
    # per metric, the cut-off of the report's selection (`hype.select.explain.term_cutoffs`), if any
    cutoffs: dict[str, float | None] = field(default_factory=dict)


def collect(
    run_dir: str | Path,
    subset: str | Path | None,
    *,
    bins: int = 40,
    per_bucket: int = 6,
    workers: int = 2,
    progress: bool = True,
) -> ReportData:
    table = ScoresTable(run_dir)
    table.require(["uid"])
    metrics = table.present_metrics()
    if not metrics:
        raise SelectError(f"{table.folder}: the scores table holds none of the metric columns; rescore")
    members = None
    data = ReportData(run_dir=str(run_dir), metrics=metrics, pool_rows=table.num_rows)
    if subset is not None:
        try:
            arr = load_subset(subset)
        except UidError as e:
            raise SelectError(f"--subset: {e}") from None
        members = UidMultiset(arr)
        data.subset_path, data.subset_rows, data.subset_unique = str(subset), len(arr), len(members)

    pool = {m: RunningStats() for m in metrics}
    sub = {m: RunningStats() for m in metrics}
    centre: np.ndarray | None = None
    cross = np.zeros((len(metrics), len(metrics)))
    sums = np.zeros(len(metrics))
    in_pool = 0
    cols = ["uid", *metrics]
    for batch in table.iter_batches(
        cols, workers=workers, progress="report: statistics" if progress else None
    ):
        x = np.stack([batch.numeric(m) for m in metrics], axis=1)
        if centre is None:
            centre = x.mean(axis=0)
        d = x - centre
        cross += d.T @ d
        sums += d.sum(axis=0)
        mask = _membership(batch, members)
        in_pool += int(mask.sum()) if mask is not None else 0
        for j, m in enumerate(metrics):
            pool[m].add(x[:, j])
            if mask is not None:
                sub[m].add(x[mask, j])
    n = table.num_rows
    cov = cross / n - np.outer(sums / n, sums / n)
    sd = np.sqrt(np.clip(np.diag(cov), 0, None))
    with np.errstate(invalid="ignore", divide="ignore"):
        data.correlation = np.where(np.outer(sd, sd) > 0, cov / np.outer(sd, sd), np.nan)
    data.subset_in_pool = in_pool
    data.pool_stats = {m: pool[m].to_dict() for m in metrics}
    data.subset_stats = {m: sub[m].to_dict() for m in metrics} if members is not None else {}

    for m in metrics:
        lo, hi = pool[m].hist.quantiles((0.001, 0.999))
        lo, hi = max(lo, pool[m].min), min(hi, pool[m].max)
        if not hi > lo:
            lo, hi = pool[m].min, pool[m].max
        if not hi > lo:
            lo, hi = lo - 0.5, hi + 0.5
        data.edges[m] = np.linspace(lo, hi, bins + 1)
        data.pool_hist[m] = np.zeros(bins, dtype=np.int64)
        data.subset_hist[m] = np.zeros(bins, dtype=np.int64)
    bucket_metrics = [m for m in BUCKET_METRICS if m in metrics]
    for m in bucket_metrics:
        qs = pool[m].hist.quantiles(tuple(i / BUCKETS for i in range(1, BUCKETS)))
        data.bucket_edges[m] = [pool[m].min, *qs, pool[m].max]
    heaps: dict[str, list[list]] = {m: [[] for _ in range(BUCKETS)] for m in bucket_metrics}

    cols2 = ["uid", *metrics] + (["shard", "key", "text"] if bucket_metrics else [])
    if bucket_metrics:
        table.require(["shard", "key", "text"], "the thumbnail grids")
    for batch in table.iter_batches(
        cols2, workers=workers, progress="report: histograms" if progress else None
    ):
        mask = _membership(batch, members)
        for m in metrics:
            x = batch.numeric(m)
            idx = np.clip(np.searchsorted(data.edges[m], x, "right") - 1, 0, bins - 1)
            data.pool_hist[m] += np.bincount(idx, minlength=bins)
            if mask is not None:
                data.subset_hist[m] += np.bincount(idx[mask], minlength=bins)
        if bucket_metrics:
            hi, lo = batch.uid_pairs()
            h = splitmix64(hi ^ splitmix64(lo))
            for m in bucket_metrics:
                b = np.clip(
                    np.searchsorted(data.bucket_edges[m][1:-1], batch.numeric(m), "right"), 0, BUCKETS - 1
                )
                for k in range(BUCKETS):
                    rows = np.flatnonzero(b == k)
                    if len(rows) > per_bucket:
                        rows = rows[np.argpartition(h[rows], per_bucket)[:per_bucket]]
                    for r in rows:
                        _push(heaps[m][k], per_bucket, int(h[r]), batch, int(r), metrics, mask)
    # Shown in ascending order of the bucket's metric, like the paper's example grids.
    data.buckets = {
        m: [sorted((item[-1] for item in heap), key=lambda s, m=m: (s.values[m], s.uid)) for heap in heaps[m]]
        for m in bucket_metrics
    }
    return data


def _membership(batch, members: UidMultiset | None) -> np.ndarray | None:
    if members is None:
        return None
    hi, lo = batch.uid_pairs()
    return members.find(hi, lo) >= 0


def _push(heap: list, size: int, h: int, batch, r: int, metrics: list[str], mask) -> None:
    # A max-heap on the hash (negated) keeps the `size` smallest hashes seen so far.
    if len(heap) == size and -heap[0][0] <= h:
        return
    sample = Sample(
        uid=batch.arrow("uid")[r].as_py(),
        shard=batch.arrow("shard")[r].as_py() or "",
        key=batch.arrow("key")[r].as_py() or "",
        text=batch.arrow("text")[r].as_py() or "",
        values={m: float(batch.numeric(m)[r]) for m in metrics},
        in_subset=bool(mask[r]) if mask is not None else False,
    )
    item = (-h, batch.first_row + r, sample)
    if len(heap) < size:
        heapq.heappush(heap, item)
    else:
        heapq.heapreplace(heap, item)
