"""`hype score` orchestration: the stages declared in `STAGES`, run in order over an executor, resumable at
shard granularity.

    embed        per shard   decode + MERU + CLIP (driver: --metadata's index)  -> embed/<id>.parquet
    dedup        driver      duplicate uids (keep the first)                  -> dedup/duplicates.parquet
    reference    driver + per shard + driver (HYPE §3.3), or --reference     -> reference.safetensors
    specificity  per shard   ε_i, ε_t                                         -> specificity/<id>.parquet
    classes      per class shard (--class-images) or --class-features read    -> classes/<id>.parquet
    captions     per shard   DataComp's caption filter (c_IN)                 -> captions/<id>.parquet
    clusters     driver k-means (or --centroids) + per shard                  -> clusters/<id>.parquet (c_IN)
    decontam     per eval shard + driver (--decontaminate)                    -> decontam/matches.parquet
    merge        per shard   THE scores table                                 -> scores/part-<index>.parquet
    neardup      per shard + per cluster group + driver (--neardup)           -> neardup/groups.parquet

Each entry of `STAGES` (a `StageSpec`) names the stage, the typed settings it takes from the config, the
condition under which it runs, the stages whose outputs it reads (declared earlier) and where its work runs
(mapped over the shards on the executor, a driver step, or both); `_score` runs the list, so a new stage is
a new entry. The run ends with `card.json` and the summary.

Per-shard work goes through an executor found by name in `hype.executor.EXECUTORS` (`local` in-process,
`ray`: the plug-ins of `pipelines/`); the driver-side steps stream the per-shard outputs with bounded
memory. Every output is skipped when its marker records the current fingerprint (see `rundir`), so a
rerun after a crash continues where it stopped and a rerun of a finished run does nothing but check: it
reads the scores parts back (their digests) and any shard whose read ended early (missing, unreadable)
again, since a failing store looks the same. A complete run given new shards grows (`hype.scoring.grow`):
the reference and clusters steps keep the run's frozen outputs, and only the new shards are computed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hype.executor import MapResult, Progress, StageSetupError, make_executor
from hype.io import StorageError, blake2b128_file, cached_copy, read_json, storage
from hype.io.lock import LockError
from hype.scoring import summary as summary_mod
from hype.scoring.config import (
    ClustersConfig,
    DecontamConfig,
    NeardupConfig,
    ReferenceConfig,
    ScoreConfig,
    SpecificityConfig,
)
from hype.scoring.dedup import find_duplicates, load_duplicates
from hype.scoring.embed import ClassEmbedStage, EmbedStage, ModelRef
from hype.scoring.errors import ScoreError, ScoreFailed
from hype.scoring.grow import Frozen, GrowError, grow_plan
from hype.scoring.rundir import (
    RunDir,
    RunDirError,
    ShardTask,
    atomic_write_bytes,
    atomic_write_json,
    fingerprint,
    make_tasks,
)

log = logging.getLogger("hype.score")


def _abs(path: str | None) -> str | None:
    return None if path is None else storage.absolute(path)


class _Run:
    """State of one `hype score` invocation."""

    def __init__(self, cfg: ScoreConfig, executor, progress: bool):
        self.cfg = cfg
        self.run = RunDir(storage.absolute(cfg.out))
        self.executor = executor
        self.progress = progress
        self.warnings: list[str] = []
        self.stages: dict[str, dict] = {}
        self.failures: list[dict] = []
        self.started = time.perf_counter()
        self.plan: dict = {"pool": cfg.pool, "shards": 0}
        self.tasks: list[ShardTask] = []  # the pool's shards (`_check_inputs`)
        self.metadata: dict | None = None  # what --metadata supplies (`_metadata`)
        self.frozen: Frozen | None = None  # a run that grows keeps these (`hype.scoring.grow`)
        self.empty: list[str] = []  # 0-byte shards of the pool (`_check_inputs`)
        self.begun = False  # the run is marked running (`_begin`): from then on a stop marks it failed
        self._models: dict[str, ModelRef | None] = {}

    def model(self, role: str) -> ModelRef | None:
        """The --meru / --clip model with its digest (digested once per invocation)."""
        if role not in self._models:
            self._models[role] = _model_ref(getattr(self.cfg, role), role)
        return self._models[role]

    # --- helpers --------------------------------------------------------------------------------

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)
            log.warning("%s", message)

    def stage_kwargs(self) -> dict:
        # `auto` resolved once, as the workers will: the embed fingerprint holds the device's numerics.
        resolve = getattr(self.executor, "worker_device", None)
        device = resolve(self.cfg.device) if resolve is not None else self.cfg.device
        return {"device": device, "threads": self.cfg.threads, "debug": self.cfg.debug}

    def embed_kwargs(self) -> dict:
        """Settings of the embed stages (pool and class images)."""
        return EmbedSettings.of(self.cfg).kwargs()

    def map(self, stage, tasks: list[ShardTask]) -> list[dict]:
        """Run a per-shard stage where needed; return every shard's stats (reused or new) in task order."""
        started = time.perf_counter()
        samples = [0]

        def count(task: ShardTask, stats: dict) -> None:
            samples[0] += int((stats.get("counts") or {}).get("samples", 0))

        def rate() -> str:
            return f"{samples[0] / max(time.perf_counter() - started, 1e-9):,.0f} samples/s"

        progress = Progress(f"{stage.name:<11}", enabled=self.progress, postfix=rate)
        try:
            result = self.executor.map(stage, tasks, count, progress=progress)
        except StageSetupError as e:
            raise ScoreError(str(e)) from None
        for task, stats in zip(tasks, result.results, strict=True):
            if stats is not None:
                stage.remember(stage.name, task, stats)
        self._record(stage.name, result, samples[0])
        return [s for s in result.results if s is not None]

    def _record(self, name: str, result: MapResult, samples: int) -> None:
        """Add one map's shard counts, time and failures to the stage's metrics."""
        m = self.stages.setdefault(name, {})
        for key in ("seconds", "shards_run", "shards_reused", "samples"):
            m.setdefault(key, 0)
        m["seconds"] = round(m["seconds"] + result.seconds, 3)
        m["shards_run"] += result.ran
        m["shards_reused"] += result.reused
        m["samples"] += samples
        m["samples_per_s"] = (
            round(m["samples"] / m["seconds"], 1) if m["seconds"] > 0 and m["samples"] else None
        )
        m["retries"] = m.get("retries", 0) + result.retries
        if result.failures:
            failed = [
                {"shard": f.task.path, "shard_id": f.task.shard_id, "attempts": f.attempts, "error": f.error}
                for f in result.failures
            ]
            m["failed"] = failed
            self.failures += [f | {"stage": name} for f in failed]

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
            metadata=self.metadata,
            **extra,
        )
        atomic_write_json(self.run.summary, s)
        return s


