"""The dedup stage of `hype score` (a driver step, `hype.scoring.dedup`): the duplicate uids of the embedded
pool, the first copy kept; its output is the pool as the later stages see it (`Embedded` with `drops`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hype.scoring.context import RunContext, StageSpec, SummaryView
from hype.scoring.dedup import find_duplicates, load_duplicates
from hype.scoring.pricing import MISSING, add, parquet_get
from hype.scoring.rundir import fingerprint
from hype.scoring.stage_embed import Embedded


def dedup(ctx: RunContext, settings: None, inputs: dict) -> Embedded:
    """The duplicate uids of the embedded pool (the first copy is kept): the pool as later stages see it."""
    pool, run = inputs["embed"], ctx.run
    dups = ctx.timed(
        "dedup", lambda: find_duplicates(run, pool.tasks, fingerprint({"pool": pool.fingerprint}), pool.rows)
    )
    return dataclasses.replace(pool, drops=load_duplicates(run), dups=dups)


def plan(est: Any) -> None:
    # its marker looked for; the uids of each shard; the list written, then read back
    req = add(MISSING, {"get": est.S * parquet_get(est.embed_bytes) + parquet_get(0), "put": 2})
    nbytes = est.probe.folder_bytes.get("dedup", 0)
    est.driver("dedup", est.seconds("dedup"), est.lin, "samples", nbytes, req, run_stage="dedup")


def summary(view: SummaryView) -> dict:
    pool = view.outputs.get("dedup")
    return {"samples": {"duplicates": int(pool.dups["duplicates"]) if pool and pool.dups else None}}


STAGE = StageSpec("dedup", dedup, reads=("embed",), per_shard=False, driver=True, plan=plan, summary=summary)
