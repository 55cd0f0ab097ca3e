"""What a stage of `hype score` is and what its driver step may use: the stage declaration (`StageSpec`)
and the run context (`RunContext`).

Below the stage files (`stage_*.py`, `card.py`), which import it, and below the runner and the plan,
which walk the stages (`hype.scoring.stages.STAGES`), so moving a driver step into its stage's file makes
no import loop. The context is narrow on purpose: the config, the run directory, the pool's shards, a map
of a per-shard stage over the executor, a timer, warnings, the models given, the summary; a driver step
reaches nothing else of the runner.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hype.executor import MapResult, Progress, StageSetupError
from hype.io import storage
from hype.scoring.config import ScoreConfig
from hype.scoring.errors import ScoreError, ScoreFailed
from hype.scoring.rundir import RunDir, ShardTask, atomic_write_json
from hype.scoring.summary import build_summary

log = logging.getLogger("hype.score")


@dataclass(frozen=True)
class SummaryView:
    """What a stage's summary fields are made from: the run's outputs so far (empty in a failed run's
    summary: its fields then take their defaults) and this invocation's stage metrics."""

    cfg: ScoreConfig
    run: RunDir
    plan: dict
    stages: dict  # summary.json's `stages`: seconds, shards run and reused, samples per stage
    seconds: float  # the invocation's wall time so far
    outputs: dict[str, Any]  # stage name -> its output (a finished run's only)


def _always(cfg: ScoreConfig) -> bool:
    return True


def _no_settings(cfg: ScoreConfig) -> None:
    return None


@dataclass(frozen=True)
class StageSpec:
    """One stage of `hype score`, declared in its own file and listed once in `hype.scoring.stages`.

    `run(ctx, settings, outputs)` gets the stage's typed settings (`settings(cfg)`) and the outputs of the
    stages it `reads` (each earlier in the list; None for one the config left out), and returns its own
    output. `per_shard`: it maps a stage over the shards on the executor; `driver`: it has a step in this
    process (streaming every shard's outputs with bounded memory, or reading a given file).
    The hooks, each optional: `check(ctx)` opens the stage's inputs before the run changes anything (a
    refusal leaves the run as it was); `begin(ctx)` works once the run is marked running, before its plan
    is recorded; `plan(est)` adds the stage's rows (seconds, bytes, bucket requests) to `hype plan`'s
    estimate (`hype.scoring.plan._Estimate`), from the probe's shard markers and the driver `markers` it
    names; `calibrate(cal)` times apart what the probe is too small to time (`hype.scoring.plan.Calibration`);
    `summary(view)` gives the stage's fields of summary.json (nested dicts merge into the run's), with its
    defaults when its output is not in `view.outputs`."""

    name: str  # its folder in RUN_DIR and its entry in summary.json's `stages`
    run: Callable[[RunContext, Any, dict[str, Any]], Any]
    settings: Callable[[ScoreConfig], Any] = _no_settings
    reads: tuple[str, ...] = ()
    per_shard: bool = True
    driver: bool = False
    when: Callable[[ScoreConfig], bool] = _always  # the config asks for it (an option given, a switch on)
    check: Callable[[RunContext], None] | None = None
    begin: Callable[[RunContext], None] | None = None
    plan: Callable[[Any], None] | None = None
    summary: Callable[[SummaryView], dict] | None = None
    markers: tuple[tuple[str, str], ...] = ()  # (name, path in RUN_DIR) of driver markers its rows read
    calibrate: Callable[[Any], None] | None = None


class RunContext:
    """State of one `hype score` invocation, as its stages see it."""

    def __init__(
        self,
        cfg: ScoreConfig,
        executor,
        progress: bool,
        stages: tuple[StageSpec, ...],
        folders: tuple[str, ...] = (),
    ):
        self.cfg = cfg
        self.run = RunDir(storage.absolute(cfg.out), folders)  # and the registered stages' folders
        self.executor = executor
        self.progress = progress
        self.specs = stages  # the run's stages, in order (their summary fields)
        self.warnings: list[str] = []
        self.stages: dict[str, dict] = {}
        self.failures: list[dict] = []
        self.started = time.perf_counter()
        self.plan: dict = {"pool": cfg.pool, "shards": 0}
        self.tasks: list[ShardTask] = []  # the pool's shards (`runner._check_inputs`)
        self.metadata: dict | None = None  # what --metadata supplies (`stage_embed`)
        self.frozen = None  # a run that grows keeps these (`hype.scoring.grow.Frozen`)
        self.empty: list[str] = []  # 0-byte shards of the pool (`runner._check_inputs`)
        self.begun = False  # the run is marked running (`runner._begin`): from then on a stop marks it failed
        self._models: dict[str, Any] = {}

    def model(self, role: str):
        """The --meru / --clip model with its digest (`hype.scoring.embed.ModelRef`; digested once per
        invocation)."""
        if role not in self._models:
            from hype.scoring.embed import model_ref

            self._models[role] = model_ref(getattr(self.cfg, role), role)
        return self._models[role]

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)
            log.warning("%s", message)

    def stage_kwargs(self) -> dict:
        # `auto` resolved once, as the workers will: the embed fingerprint holds the device's numerics.
        resolve = getattr(self.executor, "worker_device", None)
        device = resolve(self.cfg.device) if resolve is not None else self.cfg.device
        return {"device": device, "threads": self.cfg.threads, "debug": self.cfg.debug}

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

    def timed(self, name: str, fn: Callable[[], Any]) -> Any:
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

    def summary(
        self,
        plan: dict,
        status: str,
        *,
        outputs: dict[str, Any] | None = None,
        fields: dict | None = None,
        error: str | None = None,
    ) -> dict:
        """Write RUN_DIR/summary.json: the run's own fields, then each stage's (from `outputs`, its
        defaults without them), then `fields` (a stage that stops the run says what it saw)."""
        seconds = time.perf_counter() - self.started
        view = SummaryView(self.cfg, self.run, plan, self.stages, seconds, outputs or {})
        parts = [spec.summary(view) for spec in self.specs if spec.summary is not None]
        s = build_summary(
            self.cfg,
            self.run,
            plan,
            status=status,
            stages=self.stages,
            warnings=self.warnings,
            failures=self.failures,
            seconds=seconds,
            executor=self.executor.name,
            metadata=self.metadata,
            error=error,
            fields=[*parts, fields or {}],
        )
        atomic_write_json(self.run.summary, s)
        return s