def _plan(cfg: ScoreConfig, warn: Callable[[str], None]) -> tuple[list[ShardTask], list[str]]:
    from hype.data.shards import ShardError, expand_shards

    try:
        shards = expand_shards(cfg.pool)
    except ShardError as e:
        raise ScoreError(str(e).replace("--data", "--pool")) from None
    seen, paths = set(), []
    for p in shards.paths:
        key = storage.absolute(p)
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
    from hype.checkpoint import model_file_config, model_file_digest

    try:
        local = cached_copy(path)  # a URL: downloaded once here, once per worker (`load_scorer`)
        geometry = model_file_config(local).get("geometry", "")
        # open_clip sources (folders, OpenAI releases) are digested with the config beside their weights.
        digest = model_file_digest(local, blake2b128_file)
    except (ValueError, OSError) as e:  # CheckpointError, ModelFileError, ConfigError
        raise ScoreError(f"--{role}: {e}") from None
    if role == "meru" and not geometry.startswith("hyperbolic"):
        raise ScoreError(f"--meru {path}: a {geometry!r} model; --meru needs a hyperbolic (MERU) checkpoint")
    if role == "clip" and geometry not in ("clip", "elliptic"):
        raise ScoreError(f"--clip {path}: a {geometry!r} model; --clip needs a CLIP (cosine) checkpoint")
    return ModelRef(path, digest)


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
    try:
        run.create()
        with run.lock():
            run.remove_stale_temporaries()
            try:
                return _score(state)
            except (ScoreError, RunDirError, StorageError) as e:
                if state.begun:  # an input refused before `_begin` leaves the run as it was
                    _mark_failed(state, str(e))
                raise
    except (RunDirError, LockError, StorageError) as e:  # locked, unwritable, the store failed: say so, stop
        raise ScoreError(str(e)) from None
    finally:
        if own_executor:
            executor.close()


