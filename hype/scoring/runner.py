"""`hype score` orchestration: the stages in order over an executor, resumable at shard granularity.

    embed        per shard   decode + MERU + CLIP                  -> embed/<id>.parquet
    dedup        driver      duplicate uids (keep the first)       -> dedup/duplicates.parquet
    reference    driver + per shard + driver (HYPE §3.3)        -> reference.safetensors
    specificity  per shard   ε_i, ε_t                              -> specificity/<id>.parquet
    clusters     [per class shard] + driver k-means + per shard  -> clusters/<id>.parquet (c_IN)
    merge        per shard   THE scores table                      -> scores/part-<index>.parquet

Per-shard work goes through an executor (`pipelines.local.LocalExecutor` in-process, or
`pipelines.ray_executor.RayExecutor`); the driver-side steps stream the per-shard outputs with bounded
memory. Every output is skipped when its marker records the current fingerprint (see `rundir`), so a
rerun after a crash continues where it stopped and a rerun of a finished run does nothing.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hype.scoring import summary as summary_mod
from hype.scoring.config import ScoreConfig
from hype.scoring.dedup import find_duplicates, load_duplicates
from hype.scoring.embed import ClassEmbedStage, EmbedStage, ModelRef
from hype.scoring.rundir import (
    RunDir,
    ShardTask,
    atomic_write_bytes,
    atomic_write_json,
    file_digest,
    fingerprint,
    make_tasks,
)
from hype.scoring.stagebase import StageSetupError

log = logging.getLogger("hype.score")


class ScoreError(RuntimeError):
    """A run that cannot start or finish; the message says what to do."""


class ScoreFailed(RuntimeError):
    """Some shards failed after their retries; `summary` lists them. Rerunning retries them."""

    def __init__(self, message: str, summary: dict):
        super().__init__(message)
        self.summary = summary


def make_executor(cfg: ScoreConfig):
    e = cfg.executor
    if e.kind == "ray":
        from pipelines.ray_executor import RayExecutor

        return RayExecutor(
            e.ray_address,
            workers=e.workers,
            cpus_per_worker=e.cpus_per_worker,
            gpus_per_worker=e.gpus_per_worker,
            device=cfg.device,
            retries=e.retries,
        )
    from pipelines.local import LocalExecutor

    return LocalExecutor(retries=e.retries)


def _abs(path: str | None) -> str | None:
    return None if path is None else str(Path(path).expanduser().resolve())


class _Run:
    """State of one `hype score` invocation."""

    def __init__(self, cfg: ScoreConfig, executor, progress: bool):
        self.cfg = cfg
        self.run = RunDir(Path(cfg.out).expanduser().resolve())
        self.executor = executor
        self.progress = progress
        self.warnings: list[str] = []
        self.stages: dict[str, dict] = {}
        self.failures: list[dict] = []
        self.started = time.perf_counter()
        self.plan: dict = {"pool": cfg.pool, "shards": 0}

    # --- helpers --------------------------------------------------------------------------------

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)
            log.warning("%s", message)

    def stage_kwargs(self) -> dict:
        return {"device": self.cfg.device, "threads": self.cfg.threads, "debug": self.cfg.debug}

    def map(self, stage, tasks: list[ShardTask]) -> list[dict]:
        """Run a per-shard stage where needed; return every shard's stats (reused or new) in task order."""
        from tqdm import tqdm

        started = time.perf_counter()
        todo, done = stage.pending(tasks)
        results: dict[str, dict] = {s["shard_id"]: s for s in done}
        samples = [0]
        bar = tqdm(
            total=len(todo),
            desc=f"{stage.name:<11}",
            unit="shard",
            file=sys.stderr,
            disable=not self.progress or not todo,
            dynamic_ncols=True,
        )

        def on_result(task: ShardTask, stats: dict) -> None:
            results[task.shard_id] = stats
            samples[0] += int((stats.get("counts") or {}).get("samples", 0))
            elapsed = time.perf_counter() - started
            bar.set_postfix_str(f"{samples[0] / max(elapsed, 1e-9):,.0f} samples/s", refresh=False)
            bar.update(1)

        try:
            failures = self.executor.map(stage, todo, on_result) if todo else []
        except StageSetupError as e:
            raise ScoreError(str(e)) from None
        finally:
            bar.close()
        seconds = time.perf_counter() - started
        for s in results.values():
            stage.remember(stage.name, _task_of(s, tasks), s)
        retries = sum(max(0, int(s.get("attempts", 1)) - 1) for s in results.values() if s.get("attempts"))
        m = self.stages.setdefault(stage.name, {})
        for key in ("seconds", "shards_run", "shards_reused", "samples"):
            m.setdefault(key, 0)
        m["seconds"] = round(m["seconds"] + seconds, 3)
        m["shards_run"] += len(todo) - len(failures)
        m["shards_reused"] += len(done)
        m["samples"] += samples[0]
        m["samples_per_s"] = (
            round(m["samples"] / m["seconds"], 1) if m["seconds"] > 0 and m["samples"] else None
        )
        m["retries"] = m.get("retries", 0) + retries + sum(f["attempts"] - 1 for f in failures)
        if failures:
            m["failed"] = failures
            self.failures += [f | {"stage": stage.name} for f in failures]
        return [results[t.shard_id] for t in tasks if t.shard_id in results]

    def timed(self, name: str, fn: Callable[[], dict]) -> dict:
        started = time.perf_counter()
        info = fn()
        m = self.stages.setdefault(name, {"seconds": 0.0})
        m["seconds"] = round(m.get("seconds", 0.0) + time.perf_counter() - started, 3)
        return info

    def check_failures(self, stage: str, plan: dict) -> None:
        if self.failures:
            summary = self.summary(plan, status="failed")
            shown = "; ".join(f"{f['shard']}: {f['error']}" for f in self.failures[:3])
            raise ScoreFailed(
                f"{len(self.failures)} shard(s) failed in the {stage} stage after retries ({shown}); the "
                "scores table was not written. Fix the cause and rerun the same command: finished shards "
                "are kept.",
                summary,
            )

    def summary(self, plan: dict, status: str, **extra) -> dict:
        s = summary_mod.build_summary(
            self.cfg,
            self.run,
            plan,
            status=status,
            stages=self.stages,
            warnings=self.warnings,
            failures=self.failures,
            seconds=time.perf_counter() - self.started,
            executor=self.executor.name,
            **extra,
        )
        atomic_write_json(self.run.summary, s)
        return s


