"""Reference stage: the paper's two-step selection of S_i and S_t, streamed over the embed outputs.

HYPE §3.3, exactly as `hype.scoring.reference.select_references` does it in memory (tested equal):
1. `select_top_pairs` (driver): the N pairs with the highest cos θ across all shards, by a running
   top-N over the cos θ column (ties: pool order), then their MERU image and text embeddings, in rank
   order -> `RUN_DIR/reference/top_n.safetensors`.
2. `CandidateStage` (per shard, any executor): the mean L_e of every image against the N texts and of
   every text against the N images -> `RUN_DIR/reference/<shard id>.parquet` (img_score, txt_score).
3. `select_top_m` (driver): a running top-M over those scores for images and for texts, then their
   embeddings -> S_i, S_t as tangent vectors in `RUN_DIR/reference.safetensors` (ReferenceSet.save).

Memory stays bounded by N, M and one shard. Duplicate uids (all but the first) take no part. N and M
are reduced with a warning when the pool is smaller. None of this runs when a run grows: its S_i/S_t stay
as they were chosen (`hype.scoring.grow`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save

from hype.geometry import lorentz
from hype.io import blake2b128_file, read_bytes, read_parquet
from hype.scoring import embed_format
from hype.scoring.config import ReferenceConfig
from hype.scoring.context import RunContext, StageSpec, SummaryView
from hype.scoring.dedup import keep_mask
from hype.scoring.errors import ScoreError
from hype.scoring.pricing import MISSING, ShardReads, add, parquet_get, written_digest
from hype.scoring.reference import ReferenceError, ReferenceSet, load_reference
from hype.scoring.rundir import (
    RunDir,
    ShardTask,
    atomic_write_bytes,
    atomic_write_json,
    completed,
    fingerprint,
    read_json,
)
from hype.scoring.stage_specificity import MeanEnergyStage
from hype.scoring.topk import RunningTopK, order_id, split_order_id

log = logging.getLogger(__name__)


def _gather(
    run: RunDir, tasks: list[ShardTask], ids: np.ndarray, columns: list[str]
) -> dict[str, np.ndarray]:
    """Embeddings of the rows `ids` (global order ids), in the order of `ids`."""
    by_index = {t.index: t for t in tasks}
    shard, row = split_order_id(ids)
    out: dict[str, np.ndarray] = {}
    for s in np.unique(shard):
        sel = np.nonzero(shard == s)[0]
        table = read_parquet(run.shard_output("embed", by_index[int(s)]), columns=columns)
        for c in columns:
            block = embed_format.fixed_list_to_numpy(table.column(c))[row[sel]]
            if c not in out:
                out[c] = np.empty((len(ids), block.shape[1]), dtype=np.float32)
            out[c][sel] = block
    return out


def select_top_pairs(
    run: RunDir,
    tasks: list[ShardTask],
    drops: dict[int, np.ndarray],
    n_top: int,
    fp: str,
    warn: Callable[[str], None],
) -> dict:
    """Step 1: the top-N pairs by cos θ and their MERU embeddings (reused when current)."""
    marker = run.marker_of(run.top_n)
    done = completed(marker, fp, run.top_n)
    if done is not None:
        return done
    started = time.perf_counter()
    top = RunningTopK(n_top)
    pool = 0
    for task in tasks:
        cos = read_parquet(run.shard_output("embed", task), columns=["cos_theta"]).column(0).to_numpy()
        keep = keep_mask(len(cos), drops.get(task.index))
        pool += int(keep.sum())
        rows = np.nonzero(keep)[0]
        top.add(cos[rows].astype(np.float32), order_id(task.index, rows))
    if pool == 0:
        raise ValueError("no sample was embedded: nothing to select references from (see the embed stats)")
    if n_top > pool:
        warn(f"pool of {pool} samples: reference N reduced from {n_top} to {pool}")
    emb = _gather(run, tasks, top.ids, ["meru_img", "meru_txt"])
    tensors = {
        "img": torch.from_numpy(emb["meru_img"]),
        "txt": torch.from_numpy(emb["meru_txt"]),
        "ids": torch.from_numpy(top.ids),
    }
    atomic_write_bytes(run.top_n, save(tensors))
    info = {
        "fingerprint": fp,
        "output": {"file": run.top_n.name, "bytes": run.top_n.stat().st_size},
        "digest": blake2b128_file(run.top_n),
        "n_top": len(top),
        "pool": pool,
        "seconds": round(time.perf_counter() - started, 4),
    }
    atomic_write_json(marker, info)
    return info


class CandidateStage(MeanEnergyStage):
    """Step 2, per shard: mean L_e of each image (text) against the N top texts (images)."""

    name = "reference"
    columns = ("img_score", "txt_score")
    sets_key = "top_n"

    def __init__(self, run: RunDir, *, top_n_digest: str, **kw):
        super().__init__(run, sets_digest=top_n_digest, **kw)

    def load_sets(self) -> tuple[torch.Tensor, torch.Tensor]:
        data = safetensors_load(read_bytes(self.run_dir.top_n))  # a local file or an object in a bucket
        return data["img"], data["txt"]


def select_top_m(
    run: RunDir,
    tasks: list[ShardTask],
    drops: dict[int, np.ndarray],
    m: int,
    meta: dict,
    fp: str,
    warn: Callable[[str], None],
) -> dict:
    """Step 3: S_i and S_t, the M images and texts with the highest mean L_e; saved as tangent vectors."""
    marker = run.reference_marker
    done = completed(marker, fp, run.reference)
    if done is not None:
        return done
    started = time.perf_counter()
    top_img, top_txt = RunningTopK(m), RunningTopK(m)
    pool = 0
    for task in tasks:
        t = read_parquet(run.shard_output("reference", task))
        rows = np.nonzero(keep_mask(t.num_rows, drops.get(task.index)))[0]
        pool += len(rows)
        ids = order_id(task.index, rows)
        top_img.add(t.column("img_score").to_numpy()[rows], ids)
        top_txt.add(t.column("txt_score").to_numpy()[rows], ids)
    if m > pool:
        warn(f"pool of {pool} samples: reference M reduced from {m} to {pool}")
    curv = meta["curv"]
    img = _gather(run, tasks, top_img.ids, ["meru_img"])["meru_img"]
    txt = _gather(run, tasks, top_txt.ids, ["meru_txt"])["meru_txt"]
    refs = ReferenceSet(
        lorentz.log_map0(torch.from_numpy(img), curv).float(),
        lorentz.log_map0(torch.from_numpy(txt), curv).float(),
        meta | {"m": len(top_img), "pool": pool, "source": "selected", "streaming": True},
    )
    refs.save(run.reference)
    info = {
        "fingerprint": fp,
        "output": {"file": run.reference.name, "bytes": run.reference.stat().st_size},
        "digest": blake2b128_file(run.reference),
        "source": "selected",
        "meta": refs.meta,
        "seconds": round(time.perf_counter() - started, 4),
    }
    atomic_write_json(marker, info)
    return info


def copy_reference_file(run: RunDir, path: str, dim: int, fp: str) -> dict:
    """A user-supplied reference file (`--reference`): validated, then copied into the run directory."""
    marker = run.reference_marker
    done = completed(marker, fp, run.reference)
    if done is not None:
        return done
    started = time.perf_counter()
    refs = load_reference(path, dim=dim)
    if str(path).endswith(".safetensors"):
        atomic_write_bytes(run.reference, read_bytes(path))
    else:
        refs.save(run.reference)
    info = {
        "fingerprint": fp,
        "output": {"file": run.reference.name, "bytes": run.reference.stat().st_size},
        "digest": blake2b128_file(run.reference),
        "source": str(path),
        "meta": {"m_img": refs.img.shape[0], "m_txt": refs.txt.shape[0]},
        "seconds": round(time.perf_counter() - started, 4),
    }
    atomic_write_json(marker, info)
    return info


def reference_info(run: RunDir) -> dict | None:
    return read_json(run.reference_marker)


# --- the stage in a `hype score` run -----------------------------------------------------------------

# the candidates' shards: the top N's marker read, the embed output twice; the top N loaded per worker
READS = ShardReads(markers=1, parquets=2, sets=1, folder_written=True)


def check(ctx: RunContext) -> None:
    """A run that grows keeps its reference sets: --reference, if given, must be them."""
    if ctx.frozen is not None:
        from hype.scoring.grow import check_reference

        check_reference(ctx.frozen, ctx.run, ctx.cfg.reference.file, None)


def reference(ctx: RunContext, rc: ReferenceConfig, inputs: dict) -> dict:
    """S_i and S_t: the frozen ones of a run that grows, --reference's, or selected from the pool."""
    run, pool = ctx.run, inputs["dedup"]
    if ctx.frozen is not None:  # checked against --reference by `check`
        return ctx.frozen.reference
    if rc.file is None:
        return _select_reference(ctx, pool)
    try:
        return ctx.timed(
            "reference",
            lambda: copy_reference_file(
                run, rc.file, pool.dims["meru"], fingerprint({"file": blake2b128_file(rc.file)})
            ),
        )
    except (ReferenceError, OSError) as e:
        raise ScoreError(f"--reference: {e}") from None