def _mark_failed(state: _Run, error: str) -> None:
    try:
        state.summary(state.plan, status="failed", error=error)
    except OSError:  # the store is down: the summary still says `running`, which readers refuse too
        log.warning("%s: could not mark the run failed", state.run.summary)


def _with_absolute_paths(cfg: ScoreConfig) -> ScoreConfig:
    return dataclasses.replace(
        cfg,
        meru=_abs(cfg.meru),
        clip=_abs(cfg.clip),
        out=_abs(cfg.out),
        reference=dataclasses.replace(cfg.reference, file=_abs(cfg.reference.file)),
        clusters=dataclasses.replace(
            cfg.clusters,
            class_features=_abs(cfg.clusters.class_features),
            centroids=_abs(cfg.clusters.centroids),
        ),
        metadata=dataclasses.replace(cfg.metadata, dir=_abs(cfg.metadata.dir)),
        decontam=dataclasses.replace(cfg.decontam, eval_dir=_abs(cfg.decontam.eval_dir)),
        debug=dataclasses.replace(cfg.debug, pid_dir=_abs(cfg.debug.pid_dir)),
    )


def _score(state: _Run) -> dict:
    """Check the inputs and plan the shards, then run `STAGES` in order; the card and the summary close
    the run."""
    _check_inputs(state)
    _begin(state)
    outputs: dict[str, Any] = {}
    for spec in STAGES:
        outputs[spec.name] = _run_stage(state, spec, outputs)
    pool = outputs["dedup"]
    state.timed("card", lambda: _card(state, pool))
    return state.summary(
        state.plan,
        status="complete",
        embed_stats=pool.stats,
        merge_stats=outputs["merge"],
        duplicates=pool.dups,
        reference=outputs["reference"],
        clusters=outputs["clusters"],
        specificity=outputs["specificity"],
        decontam=outputs["decontam"],
        neardup=outputs["neardup"],
    )


def _run_stage(state: _Run, spec: StageSpec, outputs: dict[str, Any]) -> Any:
    """One declared stage: its output, or None when the config does not ask for it. It sees the outputs
    of the stages it reads, and nothing else."""
    if not spec.when(state.cfg):
        return None
    return spec.run(state, spec.settings(state.cfg), {name: outputs[name] for name in spec.reads})


def _card(state: _Run, pool: _Embedded) -> dict:
    """RUN_DIR/card.json: digests of what the scores depend on and a checksummed sample of them."""
    from hype.scoring.card import card_settings, write_card
    from hype.scoring.embed import resolve_precision
    from hype.scoring.stagebase import resolve_device

    cfg = state.cfg
    resolved = resolve_precision(resolve_device(cfg.device), cfg.precision)
    settings = card_settings(cfg, resolved, pool.curv, pool.K)
    clip_from_metadata = state.metadata is not None and state.metadata.get("cos_theta") != "--clip"
    models = {"meru": pool.meru.digest, "clip": None if clip_from_metadata else pool.clip.digest}
    card = write_card(state.run, settings, models, {"meru": cfg.meru, "clip": models["clip"] and cfg.clip})
    return {"rows_sampled": len(card["sample"]["rows"])}


def _check_inputs(state: _Run) -> None:
    """Open every input before anything changes: the pool's shards (`state.tasks`, planned: a complete run
    grows, `hype.scoring.grow`), the models, the frozen parts of a grow and --centroids. A refusal here
    leaves the run directory as it was, so a complete run stays complete."""
    cfg, run = state.cfg, state.run
    tasks, state.empty = _plan(cfg, state.warn)
    for role in ("meru", "clip"):
        state.model(role)
    try:
        state.tasks, state.frozen = grow_plan(run, tasks)
        if state.frozen is not None:
            _check_frozen(state)
    except GrowError as e:
        raise ScoreError(str(e)) from None
    _check_centroids(state)