def _task_of(stats: dict, tasks: list[ShardTask]) -> ShardTask:
    t = tasks[stats["index"]] if 0 <= stats.get("index", -1) < len(tasks) else None
    if t is None or t.shard_id != stats["shard_id"]:
        t = next(x for x in tasks if x.shard_id == stats["shard_id"])
    return t


def _plan(cfg: ScoreConfig, warn: Callable[[str], None]) -> tuple[list[ShardTask], list[str]]:
    from hype.data.shards import ShardError, expand_shards

    try:
        shards = expand_shards(cfg.pool)
    except ShardError as e:
        raise ScoreError(str(e).replace("--data", "--pool")) from None
    seen, paths = set(), []
    for p in shards.paths:
        key = str(Path(p).resolve())
        if key in seen:
            warn(f"{p}: listed more than once in --pool; scored once")
            continue
        seen.add(key)
        paths.append(p)
    tasks = make_tasks(paths)
    ids = {}
    for t in tasks:
        if t.shard_id in ids:
            raise ScoreError(f"shard id collision between {ids[t.shard_id]} and {t.path}; rename one of them")
        ids[t.shard_id] = t.path
    for p in shards.empty:
        warn(f"{p}: empty (0-byte) shard skipped; re-download it")
    return tasks, list(shards.empty)


