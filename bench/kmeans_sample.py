"""The k-means training sample of c_IN (and near-duplicates): two passes (uids, then the chosen rows'
features into one array of its final size) against the earlier streaming top-k that carried the features
along, concatenating and re-indexing them at every shard. Same process, same embed outputs, same sample.

    python bench/kmeans_sample.py [--shards 60 --rows 10000 --dim 256 --max-points 0]

`--max-points 0` keeps every row (DataComp small at K = 100,000: 256·K > the pool, so every caption-passing
row is in the sample). Prints seconds and peak traced memory of each, and their ratios.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hype.data.uids import uids_to_pairs
from hype.io import read_parquet
from hype.scoring import embed_format
from hype.scoring.rundir import RunDir, make_tasks
from hype.scoring.stage_clusters import sample_pool_features
from hype.scoring.topk import RunningTopK, order_id


def streaming_top_k(run: RunDir, tasks, max_points: int) -> np.ndarray:
    """The earlier sampler: a RunningTopK whose payload is the features (all rows eligible here)."""
    sample = RunningTopK(max_points, largest=False)
    for task in tasks:
        t = read_parquet(run.shard_output("embed", task), columns=["uid", "clip_img"])
        hi, _ = uids_to_pairs(t.column("uid").to_pylist())
        feats = embed_format.fixed_list_to_numpy(t.column("clip_img"))
        sample.add(hi, order_id(task.index, np.arange(t.num_rows)), feats)
    return sample.payload


def measure(fn) -> tuple[np.ndarray, float, float]:
    tracemalloc.start()
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return out, seconds, peak / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=60)
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--max-points", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="hype-kmeans-sample-") as tmp:
        run = RunDir(Path(tmp))
        tasks = make_tasks([f"{tmp}/pool/{i:08d}.tar" for i in range(args.shards)])
        (Path(tmp) / "embed").mkdir()
        for task in tasks:
            uids = [f"{u:032x}" for u in rng.integers(0, 2**62, size=args.rows)]
            feats = rng.standard_normal((args.rows, args.dim), dtype=np.float32)
            table = pa.table({"uid": uids, "clip_img": embed_format.fixed_list(feats)})
            pq.write_table(table, run.shard_output("embed", task))
        k = args.max_points or args.shards * args.rows
        new, new_s, new_mb = measure(lambda: sample_pool_features(run, tasks, {}, k, False)[0])
        old, old_s, old_mb = measure(lambda: streaming_top_k(run, tasks, k))
        assert np.array_equal(new, old), "the two samplers disagree"
        sample_mb = new.nbytes / 2**20
        print(
            json.dumps(
                {
                    "rows": args.shards * args.rows,
                    "sample_rows": len(new),
                    "dim": args.dim,
                    "sample_mb": round(sample_mb, 1),
                    "two_pass_s": round(new_s, 2),
                    "streaming_top_k_s": round(old_s, 2),
                    "time_ratio": round(new_s / old_s, 3),
                    "two_pass_peak_mb": round(new_mb, 1),
                    "streaming_top_k_peak_mb": round(old_mb, 1),
                    "peak_over_sample": {
                        "two_pass": round(new_mb / sample_mb, 2),
                        "old": round(old_mb / sample_mb, 2),
                    },
                }
            )
        )


if __name__ == "__main__":
    main()