def _begin(state: _Run) -> None:
    """Mark the run running (readers, hype select and report, then refuse it until it is complete again:
    the scores of the last run stay until merge replaces them), record the resolved config and write
    plan.json."""
    cfg, run, tasks, empty = state.cfg, state.run, state.tasks, state.empty
    previous = read_json(run.plan) or {}
    pools = list(previous.get("pools") or [previous.get("pool")]) if state.frozen is not None else []
    if cfg.pool not in pools:
        pools.append(cfg.pool)
    state.plan = {"pool": cfg.pool, "shards": len(tasks), "empty_shards": empty}
    if state.frozen is not None:
        state.plan["grown"] = {"added": state.frozen.added, "pools": pools}
    state.summary(state.plan, status="running")
    state.begun = True
    atomic_write_bytes(run.config, cfg.recorded().to_yaml().encode())
    if state.frozen is not None:
        try:
            _check_frozen_targets(state)  # class images may be embedded: work, after the run is marked
        except GrowError as e:
            raise ScoreError(str(e)) from None
    atomic_write_json(
        run.plan,
        {
            "pool": cfg.pool,
            "pools": pools,  # every --pool the run's shards came from (several once it has grown)
            "frozen": state.frozen is not None,
            "empty": empty,
            "shards": [
                {"index": t.index, "path": t.path, "id": t.shard_id, "source": t.source} for t in tasks
            ],
        },
    )


def _check_frozen(state: _Run) -> None:
    """Refuse a grow whose models, --reference or --centroids differ from the run's frozen ones."""
    from hype.scoring.grow import check_centroids, check_model, check_reference

    cfg, frozen = state.cfg, state.frozen
    for role in ("meru", "clip"):
        ref = state.model(role)
        check_model(frozen, role, getattr(cfg, role), ref and ref.digest)
    check_reference(frozen, state.run, cfg.reference.file, None)
    check_centroids(frozen, state.run, cfg.clusters.centroids)
    log.info("growing %s by %d shard(s) against its frozen reference", state.run.root, frozen.added)


def _check_frozen_targets(state: _Run) -> None:
    """A class set given to a grow must give the frozen c_IN targets with the frozen centroids (class
    images: embedded now, or their outputs reused, before the pool changes)."""
    from hype.io import load_npy
    from hype.scoring.clusters import target_centroids
    from hype.scoring.grow import check_targets

    cc, frozen, run = state.cfg.clusters, state.frozen, state.run
    if cc.class_features is None and cc.class_images is None:
        return
    source = (
        f"--class-features {cc.class_features}" if cc.class_features else f"--class-images {cc.class_images}"
    )
    targets = None
    if frozen.clusters is not None:
        centroids = load_npy(run.centroids)
        clip = state.model("clip")
        feats, _ = _class_features(
            state, clip, centroids.shape[1], state.embed_kwargs(), state.stage_kwargs()
        )
        targets = target_centroids(feats, centroids).astype("int64")
    check_targets(frozen, run, targets, source)


def _metadata(state: _Run) -> dict | None:
    """The uid index of --metadata; with its .npz, its CLIP features and scores stand in for --clip."""
    cfg, run = state.cfg, state.run
    if cfg.metadata.dir is None:
        return None
    from hype.scoring.metadata import MetadataError, build_index, feature_source, metadata_files

    mc = cfg.metadata
    try:
        files = metadata_files(mc.dir)
        source, missing = feature_source(files, have_clip=cfg.clip is not None)
        if missing and len(missing) < len(files):
            state.warn(
                f"{len(missing)} of {len(files)} metadata files have no .npz (e.g. {missing[0]}): CLIP "
                "features and cos θ are computed with --clip for the whole pool"
            )
        score_column = mc.score_column if source == "npz" else None
        info = state.timed("metadata", lambda: build_index(mc.dir, run.metadata_index, score_column))
    except MetadataError as e:
        raise ScoreError(str(e)) from None
    state.metadata = {
        "dir": mc.dir,
        "files": len(files),
        "rows": info["rows"],
        "features": f".npz {mc.features_key}" if source == "npz" else "--clip",
        "cos_theta": score_column or "--clip",
    }
    return {
        "dir": mc.dir,
        "features_key": mc.features_key if source == "npz" else None,
        "index": info["fingerprint"],
    }