def _model_ref(path: str | None, role: str) -> ModelRef | None:
    if path is None:
        return None
    from hype.checkpoint import CheckpointError, read_checkpoint_metadata

    try:
        meta = read_checkpoint_metadata(path)
    except CheckpointError as e:
        raise ScoreError(f"--{role}: {e}") from None
    geometry = meta["model_config"].get("geometry", "")
    if role == "meru" and not geometry.startswith("hyperbolic"):
        raise ScoreError(f"--meru {path}: a {geometry!r} model; --meru needs a hyperbolic (MERU) checkpoint")
    if role == "clip" and geometry not in ("clip", "elliptic"):
        raise ScoreError(f"--clip {path}: a {geometry!r} model; --clip needs a CLIP (cosine) checkpoint")
    return ModelRef(path, file_digest(path))


def run_score(cfg: ScoreConfig, *, executor=None, progress: bool | None = None) -> dict:
    """Score a pool into `cfg.out`; return the summary (also written to RUN_DIR/summary.json).

    Raises `ScoreError` for unusable inputs and `ScoreFailed` when shards fail after their retries.
    """
    from hype.models import ConfigError

    try:
        cfg.check_inputs()
    except ConfigError as e:
        raise ScoreError(str(e)) from None
    cfg = _with_absolute_paths(cfg)
    progress = cfg.progress if progress is None else progress
    own_executor = executor is None
    if executor is None:
        try:
            executor = make_executor(cfg)
        except (RuntimeError, ConnectionError, ValueError) as e:
            raise ScoreError(f"--executor {cfg.executor.kind}: {e}") from None
    state = _Run(cfg, executor, progress)
    run = state.run
    run.create()
    try:
        with run.lock():
            run.remove_stale_temporaries()
            atomic_write_bytes(run.config, cfg.to_yaml().encode())
            try:
                return _score(state)
            except ScoreError as e:
                # Readers (hype select/report) must not take a half-written run for a finished one.
                state.summary(state.plan, status="failed", error=str(e))
                raise
    finally:
        if own_executor:
            executor.close()


def _with_absolute_paths(cfg: ScoreConfig) -> ScoreConfig:
    import dataclasses

    return dataclasses.replace(
        cfg,
        meru=_abs(cfg.meru),
        clip=_abs(cfg.clip),
        out=_abs(cfg.out),
        reference=dataclasses.replace(cfg.reference, file=_abs(cfg.reference.file)),
        clusters=dataclasses.replace(cfg.clusters, class_features=_abs(cfg.clusters.class_features)),
        metadata=dataclasses.replace(cfg.metadata, dir=_abs(cfg.metadata.dir)),
        debug=dataclasses.replace(cfg.debug, pid_dir=_abs(cfg.debug.pid_dir)),
    )


