"""Duplicate uids across (and within) shards: keep the first by shard order, list the rest.

Runs in the driver over the uid columns of the embed outputs. uids are 128-bit hashes, so the pool is
split into `passes` disjoint groups by `hi % passes` and each group is deduplicated on its own: memory
is bounded by `rows_per_pass` (24 bytes per row), whatever the pool size.

Output: `RUN_DIR/dedup/duplicates.parquet` (shard_index, row, uid, first_shard_index, first_row), marker
`duplicates.json` last. Later stages drop those rows: they are counted in the summary, not scored.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pyarrow as pa

from hype.data.uids import pair_to_uid, uids_to_pairs
from hype.io import read_parquet
from hype.scoring.rundir import RunDir, ShardTask, atomic_write_json, completed, write_parquet
from hype.scoring.topk import order_id, split_order_id

ROWS_PER_PASS = 50_000_000


def find_duplicates(
    run: RunDir, tasks: list[ShardTask], fp: str, total_rows: int, rows_per_pass: int = ROWS_PER_PASS
) -> dict:
    """Write (or reuse) the duplicate list of the embedded pool; return its marker."""
    marker = run.marker_of(run.duplicates)
    done = completed(marker, fp, run.duplicates)
    if done is not None:
        return done
    started = time.perf_counter()
    passes = max(1, math.ceil(total_rows / rows_per_pass))
    dup_ids, first_ids, dup_uids = [], [], []
    for p in range(passes):
        his, los, ids = [], [], []
        for task in tasks:
            uids = read_parquet(run.shard_output("embed", task), columns=["uid"]).column("uid").to_pylist()
            hi, lo = uids_to_pairs(uids)
            rows = np.arange(len(uids), dtype=np.int64)
            if passes > 1:
                sel = (hi % np.uint64(passes)) == np.uint64(p)
                hi, lo, rows = hi[sel], lo[sel], rows[sel]
            his.append(hi)
            los.append(lo)
            ids.append(order_id(task.index, rows))
        if not ids:
            continue
        hi, lo, gid = np.concatenate(his), np.concatenate(los), np.concatenate(ids)
        order = np.lexsort((gid, lo, hi))  # by uid, then pool order
        hi, lo, gid = hi[order], lo[order], gid[order]
        same = np.zeros(len(gid), dtype=bool)
        same[1:] = (hi[1:] == hi[:-1]) & (lo[1:] == lo[:-1])
        if not same.any():
            continue
        # First occurrence of each duplicate's uid: the last position without `same` before it.
        run_start = np.maximum.accumulate(np.where(~same, np.arange(len(gid)), 0))
        dup_ids.append(gid[same])
        first_ids.append(gid[run_start[same]])
        dup_uids += [pair_to_uid(a, b) for a, b in zip(hi[same], lo[same], strict=True)]
    dup = np.concatenate(dup_ids) if dup_ids else np.zeros(0, np.int64)
    first = np.concatenate(first_ids) if first_ids else np.zeros(0, np.int64)
    order = np.argsort(dup, kind="stable")
    shard, row = split_order_id(dup[order])
    fshard, frow = split_order_id(first[order])
    table = pa.table(
        {
            "shard_index": pa.array(shard, pa.int32()),
            "row": pa.array(row, pa.int32()),
            "uid": pa.array([dup_uids[i] for i in order], pa.string()),
            "first_shard_index": pa.array(fshard, pa.int32()),
            "first_row": pa.array(frow, pa.int32()),
        }
    )
    output = write_parquet(run.duplicates, table)
    info = {
        "fingerprint": fp,
        "output": output,
        "digest": output["digest"],
        "duplicates": int(len(dup)),
        "passes": passes,
        "seconds": round(time.perf_counter() - started, 4),
    }
    atomic_write_json(marker, info)
    return info


def load_duplicates(run: RunDir) -> dict[int, np.ndarray]:
    """shard index -> sorted rows to drop."""
    t = read_parquet(run.duplicates, columns=["shard_index", "row"])
    shard = t.column("shard_index").to_numpy()
    row = t.column("row").to_numpy()
    return {int(s): np.sort(row[shard == s]) for s in np.unique(shard)}


def keep_mask(n_rows: int, drop: np.ndarray | None) -> np.ndarray:
    mask = np.ones(n_rows, dtype=bool)
    if drop is not None and len(drop):
        mask[drop] = False
    return mask