def _embed(state: _Run, settings: EmbedSettings, inputs: dict) -> _Embedded:
    """Every shard's embeddings and pair scores (with --metadata, its uid index first)."""
    cfg, run, plan, tasks = state.cfg, state.run, state.plan, state.tasks
    meru, clip = state.model("meru"), state.model("clip")
    kw, embed_kw = state.stage_kwargs(), settings.kwargs()
    metadata = _metadata(state)
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
    K = cfg.specificity.K if cfg.specificity.K is not None else next(s["K"] for s in embed_stats if "K" in s)
    return _Embedded(
        tasks=tasks,
        stats=embed_stats,
        fingerprint=fingerprint([(t.shard_id, embed.upstream_digest("embed", t)) for t in tasks]),
        rows=pool_rows,
        dims=next(s["dims"] for s in embed_stats if "dims" in s),
        curv=next(s["curv"] for s in embed_stats if "curv" in s),
        K=K,
        clip=clip,
        meru=meru,
        embed_kw=embed_kw,
        kw=kw,
    )


def _dedup(state: _Run, settings: None, inputs: dict) -> _Embedded:
    """The duplicate uids of the embedded pool (the first copy is kept): the pool as later stages see it."""
    pool, run = inputs["embed"], state.run
    dups = state.timed(
        "dedup", lambda: find_duplicates(run, pool.tasks, fingerprint({"pool": pool.fingerprint}), pool.rows)
    )
    return dataclasses.replace(pool, drops=load_duplicates(run), dups=dups)


def _specificity(state: _Run, sc: SpecificityConfig, inputs: dict) -> dict:
    """ε_i and ε_t of every shard against the reference sets."""
    from hype.scoring.stage_specificity import SpecificityStage

    pool = inputs["embed"]
    spec = SpecificityStage(
        state.run,
        curv=pool.curv,
        K=pool.K,
        hinge=sc.hinge,
        reference_digest=inputs["reference"]["digest"],
        budget_elems=sc.budget_elems,
        **pool.kw,
    )
    state.map(spec, pool.tasks)
    state.check_failures("specificity", state.plan)
    return {"hinge": sc.hinge, "K": pool.K, "curv": pool.curv}


def _merge(state: _Run, settings: None, inputs: dict) -> list[dict]:
    """THE scores table, one part per shard (parts of shards no longer in the pool are removed)."""
    from hype.scoring.stage_merge import MergeStage

    run, pool = state.run, inputs["dedup"]
    expected = {run.shard_output("merge", t).name for t in pool.tasks}
    for name in storage.list_sizes(run.scores):
        if name.startswith("part-") and name.endswith(".parquet") and name not in expected:
            storage.remove(run.scores / name)
    c_in = inputs["clusters"] is not None
    merge = MergeStage(run, c_in=c_in, drops=pool.drops, **pool.kw)
    merge_stats = state.map(merge, pool.tasks)
    state.check_failures("merge", state.plan)
    return merge_stats


def _decontaminate(state: _Run, settings: DecontamConfig, inputs: dict) -> dict | None:
    """--decontaminate: pool samples near an evaluation image (`hype.scoring.stage_decontam`)."""
    from hype.scoring.stage_decontam import decontaminate

    return decontaminate(state, inputs["embed"])


def _neardup(state: _Run, settings: NeardupConfig, inputs: dict) -> dict:
    """Near-duplicate groups and keepers, after merge: the `hype` keeper reads the scores (see
    `hype.scoring.stage_neardup`)."""
    from hype.scoring.stage_neardup import NeardupError, find_near_duplicates

    try:
        return find_near_duplicates(state, inputs["dedup"], inputs["clusters"])
    except NeardupError as e:
        raise ScoreError(str(e)) from None


@dataclass(frozen=True)
class _Embedded:
    """The embedded pool, as the stages after embed see it (`drops`, `dups`: set by dedup)."""

    tasks: list[ShardTask]
    stats: list[dict]  # every shard's embed marker
    fingerprint: str  # of every shard's embed output
    rows: int  # embedded rows, duplicates included
    dims: dict  # feature widths: meru, clip
    curv: float
    K: float
    clip: ModelRef | None
    meru: ModelRef
    embed_kw: dict  # settings of the embed stages
    kw: dict  # settings of every stage
    drops: Any = None  # rows to leave out (`load_duplicates`)
    dups: dict | None = None  # the dedup step's info: digest, duplicates

    @property
    def unique(self) -> int:
        return self.rows - self.dups["duplicates"]