def _score(state: _Run) -> dict:
    cfg, run = state.cfg, state.run
    tasks, empty = _plan(cfg, state.warn)
    plan = state.plan = {"pool": cfg.pool, "shards": len(tasks), "empty_shards": empty}
    atomic_write_json(
        run.plan,
        {
            "pool": cfg.pool,
            "empty": empty,
            "shards": [{"index": t.index, "path": t.path, "id": t.shard_id} for t in tasks],
        },
    )
    state.summary(plan, status="running")
    meru = _model_ref(cfg.meru, "meru")
    clip = _model_ref(cfg.clip, "clip")
    kw = state.stage_kwargs()
    embed_kw = {
        "batch_size": cfg.batch_size,
        "decode_workers": cfg.embed.decode_workers,
        "decode": cfg.embed.decode,
        "prefetch_batches": cfg.embed.prefetch_batches,
        "jpeg_draft": cfg.embed.jpeg_draft,
        "precision": cfg.precision,
    }

    # --- embed ----------------------------------------------------------------------------------
    metadata = None
    if cfg.metadata.dir is not None:
        from hype.scoring.metadata import MetadataError, build_index

        try:
            info = state.timed(
                "metadata",
                lambda: build_index(cfg.metadata.dir, run.metadata_index, cfg.metadata.score_column),
            )
        except MetadataError as e:
            raise ScoreError(str(e)) from None
        metadata = {
            "dir": cfg.metadata.dir,
            "features_key": cfg.metadata.features_key,
            "index": info["fingerprint"],
        }
    embed = EmbedStage(run, meru=meru, clip=clip, metadata=metadata, **embed_kw, **kw)
    embed_stats = state.map(embed, tasks)
    state.check_failures("embed", plan)
    pool_rows = sum(s["output"]["rows"] for s in embed_stats)
    if pool_rows == 0:
        summary = state.summary(plan, status="failed", embed_stats=embed_stats)
        reasons = summary["samples"]["skipped_by_reason"]
        raise ScoreFailed(
            f"no sample of the pool could be embedded (skipped: {reasons or 'none'}); see "
            f"{run.root}/embed/*_stats.json for examples",
            summary,
        )
    curv = next(s["curv"] for s in embed_stats if "curv" in s)
    K = cfg.specificity.K if cfg.specificity.K is not None else next(s["K"] for s in embed_stats if "K" in s)
    dims = next(s["dims"] for s in embed_stats if "dims" in s)
    pool_fp = fingerprint([(t.shard_id, embed.upstream_digest("embed", t)) for t in tasks])

    # --- dedup ----------------------------------------------------------------------------------
    dups = state.timed(
        "dedup", lambda: find_duplicates(run, tasks, fingerprint({"pool": pool_fp}), pool_rows)
    )
    drops = load_duplicates(run)

    # --- reference ------------------------------------------------------------------------------
    ref_info = _reference(state, tasks, drops, dups, pool_fp, curv, K, dims, kw)

    # --- specificity ----------------------------------------------------------------------------
    from hype.scoring.stage_specificity import SpecificityStage

    spec = SpecificityStage(
        run,
        curv=curv,
        K=K,
        hinge=cfg.specificity.hinge,
        reference_digest=ref_info["digest"],
        budget_elems=cfg.specificity.budget_elems,
        **kw,
    )
    state.map(spec, tasks)
    state.check_failures("specificity", plan)

    # --- clusters -------------------------------------------------------------------------------
    clusters_info = _clusters(
        state, tasks, drops, dups, pool_fp, pool_rows - dups["duplicates"], dims, clip, embed_kw, kw, plan
    )

    # --- merge ----------------------------------------------------------------------------------
    from hype.scoring.stage_merge import MergeStage

    expected = {run.shard_output("merge", t).name for t in tasks}
    for stale in run.scores.glob("part-*.parquet"):
        if stale.name not in expected:
            stale.unlink()
    merge = MergeStage(
        run, c_in=clusters_info is not None, duplicates_digest=dups["digest"], drops=drops, **kw
    )
    merge_stats = state.map(merge, tasks)
    state.check_failures("merge", plan)
    return state.summary(
        plan,
        status="complete",
        embed_stats=embed_stats,
        merge_stats=merge_stats,
        duplicates=dups,
        reference=ref_info,
        clusters=clusters_info,
        specificity={"hinge": cfg.specificity.hinge, "K": K, "curv": curv},
    )