def _select_reference(ctx: RunContext, pool: Any) -> dict:
    """HYPE §3.3 on the pool: the top-N pairs by cos θ, then the M most generic among them."""
    cfg, run, tasks = ctx.cfg, ctx.run, pool.tasks
    rc = cfg.reference
    top_fp = fingerprint({"pool": pool.fingerprint, "dups": pool.dups["digest"], "n_top": rc.n_top})
    top = ctx.timed("reference", lambda: select_top_pairs(run, tasks, pool.drops, rc.n_top, top_fp, ctx.warn))
    if top["n_top"] < rc.n_top:
        ctx.warn(f"pool of {top['pool']} samples: reference N reduced from {rc.n_top} to {top['n_top']}")
    cand = CandidateStage(
        run,
        curv=pool.curv,
        K=pool.K,
        hinge=rc.hinge,
        top_n_digest=top["digest"],
        budget_elems=cfg.specificity.budget_elems,
        **pool.kw,
    )
    cand_stats = ctx.map(cand, tasks)
    ctx.check_failures("reference", {"pool": cfg.pool, "shards": len(tasks)})
    m = min(rc.m, top["pool"])
    if m < rc.m:
        ctx.warn(f"pool of {top['pool']} samples: reference M reduced from {rc.m} to {m}")
    meta = {"n_top": top["n_top"], "K": pool.K, "hinge": rc.hinge, "curv": pool.curv}
    fp = fingerprint(
        {
            "top_n": top["digest"],
            "candidates": [s["output"]["digest"] for s in cand_stats],
            "m": m,
            "dups": pool.dups["digest"],
            "meta": meta,
        }
    )
    return ctx.timed("reference", lambda: select_top_m(run, tasks, pool.drops, m, meta, fp, ctx.warn))


