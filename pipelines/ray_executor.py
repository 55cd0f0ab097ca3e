"""Ray executor: the same per-shard stages, on a pool of Ray actors (a GPU node or a cluster).

Actors are started once per run and reused by every stage; each receives a stage's settings once,
runs its `setup()` (models loaded once per actor and stage), then processes whole shards: it reads
the shard from the shared filesystem, writes the outputs into the run directory itself (atomically,
marker last), and returns only the small stats dict. The driver keeps one shard in flight per actor
and hands out the next as each finishes.

Actors are sized from the stage's declared `resources()` (CPUs and GPUs per actor where it names them,
else this executor's settings; the environment the actor process starts with) and told their CPU budget
through the stage's `prepare_process(cpus)`; a stage that declares other resources gets a fresh pool.
Actors are asked to exit at the end of a run (and before a stage that needs a fresh pool), so that their
exit handlers remove their temporary files (a model downloaded from a bucket); one that does not end in
`STOP_GRACE_S` is killed. Actors run at the driver's scheduling priority, as the local executor's workers
do: Ray's default (niceness 15) let any ordinary process on a node (the driver, another job) take the CPU
from them.

Failures: a shard whose actor dies (killed, out of memory, node lost) is given to a fresh actor; a shard
whose run raises is retried on the same actor; a shard still running `task_timeout` seconds after its
actor had set the stage up (a hung worker, a node that stopped answering) gets its actor killed and is
given to a fresh one; an actor's start and set-up (a model load: a minute under load) are not counted
against a task, but get `SETUP_LIMIT_S` at most. The retry
policy (at most `retries` extra attempts, then the shard is reported as failed, never dropped silently; an
error in `setup()` is fatal: it would fail on every actor), skipping finished shards and the stats are
`hype.executor.Executor`'s.

Requirements: the pool and the run directory on a filesystem every node sees at the same path, and
`hype` installed on every node (e.g. the project's Docker image). `ray_address` joins a running cluster
(`host:port` or `auto`); without it a local Ray instance is started for the run.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from hype.config import at_least, positive
from hype.executor import (
    EXECUTORS,
    Executor,
    ExecutorConfig,
    Job,
    StageSetupError,
    Tally,
    driver_storage_options,
    stage_resources,
    start_stage,
    stop_stage,
)

SETUP_LIMIT_S = 600.0  # a worker that has not set a stage up after this long is hung (with a task timeout)
STOP_GRACE_S = 30.0  # how long actors asked to exit get before they are killed


def _reason(error: BaseException, limit: int = 300) -> str:
    """The first lines of Ray's account of an actor's death (why: killed, out of memory, node lost)."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Worker:
    """A Ray actor that holds one set-up stage at a time; `run` processes one shard.

    Actors outlive a stage: the process start and the imports (seconds each) are paid once per run,
    and each stage is set up (models loaded) once per actor.
    """

    def __init__(self, cpus: float):
        self.cpus = cpus
        self.key: str | None = None
        self.stage = None
        self.error: str | None = None

    def install(self, key: str, stage, storage_options: dict) -> None:
        self.release()
        self.key, self.stage, self.error = key, stage, None
        try:
            # The CPU budget of this actor (not the whole node's), and the driver's storage options.
            start_stage(stage, self.cpus, storage_options)
        except StageSetupError as e:  # reported to the driver on the first `run`
            self.error = str(e)

    def run(self, key: str, task) -> dict:
        if key != self.key:
            raise StageSetupError(f"worker holds stage {self.key}, asked for {key}")
        if self.error is not None:
            raise StageSetupError(self.error)
        return self.stage.run(task)

    def release(self) -> None:
        """Drop the stage's state (models, decode processes, GPU memory) before the next stage."""
        if self.stage is not None:
            stop_stage(self.stage)
        self.stage = None
        import gc
        import sys

        gc.collect()
        # Only where a stage imported torch: importing it here (seconds) was paid by every actor's start
        # (`install` releases first), and a process without torch holds no CUDA cache to empty.
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()


