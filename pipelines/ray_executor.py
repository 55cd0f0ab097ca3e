"""Ray executor: the same per-shard stages, on a pool of Ray actors (a GPU node or a cluster).

Actors are started once per run and reused by every stage; each receives a stage's settings once,
runs its `setup()` (models loaded once per actor and stage), then processes whole shards: it reads
the shard from the shared filesystem, writes the outputs into the run directory itself (atomically,
marker last), and returns only the small stats dict. The driver keeps one shard in flight per actor
and hands out the next as each finishes.

Failures: a shard whose actor dies (killed, out of memory, node lost) is given to a fresh actor; a shard
whose run raises is retried on the same actor. Either way at most `retries` extra attempts, then the
shard is reported as failed (never dropped silently). An error in `setup()` (bad checkpoint, missing
file) is fatal: it would fail on every actor.

Requirements: the pool and the run directory on a filesystem every node sees at the same path, and
`hype` installed on every node (e.g. the project's Docker image). `ray_address` joins a running cluster
(`host:port` or `auto`); without it a local Ray instance is started for the run.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections import deque
from collections.abc import Callable

from hype.scoring.stagebase import StageSetupError

log = logging.getLogger(__name__)


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

    def install(self, key: str, stage) -> None:
        self.release()
        self.key, self.stage, self.error = key, stage, None
        if not getattr(stage, "threads", 0):
            # The CPU budget of this actor (torch threads, decode workers), not the whole node's.
            stage.threads = max(1, int(self.cpus))
        try:
            stage.setup()
        except Exception as e:  # noqa: BLE001 - reported to the driver on the first `run`
            self.error = f"{type(e).__name__}: {e}"

    def run(self, key: str, task) -> dict:
        if key != self.key:
            raise StageSetupError(f"worker holds stage {self.key}, asked for {key}")
        if self.error is not None:
            raise StageSetupError(self.error)
        return self.stage.run(task)

    def release(self) -> None:
        """Drop the stage's state (models, decode processes, GPU memory) before the next stage."""
        teardown = getattr(self.stage, "teardown", None)
        if teardown is not None:
            teardown()
        self.stage = None
        import gc

        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass


class RayExecutor:
    name = "ray"

    def __init__(
        self,
        address: str | None = None,
        *,
        workers: int = 0,
        cpus_per_worker: float = 0.0,
        gpus_per_worker: float = 1.0,
        device: str = "auto",
        retries: int = 2,
    ):
        import ray

        self.ray = ray
        self.workers = workers
        self.cpus = cpus_per_worker
        self.retries = retries
        self._started_here = not ray.is_initialized()
        if self._started_here:
            ray.init(
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

    def __enter__(self) -> RayExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for worker in self._workers:
            self.ray.kill(worker, no_restart=True)
        self._workers = []
        if self._started_here and self.ray.is_initialized():
            self.ray.shutdown()

    def capacity(self) -> int:
        """How many actors the cluster fits."""
        fit = math.floor(self.resources.get("CPU", 1) / self.cpus + 1e-9)
        if self.gpus:
            fit = min(fit, math.floor(self.resources.get("GPU", 0) / self.gpus + 1e-9))
        return max(1, fit)

    def _new_worker(self):
        ray = self.ray
        from hype.scoring.decode import share_cores_with_decoders

        env = {"env_vars": share_cores_with_decoders()}  # the actor's torch shares cores with its decoders
        cls = ray.remote(
            num_cpus=self.cpus, num_gpus=self.gpus, max_restarts=0, max_task_retries=0, runtime_env=env
        )(_Worker)
        return cls.remote(self.cpus)

    def map(self, stage, tasks: list, on_result: Callable[[object, dict], None]) -> list[dict]:
        if not tasks:
            return []
        ray = self.ray
        want = min(len(tasks), self.workers or self.capacity())
        while len(self._workers) < want:
            self._workers.append(self._new_worker())
        key = uuid.uuid4().hex
        stage_ref = ray.put(stage)
        idle = list(self._workers[:want])
        for worker in idle:
            worker.install.remote(key, stage_ref)  # actor calls run in submission order
        queue = deque(tasks)
        attempts: dict[str, int] = {}
        inflight: dict = {}
        failures: list[dict] = []

        def submit(worker) -> None:
            task = queue.popleft()
            attempts[task.shard_id] = attempts.get(task.shard_id, 0) + 1
            inflight[worker.run.remote(key, task)] = (worker, task)

        def retry_or_fail(task, error: str) -> None:
            n = attempts[task.shard_id]
            log.warning("%s: %s attempt %d failed: %s", task.path, stage.name, n, error)
            if n > self.retries:
                failures.append(
                    {"shard": task.path, "shard_id": task.shard_id, "attempts": n, "error": error}
                )
            else:
                queue.appendleft(task)

        while queue or inflight:
            while queue and idle:
                submit(idle.pop())
            ready, _ = ray.wait(list(inflight), num_returns=1)
            worker, task = inflight.pop(ready[0])
            try:
                stats = ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                # The worker died while holding this shard: replace it, give the shard again.
                ray.kill(worker, no_restart=True)
                fresh = self._new_worker()
                self._workers[self._workers.index(worker)] = fresh
                fresh.install.remote(key, stage_ref)
                idle.append(fresh)
                retry_or_fail(task, f"worker died ({type(e).__name__})")
                continue
            except ray.exceptions.RayTaskError as e:
                if isinstance(e.cause, StageSetupError):
                    raise StageSetupError(f"{stage.name} setup failed on a Ray worker: {e.cause}") from None
                idle.append(worker)
                cause = e.cause if e.cause is not None else e
                retry_or_fail(task, f"{type(cause).__name__}: {cause}")
                continue
            idle.append(worker)
            on_result(task, dict(stats, attempts=attempts[task.shard_id]))
        for worker in self._workers:
            worker.release.remote()
        return failures