ENERGY_CALIBRATION_REFS = 20_000  # the largest reference set the L_e kernel is timed on
ENERGY_ROWS = 256  # pool rows per timed L_e call


def run_sizes(cfg: Any, samples: int) -> tuple[int, int]:
    """(N top pairs, M reference size) of a run over `samples`, as `select_top_pairs` and `_select_reference`
    cut them to the pool (for `hype plan`)."""
    top = min(cfg.reference.n_top, samples)
    return top, min(cfg.reference.m, top)


def _time_energy(
    cfg: Any, samples: int, markers: dict, stats: dict, run: Any, device: str
) -> dict[int, float]:
    """Seconds per pool row of the L_e kernel (both directions, as reference candidates and specificity
    run it) at the probe's and the run's N and M (at most ENERGY_CALIBRATION_REFS), on the probe's own
    MERU embeddings on `device`; the sizes interleaved and each the median of three calls, so a change of
    load hits every size alike. Empty when the run's sizes are the probe's."""
    from hype.scoring.specificity import image_specificity, text_specificity

    top_p = int(markers["top_n"].get("n_top") or 0)
    m_p = int((markers["reference"].get("meta") or {}).get("m") or 0)
    top_r, m_r = run_sizes(cfg, samples)
    sizes = sorted({min(x, ENERGY_CALIBRATION_REFS) for x in (top_p, m_p, top_r, m_r) if x})
    done = [s for s in stats.get("embed", []) if s and (s.get("output") or {}).get("file")]
    if len(sizes) < 2 or not done:
        return {}
    x = embed_format.read_embeddings(run / "embed" / done[0]["output"]["file"], "meru_img")
    curv = float(done[0].get("curv") or 1.0)
    dev = device if not device.startswith("cuda") or torch.cuda.is_available() else "cpu"
    pts = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(dev)
    rows = pts[np.arange(ENERGY_ROWS) % len(pts)]
    refs = {m: pts[np.arange(m) % len(pts)] for m in sizes}
    times: dict[int, list[float]] = {m: [] for m in sizes}
    for _ in range(3):
        for m in sizes:
            t0 = time.perf_counter()
            image_specificity(rows, refs[m], curv)
            text_specificity(rows, refs[m], curv)
            if dev.startswith("cuda"):
                torch.cuda.synchronize()
            times[m].append(time.perf_counter() - t0)
    return {m: float(np.median(t)) / ENERGY_ROWS for m, t in times.items()}