def _reference(state: _Run, rc: ReferenceConfig, inputs: dict) -> dict:
    """S_i and S_t: the frozen ones of a run that grows, --reference's, or selected from the pool."""
    from hype.scoring.reference import ReferenceError
    from hype.scoring.stage_reference import copy_reference_file

    run, pool = state.run, inputs["dedup"]
    if state.frozen is not None:  # checked against --reference by `_check_frozen`
        return state.frozen.reference
    if rc.file is None:
        return _select_reference(state, pool)
    try:
        return state.timed(
            "reference",
            lambda: copy_reference_file(
                run, rc.file, pool.dims["meru"], fingerprint({"file": blake2b128_file(rc.file)})
            ),
        )
    except (ReferenceError, OSError) as e:
        raise ScoreError(f"--reference: {e}") from None


def _select_reference(state: _Run, pool: _Embedded) -> dict:
    """HYPE §3.3 on the pool: the top-N pairs by cos θ, then the M most generic among them."""
    from hype.scoring.stage_reference import CandidateStage, select_top_m, select_top_pairs

    cfg, run, tasks = state.cfg, state.run, pool.tasks
    rc = cfg.reference
    top_fp = fingerprint({"pool": pool.fingerprint, "dups": pool.dups["digest"], "n_top": rc.n_top})
    top = state.timed(
        "reference", lambda: select_top_pairs(run, tasks, pool.drops, rc.n_top, top_fp, state.warn)
    )
    if top["n_top"] < rc.n_top:
        state.warn(f"pool of {top['pool']} samples: reference N reduced from {rc.n_top} to {top['n_top']}")
    cand = CandidateStage(
        run,
        curv=pool.curv,
        K=pool.K,
        hinge=rc.hinge,
        top_n_digest=top["digest"],
        budget_elems=cfg.specificity.budget_elems,
        **pool.kw,
    )
    cand_stats = state.map(cand, tasks)
    state.check_failures("reference", {"pool": cfg.pool, "shards": len(tasks)})
    m = min(rc.m, top["pool"])
    if m < rc.m:
        state.warn(f"pool of {top['pool']} samples: reference M reduced from {rc.m} to {m}")
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
    return state.timed("reference", lambda: select_top_m(run, tasks, pool.drops, m, meta, fp, state.warn))


def _has_classes(cc: ClustersConfig) -> bool:
    return cc.class_features is not None or cc.class_images is not None


def _c_in(state: _Run) -> bool:
    """Whether the run has c_IN: the frozen clusters of a run that grows, else a class set given."""
    if state.frozen is not None:
        return state.frozen.clusters is not None
    return _has_classes(state.cfg.clusters)


def _classes(state: _Run, cc: ClustersConfig, inputs: dict) -> tuple[Any, str] | None:
    """(class feature matrix, its digest) of the class set given (a run that grows checked its own
    against the frozen targets before the pool changed: `_check_frozen_targets`)."""
    if state.frozen is not None:
        return None
    pool = inputs["embed"]
    return _class_features(state, pool.clip, pool.dims["clip"], pool.embed_kw, pool.kw)


def _captions(state: _Run, cc: ClustersConfig, inputs: dict) -> str | None:
    """DataComp's caption filter of every shard (when the run has c_IN); the digest of its outputs."""
    from hype.scoring.stage_clusters import CaptionStage

    if not _c_in(state):
        return None
    pool = inputs["embed"]
    stats = state.map(CaptionStage(state.run, **pool.kw), pool.tasks)
    state.check_failures("captions", state.plan)
    return fingerprint([s["output"]["digest"] for s in stats])


def _clusters(state: _Run, cc: ClustersConfig, inputs: dict) -> dict | None:
    """c_IN: the k-means model (frozen, --centroids, or trained on the pool's CLIP image features), then
    each sample's cluster."""
    from hype.scoring.stage_clusters import AssignStage

    pool = inputs["dedup"]
    if state.frozen is not None:  # a class set given was checked against it by `_check_frozen`
        model = state.frozen.clusters
    elif not _has_classes(cc):
        state.warn(
            "no --class-features or --class-images: c_IN is 0 for every sample (the ImageNet-cluster term "
            "is off)"
        )
        model = None
    elif cc.centroids is not None:
        model = _given_centroids(state, pool, *inputs["classes"])
    else:
        model = _train_clusters(state, pool, *inputs["classes"], inputs["captions"])
    if model is None:
        return None
    assign = AssignStage(
        state.run,
        model_digest=model["digest"],
        caption_filter=cc.caption_filter,
        backend=cc.backend,
        **pool.kw,
    )
    assign_stats = state.map(assign, pool.tasks)
    state.check_failures("clusters", state.plan)
    return model | {
        "caption_filter": cc.caption_filter,
        "caption_ok": sum(int(s["counts"]["caption_ok"]) for s in assign_stats),
        "class_source": cc.class_features or cc.class_images,
    }