@EXECUTORS.register
class RayExecutor(Executor):
    name = "ray"
    copies_models = True  # each actor fetches a bucket's model itself

    @dataclass(frozen=True)
    class Settings:
        """Ray's keys of the `executor` section (`hype.executor.ExecutorConfig`)."""

        ray_address: str | None = None  # join a cluster: host:port or auto; null starts a local Ray
        cpus_per_worker: float = 0.0  # 0: 1 per actor on CPU clusters; on GPU clusters the CPUs per GPU share
        gpus_per_worker: float = 1.0  # only when device is cuda; fractions share a GPU
        # Seconds one attempt at a shard may take, counted once the actor has set the stage up (models
        # loaded); then its actor (hung, or on a lost node) is killed and the shard counts a failed
        # attempt. 0: no limit.
        task_timeout: float = 3600.0

        def __post_init__(self) -> None:
            at_least(self, 0, "cpus_per_worker", "task_timeout")
            positive(self, "gpus_per_worker")

    @classmethod
    def gpus_per_worker(cls, config: ExecutorConfig) -> float:
        return config.settings().gpus_per_worker

    def __init__(
        self,
        address: str | None = None,
        *,
        workers: int = 0,
        cpus_per_worker: float = 0.0,
        gpus_per_worker: float = 1.0,
        device: str = "auto",
        retries: int = 2,
        task_timeout: float = 0.0,
    ):
        super().__init__(retries)
        self.task_timeout = task_timeout  # seconds per attempt at a task; 0: no limit
        import ray

        self.ray = ray
        self.workers = workers
        self.cpus = cpus_per_worker
        self._started_here = not ray.is_initialized()
        if self._started_here:
            from hype.ray_driver import init_ray

            init_ray(
                address=address,
                include_dashboard=False,
                logging_level=logging.WARNING,
                log_to_driver=True,
            )
        resources = ray.cluster_resources()
        has_gpu = resources.get("GPU", 0) > 0
        wants_gpu = device.startswith("cuda") or (device == "auto" and has_gpu)
        if device.startswith("cuda") and not has_gpu:
            raise RuntimeError(
                f"device {device!r} requested but the Ray cluster at {address or 'local'} has no GPU; "
                "use --device cpu or add GPU nodes"
            )
        self.gpus = gpus_per_worker if wants_gpu else 0.0
        self.resources = resources
        if not cpus_per_worker:
            # Auto: on GPU clusters each actor decodes with its share of the CPUs; on CPU clusters one
            # actor per CPU (torch then runs single-threaded in each).
            share = resources.get("CPU", 1) / resources["GPU"] * self.gpus if self.gpus else 1.0
            self.cpus = max(1.0, math.floor(share))
        self._workers: list = []
        self._spec: tuple | None = None  # (cpus, gpus, env) the actors in `_workers` were started with

    @classmethod
    def from_config(cls, cfg: Any) -> RayExecutor:
        """From a `hype.scoring.config.ScoreConfig`."""
        own = cfg.executor.settings()
        return cls(
            own.ray_address,
            workers=cfg.executor.workers,
            cpus_per_worker=own.cpus_per_worker,
            gpus_per_worker=own.gpus_per_worker,
            device=cfg.device,
            retries=cfg.executor.retries,
            task_timeout=own.task_timeout,
        )

    def worker_device(self, device: str) -> str:
        return device if device != "auto" else "cuda" if self.gpus else "cpu"  # where the actors run

    def close(self) -> None:
        self._stop_workers()
        if self._started_here and self.ray.is_initialized():
            self.ray.shutdown()

    def _stop_workers(self) -> None:
        """End the actors. Asked to exit first, so that their exit handlers run: what a worker downloaded
        into a temporary folder (a model from a bucket: `cached_copy`, gigabytes for an L/14) goes with it,
        where a kill left it on the node's disk after every run. One that has not ended within
        `STOP_GRACE_S` (stuck in a call) is killed."""
        ray = self.ray
        ending = [worker.__ray_terminate__.remote() for worker in self._workers]
        if ending:
            ray.wait(ending, num_returns=len(ending), timeout=STOP_GRACE_S)
        for worker in self._workers:
            ray.kill(worker, no_restart=True)  # nothing to do for one that has ended
        self._workers = []

    def _spec_of(self, stage) -> tuple[float, float, tuple]:
        """(cpus, gpus, env) of one actor for `stage`: what it declares, else this executor's settings."""
        need = stage_resources(stage)
        gpus = self.gpus if need.gpus is None else need.gpus
        if gpus and not self.resources.get("GPU", 0):
            raise StageSetupError(f"{stage.name} needs {gpus} GPU per worker; the Ray cluster has none")
        return (need.cpus or self.cpus, gpus, tuple(sorted(need.env.items())))

    def capacity(self, spec: tuple | None = None) -> int:
        """How many actors of `spec` (default: this executor's settings) the cluster fits."""
        cpus, gpus = (self.cpus, self.gpus) if spec is None else spec[:2]
        fit = math.floor(self.resources.get("CPU", 1) / cpus + 1e-9)
        if gpus:
            fit = min(fit, math.floor(self.resources.get("GPU", 0) / gpus + 1e-9))
        return max(1, fit)

    def _new_worker(self):
        cpus, gpus, env = self._spec
        cls = self.ray.remote(
            num_cpus=cpus,
            num_gpus=gpus,
            max_restarts=0,
            max_task_retries=0,
            # Set before the actor process imports torch; Ray reads the niceness when the process starts.
            runtime_env={"env_vars": {**dict(env), "RAY_worker_niceness": str(max(0, os.nice(0)))}},
        )(_Worker)
        return cls.remote(cpus)

    def _deadline(self, worker, started: float, setups: dict, ready_at: dict) -> float:
        """When a task submitted at `started` to `worker` runs out of time. The clock starts once the
        worker has set up the stage: an actor's start and a model load (a minute under load, more for a
        large model) are not the task's; they get `SETUP_LIMIT_S` (or the task timeout if longer)."""
        if worker in ready_at:
            return max(started, ready_at[worker]) + self.task_timeout
        return setups[worker] + max(SETUP_LIMIT_S, self.task_timeout)

    def _execute(self, stage, tally: Tally) -> None:
        ray = self.ray
        spec = self._spec_of(stage)
        if spec != self._spec:
            self._stop_workers()
            self._spec = spec
        want = min(len(tally), self.workers or self.capacity(spec))
        while len(self._workers) < want:
            self._workers.append(self._new_worker())
        key = uuid.uuid4().hex
        stage_ref = ray.put(stage)
        options = driver_storage_options()  # credentials go as an argument, never in a runtime_env
        inflight: dict[Any, tuple[Any, Job, float]] = {}  # ref -> (worker, job, when it was submitted)
        installing: dict[Any, Any] = {}  # ref of a worker's set-up call -> the worker
        setups: dict[Any, float] = {}  # worker -> when its set-up was submitted
        ready_at: dict[Any, float] = {}  # worker -> when its set-up finished
        idle: list = []

        def install(worker) -> None:
            installing[worker.install.remote(key, stage_ref, options)] = worker  # calls run in order
            setups[worker] = time.monotonic()
            idle.append(worker)

        def replace(worker) -> None:
            ray.kill(worker, no_restart=True)
            # Wait until Ray has seen it die (a call on it then raises) before starting its replacement: a
            # replacement started at once was seen to die with it on a loaded machine.
            try:
                ray.get(worker.release.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - RayActorError once dead, GetTimeoutError if it never says
                pass
            fresh = self._new_worker()
            self._workers[self._workers.index(worker)] = fresh
            install(fresh)

        for worker in self._workers[:want]:
            install(worker)
        try:
            while tally or inflight:
                while tally and idle:
                    worker, job = idle.pop(), tally.next()
                    inflight[worker.run.remote(key, job.task)] = (worker, job, time.monotonic())
                deadlines = {r: self._deadline(w, t, setups, ready_at) for r, (w, _, t) in inflight.items()}
                wait_s = None
                if self.task_timeout and deadlines:
                    wait_s = max(0.0, min(deadlines.values()) - time.monotonic())
                ready, _ = ray.wait([*installing, *inflight], num_returns=1, timeout=wait_s)
                if ready and ready[0] in installing:  # a worker is set up: its task's clock starts now
                    ready_at[installing.pop(ready[0])] = time.monotonic()
                    continue
                if not ready:  # a task ran out of time: its worker is hung or unreachable
                    now = time.monotonic()
                    for ref in [ref for ref, deadline in deadlines.items() if deadline <= now]:
                        worker, job, _ = inflight.pop(ref)
                        for r in [r for r, w in installing.items() if w == worker]:
                            del installing[r]
                        replace(worker)
                        tally.failed(job, f"timed out after {self.task_timeout:g} s (worker killed)")
                    continue
                worker, job, _ = inflight.pop(ready[0])
                try:
                    stats = ray.get(ready[0])
                except ray.exceptions.RayActorError as e:
                    # The worker died while holding this shard: replace it, give the shard again.
                    replace(worker)
                    tally.failed(job, f"worker died ({type(e).__name__}: {_reason(e)})")
                    continue
                except ray.exceptions.RayTaskError as e:
                    idle.append(worker)
                    cause = e.cause if e.cause is not None else e
                    if isinstance(cause, StageSetupError):
                        cause = StageSetupError(f"{cause} (on a Ray worker)")
                    tally.failed(job, cause)
                    continue
                idle.append(worker)
                tally.done(job, stats)
        finally:
            for worker in self._workers:
                worker.release.remote()