def calibrate(cal: Any) -> None:
    p = cal.probe
    p.energy = _time_energy(cal.cfg, cal.samples, p.markers, p.stats, cal.run, cal.device)


def plan(est: Any) -> None:
    """The run's N and M (the plan's scaling); a --reference copied (fixed), or the selection: the
    candidates per shard (x N), the driver's two top-k passes; the L_e kernel timed at the probe's and the
    run's N and M adds only the difference."""
    probe, ref_bytes = est.probe, est.probe.folder_bytes.get("reference.safetensors", 0)
    est.top_p = int(probe.markers["top_n"].get("n_top") or 0)
    est.m_p = int(((probe.markers["reference"].get("meta") or {}).get("m")) or 0)
    est.top_r, est.m_r = run_sizes(est.cfg, est.N)
    if not (est.cfg.reference.file is None and est.top_p > 0):
        est.fixed("reference copy", est.seconds("reference"), ref_bytes, run_stage="reference")
        return
    drv = float(probe.markers["top_n"].get("seconds", 0)) + float(
        probe.markers["reference"].get("seconds", 0)
    )
    more = est.energy_per_row(est.top_r) - est.energy_per_row(est.top_p)
    est.map("reference", "reference cands", "samples x N", reads=READS, driver_s=drv, extra_per_sample=more)
    top_n = float((probe.markers["top_n"].get("output") or {}).get("bytes", 0))
    sets = (top_n * est.top_r / max(1, est.top_p), ref_bytes * est.m_r / max(1, est.m_p))
    # top N: its marker looked for, cos θ of each shard, the top-N gather, written and digested; the
    # reference: its marker, the candidates of each shard, two M-row gathers, written and digested
    shard = 4 * parquet_get(est.embed_bytes) + parquet_get(est.shard_bytes("reference"))
    req = add(MISSING, MISSING, {"get": est.S * shard + sum(map(written_digest, sets)), "put": 4})
    # the step writes both sets: the reference and the top N (reference/top_n.safetensors)
    est.driver("reference select", drv, est.lin, "samples", sum(sets), req, run_stage="reference")
    est.m_more = est.energy_per_row(est.m_r) - est.energy_per_row(est.m_p)


def _summary(view: SummaryView) -> dict:
    from hype.scoring.summary import reference_fields

    return {"reference": reference_fields(view.outputs.get("reference"), view.run, view.plan)}


# top-N (driver), the candidates' mean L_e (per shard), top-M (driver); or --reference copied
STAGE = StageSpec(
    "reference",
    reference,
    lambda c: c.reference,
    reads=("embed", "dedup"),
    driver=True,
    check=check,
    plan=plan,
    summary=_summary,
    markers=(("top_n", "reference/top_n.json"), ("reference", "reference.json")),
    calibrate=calibrate,
)
