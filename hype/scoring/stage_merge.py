"""Merge stage (per shard): the shard's part of THE scores table, `RUN_DIR/scores/part-<index:08d>.parquet`.

Joins the row-aligned per-shard outputs (embed: uid, key, text, size, −d_L, cos θ; specificity: ε_i,
ε_t; clusters: c_IN, or 0 when c_IN is off), drops rows whose uid appeared earlier in the pool (dedup),
and writes exactly `hype.table.schema.SCHEMA`, with the input tar path as given in `shard`. Parts are
numbered by shard order, so reading `part-*.parquet` sorted gives the pool order.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hype.io import blake2b128_bytes, read_parquet, storage
from hype.scoring.context import RunContext, StageSpec, SummaryView
from hype.scoring.dedup import keep_mask
from hype.scoring.pricing import ShardReads, lists
from hype.scoring.rundir import RunDir, ShardTask, fingerprint
from hype.scoring.stagebase import ShardStage
from hype.table.schema import SCHEMA


class MergeStage(ShardStage):
    name = "merge"
    verify_outputs = True  # the parts are what select reads: one damaged in place is rewritten by a rerun

    def __init__(self, run: RunDir, *, c_in: bool, drops: dict | None = None, **kw):
        super().__init__(run, **kw)
        self.c_in = c_in
        self.drops = drops or {}  # shard index -> rows to drop (only shards with duplicates)

    def fingerprint(self, task: ShardTask) -> str:
        return fingerprint(
            {
                "stage": self.name,
                "index": task.index,
                "shard": task.path,
                "embed": self.upstream_digest("embed", task),
                "specificity": self.upstream_digest("specificity", task),
                "clusters": self.upstream_digest("clusters", task) if self.c_in else None,
                # This shard's dropped rows, not the pool's duplicate list: they depend only on this shard
                # and the ones before it, so a pool that grows at the end keeps its old parts.
                "drops": blake2b128_bytes(np.asarray(self.drops.get(task.index, ()), np.int64).tobytes()),
                "schema": SCHEMA.to_string(),
            }
        )

    def run(self, task: ShardTask) -> dict:
        started = time.perf_counter()
        fp = self.fingerprint(task)
        self._debug_hook(task)
        r = self.run_dir
        emb = read_parquet(
            r.shard_output("embed", task),
            columns=["uid", "key", "text", "width", "height", "neg_d_l", "cos_theta"],
        )
        spec = read_parquet(r.shard_output("specificity", task))
        n = emb.num_rows
        if self.c_in:
            c_in = read_parquet(r.shard_output("clusters", task), columns=["c_in"]).column("c_in")
        else:
            c_in = pa.array(np.zeros(n, np.float32))
        if spec.num_rows != n or len(c_in) != n:
            raise RuntimeError(f"{task.shard_id}: stage outputs are not row-aligned; rerun to recompute them")
        columns = {
            "uid": emb.column("uid"),
            "eps_i": spec.column("eps_i"),
            "eps_t": spec.column("eps_t"),
            "neg_d_l": emb.column("neg_d_l"),
            "cos_theta": emb.column("cos_theta"),
            "c_in": c_in,
            "shard": pa.array([task.path] * n, pa.string()),
            "key": emb.column("key"),
            "text": emb.column("text"),
            "width": emb.column("width"),
            "height": emb.column("height"),
        }
        table = pa.Table.from_arrays([columns[f.name] for f in SCHEMA], schema=SCHEMA)
        drop = self.drops.get(task.index)
        if drop is not None and len(drop):
            table = table.filter(pa.array(keep_mask(n, np.asarray(drop))))
        return self._finish(
            task,
            fp,
            table,
            started,
            counts={
                "samples": table.num_rows,
                "duplicates_dropped": n - table.num_rows,
                "c_in": int(pc.sum(pc.greater(table.column("c_in"), 0)).as_py() or 0),
            },
        )


# --- the stage in a `hype score` run -----------------------------------------------------------------

READS = ShardReads(markers=3, parquets=3)  # embed, specificity, clusters: their markers and outputs


def merge(ctx: RunContext, settings: None, inputs: dict) -> list[dict]:
    """THE scores table, one part per shard (parts of shards no longer in the pool are removed)."""
    run, pool = ctx.run, inputs["dedup"]
    expected = {run.shard_output("merge", t).name for t in pool.tasks}
    for name in storage.list_sizes(run.scores):
        if name.startswith("part-") and name.endswith(".parquet") and name not in expected:
            storage.remove(run.scores / name)
    c_in = inputs["clusters"] is not None
    stage = MergeStage(run, c_in=c_in, drops=pool.drops, **pool.kw)
    merge_stats = ctx.map(stage, pool.tasks)
    ctx.check_failures("merge", ctx.plan)
    return merge_stats


def plan(est: Any) -> None:
    # stale parts looked for before the map: merge/ and scores/ listed
    est.map("merge", "merge", "samples", reads=READS, more_requests={"list": 2 * lists(0)})


def summary(view: SummaryView) -> dict:
    parts = view.outputs.get("merge")
    return {
        "samples": {"scored": sum(int(s["output"]["rows"]) for s in parts) if parts is not None else None}
    }


STAGE = StageSpec(
    "merge", merge, reads=("embed", "dedup", "specificity", "clusters"), plan=plan, summary=summary
)