def _class_features(
    state: _Run, clip: ModelRef | None, width: int, embed_kw: dict, kw: dict
) -> tuple[Any, str]:
    """(class feature matrix, its digest) from --class-features, or embedded from --class-images with
    `clip` (features of `width`)."""
    from hype.scoring.stage_clusters import (
        ClassFeatureError,
        class_features_from_stage,
        read_class_features_file,
    )

    cc = state.cfg.clusters
    try:
        if cc.class_features is not None:
            return read_class_features_file(cc.class_features, width), blake2b128_file(cc.class_features)
        from hype.data.shards import ShardError, expand_shards

        try:
            class_tasks = make_tasks(expand_shards(cc.class_images).paths)
        except ShardError as e:
            raise ScoreError(f"--class-images: {e}") from None
        stage = ClassEmbedStage(state.run, clip=clip, **embed_kw, **kw)
        class_stats = state.map(stage, class_tasks)
        state.check_failures("classes", state.plan)
        feats = class_features_from_stage(state.run, class_tasks)
        if feats.shape[1] != width:
            raise ClassFeatureError(
                f"--class-images: features of width {feats.shape[1]}, the pool's CLIP features have "
                f"{width}; with --metadata, pass --class-features from the metadata's CLIP model"
            )
        return feats, fingerprint([s["output"]["digest"] for s in class_stats])
    except ClassFeatureError as e:
        raise ScoreError(str(e)) from None


def _check_centroids(state: _Run) -> None:
    """Read --centroids before the long stages, so that a wrong file fails in seconds, not hours."""
    path = state.cfg.clusters.centroids
    if path is None:
        return
    from hype.scoring.stage_clusters import ClustersError, read_centroids_file

    try:
        read_centroids_file(path, None)
    except ClustersError as e:
        raise ScoreError(f"--centroids: {e}") from None


def _given_centroids(state: _Run, pool: _Embedded, feats, class_digest: str) -> dict:
    """--centroids instead of k-means; keyed on the file's digest, so a changed file is noticed."""
    from hype.scoring.stage_clusters import ClustersError, use_centroids

    cc = state.cfg.clusters
    if cc.num_clusters is not None:
        state.warn(f"--num-clusters {cc.num_clusters} ignored: --centroids gives the clusters")
    try:
        # The path too, so the summary names the file given now (the model is cheap to redo).
        fp = fingerprint(
            {"centroids": blake2b128_file(cc.centroids), "path": cc.centroids, "classes": class_digest}
        )
        return state.timed(
            "clusters",
            lambda: use_centroids(state.run, cc.centroids, pool.dims["clip"], feats, fp, _where(state)),
        )
    except (ClustersError, OSError) as e:
        raise ScoreError(f"--centroids: {e}") from None


def _train_clusters(state: _Run, pool: _Embedded, feats, class_digest: str, captions: str | None) -> dict:
    """k-means of the pool's CLIP image features, on the caption-filtered rows when `captions`
    (resumable: keyed on everything it depends on)."""
    from hype.scoring.clusters import ASSIGN, backend_key, default_num_clusters
    from hype.scoring.stage_clusters import ClustersError, train_clusters

    cc = state.cfg.clusters
    k = cc.num_clusters or default_num_clusters(pool.unique)
    max_points = cc.points_per_centroid * k
    if cc.max_train_points is not None:
        max_points = min(max_points, cc.max_train_points)
    fp = fingerprint(
        {
            "pool": pool.fingerprint,
            "dups": pool.dups["digest"],
            "classes": class_digest,
            "captions": captions,
            "k": k,
            "niter": cc.niter,
            "seed": cc.seed,
            "max_points": max_points,
            "gpu": cc.gpu,
            **backend_key(cc.backend),
            **ASSIGN,  # the targets
        }
    )
    try:
        return state.timed(
            "clusters",
            lambda: train_clusters(
                state.run,
                pool.tasks,
                pool.drops,
                feats,
                caption_filter=captions is not None,
                k=k,
                niter=cc.niter,
                seed=cc.seed,
                max_points=max_points,
                gpu=cc.gpu,
                fp=fp,
                warn=state.warn,
                where=_where(state),
            ),
        )
    except ClustersError as e:
        raise ScoreError(str(e)) from None


