"""`hype score` orchestration: the stages of `hype.scoring.stages.STAGES` (listed there), run in order over
an executor, resumable at shard granularity.

Each stage is declared in its own file (`hype.scoring.context.StageSpec`: its settings, the condition under
which it runs, the stages whose outputs it reads, its per-shard work and driver step, its `hype plan` rows
and its summary fields); this module names none of them. It opens the inputs (each stage's `check`),
marks the run running (`begin`), runs the list, and writes the summary from the stages' fields.

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
from collections.abc import Callable
from typing import Any

from hype.executor import make_executor
from hype.io import StorageError, read_json, storage
from hype.io.lock import LockError
from hype.scoring import stages
from hype.scoring.config import ScoreConfig
from hype.scoring.context import RunContext, StageSpec
from hype.scoring.errors import ScoreError, ScoreFailed
from hype.scoring.grow import GrowError, grow_plan
from hype.scoring.rundir import RunDirError, ShardTask, atomic_write_bytes, atomic_write_json, make_tasks

log = logging.getLogger("hype.score")

__all__ = ["ScoreError", "ScoreFailed", "run_score"]


def _abs(path: str | None) -> str | None:
    return None if path is None else storage.absolute(path)


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


def run_score(cfg: ScoreConfig, *, executor=None, progress: bool | None = None) -> dict:
    """Score a pool into `cfg.out`; return the summary (also written to RUN_DIR/summary.json).

    Raises `ScoreError` for unusable inputs and `ScoreFailed` when shards fail after their retries.
    """
    from hype.config import ConfigError

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
    state = RunContext(cfg, executor, progress, stages.STAGES, stages.added_folders(cfg))
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


def _mark_failed(state: RunContext, error: str) -> None:
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


def _score(state: RunContext) -> dict:
    """Check the inputs and plan the shards, then run the stages in order; the summary closes the run."""
    _check_inputs(state)
    _begin(state)
    outputs: dict[str, Any] = {}
    for spec in state.specs:
        outputs[spec.name] = _run_stage(state, spec, outputs)
    return state.summary(state.plan, status="complete", outputs=outputs)


def _run_stage(state: RunContext, spec: StageSpec, outputs: dict[str, Any]) -> Any:
    """One declared stage: its output, or None when the config does not ask for it. It sees the outputs
    of the stages it reads, and nothing else."""
    if not spec.when(state.cfg):
        return None
    return spec.run(state, spec.settings(state.cfg), {name: outputs[name] for name in spec.reads})


def _check_inputs(state: RunContext) -> None:
    """Open every input before anything changes: the pool's shards (`state.tasks`, planned: a complete run
    grows, `hype.scoring.grow`), the models, the frozen parts of a grow and each stage's inputs (its
    `check`). A refusal here leaves the run directory as it was, so a complete run stays complete."""
    cfg, run = state.cfg, state.run
    tasks, state.empty = _plan(cfg, state.warn)
    for role in ("meru", "clip"):
        state.model(role)
    try:
        state.tasks, state.frozen = grow_plan(run, tasks)
        if state.frozen is not None:
            _check_frozen_models(state)
        for spec in _active(state):
            if spec.check is not None:
                spec.check(state)
    except GrowError as e:
        raise ScoreError(str(e)) from None
    if state.frozen is not None:
        log.info("growing %s by %d shard(s) against its frozen reference", run.root, state.frozen.added)


def _active(state: RunContext) -> list[StageSpec]:
    return [spec for spec in state.specs if spec.when(state.cfg)]


def _begin(state: RunContext) -> None:
    """Mark the run running (readers, hype select and report, then refuse it until it is complete again:
    the scores of the last run stay until merge replaces them), record the resolved config, let each
    stage `begin` (a grow's class set checked: work, after the run is marked) and write plan.json."""
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
    try:
        for spec in _active(state):
            if spec.begin is not None:
                spec.begin(state)
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


def _check_frozen_models(state: RunContext) -> None:
    """Refuse a grow whose models differ from the run's frozen ones."""
    from hype.scoring.grow import check_model

    for role in ("meru", "clip"):
        ref = state.model(role)
        check_model(state.frozen, role, getattr(state.cfg, role), ref and ref.digest)