def _reference(state: _Run, tasks, drops, dups, pool_fp, curv, K, dims, kw) -> dict:
    from hype.scoring.reference import ReferenceError
    from hype.scoring.stage_reference import (
        CandidateStage,
        copy_reference_file,
        select_top_m,
        select_top_pairs,
    )

    cfg, run = state.cfg, state.run
    rc = cfg.reference
    if rc.file is not None:
        try:
            return state.timed(
                "reference",
                lambda: copy_reference_file(
                    run, rc.file, dims["meru"], fingerprint({"file": file_digest(rc.file)})
                ),
            )
        except (ReferenceError, OSError) as e:
            raise ScoreError(f"--reference: {e}") from None
    top = state.timed(
        "reference",
        lambda: select_top_pairs(
            run,
            tasks,
            drops,
            rc.n_top,
            fingerprint({"pool": pool_fp, "dups": dups["digest"], "n_top": rc.n_top}),
            state.warn,
        ),
    )
    if top["n_top"] < rc.n_top:
        state.warn(f"pool of {top['pool']} samples: reference N reduced from {rc.n_top} to {top['n_top']}")
    cand = CandidateStage(
        run,
        curv=curv,
        K=K,
        hinge=rc.hinge,
        top_n_digest=top["digest"],
        budget_elems=cfg.specificity.budget_elems,
        **kw,
    )
    cand_stats = state.map(cand, tasks)
    state.check_failures("reference", {"pool": cfg.pool, "shards": len(tasks)})
    m = min(rc.m, top["pool"])
    if m < rc.m:
        state.warn(f"pool of {top['pool']} samples: reference M reduced from {rc.m} to {m}")
    meta = {"n_top": top["n_top"], "K": K, "hinge": rc.hinge, "curv": curv}
    fp = fingerprint(
        {
            "top_n": top["digest"],
            "candidates": [s["output"]["digest"] for s in cand_stats],
            "m": m,
            "dups": dups["digest"],
            "meta": meta,
        }
    )
    info = state.timed("reference", lambda: select_top_m(run, tasks, drops, m, meta, fp, state.warn))
    return info


def _clusters(
    state: _Run, tasks, drops, dups, pool_fp, pool_unique, dims, clip, embed_kw, kw, plan
) -> dict | None:
    from hype.scoring.clusters import default_num_clusters
    from hype.scoring.stage_clusters import (
        AssignStage,
        ClassFeatureError,
        class_features_from_stage,
        read_class_features_file,
        train_clusters,
    )

    cfg, run = state.cfg, state.run
    cc = cfg.clusters
    if cc.class_features is None and cc.class_images is None:
        state.warn(
            "no --class-features or --class-images: c_IN is 0 for every sample (the ImageNet-cluster term "
            "is off)"
        )
        return None
    try:
        if cc.class_features is not None:
            feats = read_class_features_file(cc.class_features, dims["clip"])
            class_digest = file_digest(cc.class_features)
        else:
            from hype.data.shards import ShardError, expand_shards

            try:
                class_tasks = make_tasks(expand_shards(cc.class_images).paths)
            except ShardError as e:
                raise ScoreError(f"--class-images: {e}") from None
            stage = ClassEmbedStage(run, clip=clip, **embed_kw, **kw)
            class_stats = state.map(stage, class_tasks)
            state.check_failures("classes", plan)
            feats = class_features_from_stage(run, class_tasks)
            if feats.shape[1] != dims["clip"]:
                raise ClassFeatureError(
                    f"--class-images: features of width {feats.shape[1]}, the pool's CLIP features have "
                    f"{dims['clip']}; with --metadata, pass --class-features from the metadata's CLIP model"
                )
            class_digest = fingerprint([s["output"]["digest"] for s in class_stats])
    except ClassFeatureError as e:
        raise ScoreError(str(e)) from None
    k = cc.num_clusters or default_num_clusters(pool_unique)
    max_points = cc.points_per_centroid * k
    if cc.max_train_points is not None:
        max_points = min(max_points, cc.max_train_points)
    fp = fingerprint(
        {
            "pool": pool_fp,
            "dups": dups["digest"],
            "classes": class_digest,
            "k": k,
            "niter": cc.niter,
            "seed": cc.seed,
            "max_points": max_points,
            "gpu": cc.gpu,
        }
    )
    model = state.timed(
        "clusters",
        lambda: train_clusters(
            run,
            tasks,
            drops,
            feats,
            k=k,
            niter=cc.niter,
            seed=cc.seed,
            max_points=max_points,
            gpu=cc.gpu,
            fp=fp,
            warn=state.warn,
        ),
    )
    assign = AssignStage(run, model_digest=model["digest"], caption_filter=cc.caption_filter, **kw)
    assign_stats = state.map(assign, tasks)
    state.check_failures("clusters", plan)
    return model | {
        "caption_filter": cc.caption_filter,
        "caption_ok": sum(int(s["counts"]["caption_ok"]) for s in assign_stats),
        "class_source": cc.class_features or cc.class_images,
    }