def _where(state: _Run) -> dict:
    """Where the driver's k-means and target assignment run (`clusters.backend`, the run's device)."""
    from hype.scoring.clusters import placement

    return placement(state.cfg.clusters.backend, state.cfg.device)


# --- the stages, as data ------------------------------------------------------------------------------


@dataclass(frozen=True)
class EmbedSettings:
    """The settings of the embed stages (pool, class and evaluation images) that the config gives."""

    batch_size: int
    decode_workers: int
    decode: str
    prefetch_batches: int
    jpeg_draft: bool
    precision: str

    @classmethod
    def of(cls, cfg: ScoreConfig) -> EmbedSettings:
        e = cfg.embed
        return cls(
            cfg.batch_size, e.decode_workers, e.decode, e.prefetch_batches, e.jpeg_draft, cfg.precision
        )

    def kwargs(self) -> dict:
        return dataclasses.asdict(self)


def _always(cfg: ScoreConfig) -> bool:
    return True


def _no_settings(cfg: ScoreConfig) -> None:
    return None


@dataclass(frozen=True)
class StageSpec:
    """One stage of `hype score`: the runner runs `STAGES` in order, so a new stage is a new entry.

    `run(state, settings, outputs)` gets the stage's typed settings (`settings(cfg)`) and the outputs of
    the stages it `reads` (each earlier in the list; None for one the config left out), and returns its
    own output. `per_shard`: it maps a stage over the shards on the executor; `driver`: it has a step in
    this process (streaming every shard's outputs with bounded memory, or reading a given file)."""

    name: str  # its folder in RUN_DIR and its entry in summary.json's `stages`
    run: Callable[[_Run, Any, dict[str, Any]], Any]
    settings: Callable[[ScoreConfig], Any] = _no_settings
    reads: tuple[str, ...] = ()
    per_shard: bool = True
    driver: bool = False
    when: Callable[[ScoreConfig], bool] = _always  # the config asks for it (an option given, a switch on)


STAGES: tuple[StageSpec, ...] = (
    StageSpec("embed", _embed, EmbedSettings.of, driver=True),  # driver: --metadata's uid index
    StageSpec("dedup", _dedup, reads=("embed",), per_shard=False, driver=True),
    # top-N (driver), the candidates' mean L_e (per shard), top-M (driver); or --reference copied
    StageSpec("reference", _reference, lambda c: c.reference, reads=("embed", "dedup"), driver=True),
    StageSpec("specificity", _specificity, lambda c: c.specificity, reads=("embed", "reference")),
    StageSpec(
        "classes",  # CLIP features of --class-images, or --class-features read
        _classes,
        lambda c: c.clusters,
        reads=("embed",),
        driver=True,
        when=lambda c: _has_classes(c.clusters),
    ),
    StageSpec(
        "captions",
        _captions,
        lambda c: c.clusters,
        reads=("embed",),
        when=lambda c: c.clusters.caption_filter,
    ),
    StageSpec(
        "clusters",  # k-means (driver) or --centroids, then each sample's cluster and c_IN (per shard)
        _clusters,
        lambda c: c.clusters,
        reads=("embed", "dedup", "classes", "captions"),
        driver=True,
    ),
    StageSpec(
        "decontam",  # the evaluation images embedded (per shard), then matched (driver)
        _decontaminate,
        lambda c: c.decontam,
        reads=("embed",),
        driver=True,
        when=lambda c: c.decontam.eval_dir is not None,
    ),
    StageSpec("merge", _merge, reads=("embed", "dedup", "specificity", "clusters")),
    StageSpec(
        "neardup",  # after merge: the `hype` keeper reads the HYPE score
        _neardup,
        lambda c: c.neardup,
        reads=("dedup", "clusters", "merge"),
        driver=True,
        when=lambda c: c.neardup.enabled,
    ),
)
