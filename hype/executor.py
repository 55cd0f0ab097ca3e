"""Executors: run a stage over a list of tasks, wherever the work goes (in the style of datatrove's executor
base and img2dataset's distributor).

A stage is a small picklable object (`Stage` gives the defaults). On the driver, `done(task)` returns the
stats of a task whose output is already complete (its completion marker) or None, and `resources()`
declares what one worker of the stage needs. In a worker, `prepare_process(cpus)` adapts the stage to
the worker's share of the machine, `setup()` loads its heavy state once, `run(task)` writes one task's
outputs (completion marker last) and returns its small stats, `teardown()` releases the state.

`Executor.map` is the one implementation of everything but placement: it skips completed tasks, hands
the others to the subclass's `_execute` through a `Tally`, which numbers attempts, retries a failed task
at most `retries` times (never a `StageSetupError`: it would fail on every worker), reports each result
to the caller's callback and progress bar, and collects the per-task stats and the failures into a
`MapResult`. Subclasses only decide where `run` is called: `PoolExecutor` in this process or a pool of
local processes (`hype reshard`, `hype synth`, and `hype.pipelines.local`), `hype.pipelines.ray_executor`
on a Ray cluster. Executors selectable by name (`hype score --executor NAME`, `hype reshard --executor NAME`)
register in `EXECUTORS`; `make_executor` builds the one a config's `executor` section names.

Storage options (credentials for s3:// and the like, `hype.io.storage`) travel to every worker as an
argument of its set-up (`start_stage`), never through the environment or a Ray runtime_env, which are
logged and shown in dashboards.

This module sits below the stages: it imports nothing of `hype` but the plug-in registry, `hype.config`
(the `executor` section's schema) and `hype.io`.
"""

from __future__ import annotations

import copy
import logging
import multiprocessing
import os
import pickle
import resource
import sys
import time
import traceback
import typing
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, fields
from typing import Any

from hype.config import ConfigError, at_least, build, one_of, to_dict
from hype.io import storage
from hype.plugins import Registry

log = logging.getLogger(__name__)

# Executors that `--executor NAME` finds by name; `pipelines/` registers the bundled ones.
EXECUTORS: Registry[type] = Registry("executors")


@dataclass(frozen=True)
class ExecutorConfig:
    """The `executor` section of a config (`hype score`'s; `hype reshard` builds one from its options).

    The core keeps what every executor means; an executor plug-in declares its own settings as a frozen
    dataclass `Settings` (`hype.pipelines.ray_executor.RayExecutor.Settings`: ray_address, ...), written as
    flat keys of this section. A key no installed executor declares is an error naming the valid ones; keys
    of another executor than `kind` are kept (a preset names Ray's beside `kind: local`, for `--executor
    ray`) and `settings()` builds the chosen plug-in's from its own keys, validated by its dataclass."""

    kind: str = "local"  # --executor: a name in EXECUTORS (local | ray bundled)
    workers: int = (
        0  # concurrent workers per stage (Ray: actors; 0: as many as the cluster's resources allow)
    )
    retries: int = 2  # extra attempts for a shard whose worker died or raised
    options: dict[str, Any] = field(default_factory=dict)  # the plug-ins' own keys
    # The keys in the order written, so that config.yaml records a section as it was read.
    given: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        one_of(self, "kind", tuple(sorted(EXECUTORS.names())))  # the registry's
        at_least(self, 0, "workers", "retries")
        valid = self.section_keys()
        if unknown := [k for k in self.options if k not in valid or k in _CORE]:
            raise ConfigError(", ".join(unknown), f"unknown key; valid keys in executor: {', '.join(valid)}")
        typed = dict(self.options)
        for _, cls in EXECUTORS.items():  # every plug-in's keys valid, whichever executor runs
            built = to_dict(build(_settings_class(cls), self._own(cls)))
            typed |= {k: built[k] for k in self._own(cls)}  # as its dataclass typed them (0 -> 0.0)
        object.__setattr__(self, "options", typed)

    @classmethod
    def section_keys(cls) -> dict[str, Any]:
        """The section's flat keys and their types (`hype.config`'s hook): the core's, every plug-in's."""
        hints = {k: v for k, v in typing.get_type_hints(cls).items() if k in _CORE}
        for _, plugin in EXECUTORS.items():
            hints |= typing.get_type_hints(_settings_class(plugin))
        return hints

    @classmethod
    def build_section(cls, data: dict) -> dict:
        """`hype.config.build`'s hook: the flat keys that are not the core's go into `options`."""
        return {k: v for k, v in data.items() if k in _CORE} | {
            "options": {k: v for k, v in data.items() if k not in _CORE},
            "given": tuple(data),
        }

    def plugin(self) -> type:
        return EXECUTORS.get(self.kind)

    def settings(self) -> Any:
        """The chosen executor's own settings: its `Settings` dataclass from its keys (defaults elsewhere)."""
        return build(_settings_class(self.plugin()), self._own(self.plugin()))

    def foreign(self) -> list[str]:
        """The keys set here that the chosen executor does not read (another plug-in's)."""
        return [k for k in self.options if k not in _keys(self.plugin())]

    def to_dict(self) -> dict[str, Any]:
        """Flat, in the order written: the keys given, the core's and the chosen plug-in's (at their defaults
        where not given; another plug-in's only where given, so that a config reads without it)."""
        out = {k: getattr(self, k) for k in _CORE} | to_dict(self.settings()) | self.options
        return {k: out[k] for k in dict.fromkeys([*self.given, *out]) if k in out}

    def _own(self, cls: type) -> dict[str, Any]:
        return {k: v for k, v in self.options.items() if k in _keys(cls)}


_CORE = ("kind", "workers", "retries")  # what every executor means


@dataclass(frozen=True)
class NoSettings:
    """An executor plug-in with no settings of its own."""


def _settings_class(cls: type) -> type:
    return getattr(cls, "Settings", NoSettings)


def _keys(cls: type) -> list[str]:
    return [f.name for f in fields(_settings_class(cls))]


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or a job's share, not the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def available_memory() -> int | None:
    """Bytes this process can still allocate, or None when nothing says: the least of the machine's
    available memory (`MemAvailable`), what its cgroup's limit leaves and what its address-space limit
    (RLIMIT_AS) leaves. For checks made before a large allocation, so that it is refused with the fix
    instead of ending in a MemoryError or the kernel's OOM killer."""
    left = [_meminfo("MemAvailable", "/proc/meminfo"), _cgroup_left()]
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY and (size := _meminfo("VmSize", "/proc/self/status")) is not None:
        left.append(soft - size)
    known = [n for n in left if n is not None]
    return max(0, min(known)) if known else None


def _meminfo(key: str, path: str) -> int | None:
    try:
        with open(path) as f:
            line = next((x for x in f if x.startswith(key + ":")), None)
        return int(line.split()[1]) * 1024 if line else None
    except (OSError, ValueError, IndexError):
        return None


def _cgroup_left() -> int | None:
    """What the memory limit of this process's cgroup (v2, else v1) leaves, or None without one."""
    try:
        with open("/proc/self/cgroup") as f:
            groups = dict(line.rstrip("\n").split(":", 2)[1:] for line in f)
    except (OSError, ValueError):
        return None
    v1 = ("memory", "/memory", "memory.limit_in_bytes", "memory.usage_in_bytes")
    for controller, root, limit, usage in (("", "", "memory.max", "memory.current"), v1):
        if controller not in groups:
            continue
        try:
            folder = "/sys/fs/cgroup" + root + groups[controller]
            with open(f"{folder}/{limit}") as a, open(f"{folder}/{usage}") as b:
                cap, used = a.read().strip(), int(b.read())
        except (OSError, ValueError):
            continue
        if cap.isdigit() and int(cap) < 2**60:  # v1 writes "no limit" as a huge number, v2 as "max"
            return int(cap) - used
    return None


def make_executor(cfg: Any) -> Executor:
    """The executor plug-in named by `cfg.executor.kind`, built by its `from_config(cfg)`; `cfg` is a
    config with an `executor` section (`ExecutorConfig`) and a `device` (a `ScoreConfig`, ...)."""
    cls = EXECUTORS.get(cfg.executor.kind)
    if cls is None:
        raise ValueError(
            f"no executor named {cfg.executor.kind!r} is installed (found: {', '.join(EXECUTORS.names())}); "
            "install hype with its bundled pipelines package"
        )
    return cls.from_config(cfg)


class StageSetupError(RuntimeError):
    """A stage could not be set up in a worker (bad checkpoint, missing file, no GPU); retrying the task
    on another worker would not help, so executors raise this instead of retrying."""


@dataclass(frozen=True)
class Resources:
    """What one worker of a stage needs; an executor sizes and starts its workers from this alone."""

    cpus: float = 0.0  # CPU cores per worker; 0: the executor's share (its settings, the machine)
    gpus: float | None = None  # GPUs per worker (fractions share one); None: the executor's setting
    # Environment a worker process needs before it loads the stage (OpenMP reads it once, at start).
    env: Mapping[str, str] = field(default_factory=dict)


class Stage:
    """Defaults of the stage interface; a stage overrides `run` and what else it needs."""

    name = "stage"

    # --- driver side ------------------------------------------------------------------------------

    def resources(self) -> Resources:
        return Resources()

    def done(self, task: Any) -> Any | None:
        """The stats of `task`'s complete output (from its marker), or None when it must run."""
        return None

    def done_all(self, tasks: list) -> list:
        """`done` of every task (a stage overrides it to answer from one listing)."""
        done = _hook(self, "done")  # a stage need not subclass Stage
        return [done(t) for t in tasks]

    def label(self, task: Any) -> str:
        """How logs and failures name `task`."""
        return str(task)

    # --- worker side ------------------------------------------------------------------------------

    def prepare_process(self, cpus: float | None) -> None:
        """Called in each worker before `setup`, with the CPU cores the worker holds (None: all of
        this machine's, shared with the driver)."""

    def setup(self) -> None:
        """Per-worker initialisation (models, references): once per worker, before the first task."""

    def run(self, task: Any) -> Any:
        raise NotImplementedError

    def teardown(self) -> None:
        """Per-worker clean-up after the last task."""


def _hook(stage: object, name: str) -> Callable:
    # Stages need not subclass `Stage` (a test's stub, a third-party stage): missing hooks take the defaults.
    return getattr(stage, name, None) or getattr(Stage, name).__get__(stage)


def stage_resources(stage: object) -> Resources:
    return _hook(stage, "resources")()


def driver_storage_options() -> dict[str, Any]:
    """The storage options an executor hands to its workers' `start_stage` (the driver's, in memory)."""
    return storage.snapshot()


def start_stage(stage: object, cpus: float | None, storage_options: Mapping[str, Any] | None = None) -> None:
    """Worker side: prepare the process for `stage` and set it up; any error is a `StageSetupError`.
    `storage_options`: the driver's (`hype.io.storage.snapshot()`), for a worker in another process."""
    if storage_options is not None:
        storage.configure(storage_options)
    try:
        _hook(stage, "prepare_process")(cpus)
        _hook(stage, "setup")()  # a stage need not subclass Stage
    except Exception as e:  # noqa: BLE001 - every task would fail the same way
        name = getattr(stage, "name", type(stage).__name__)
        raise StageSetupError(f"{name} setup failed: {type(e).__name__}: {e}") from e


def stop_stage(stage: object) -> None:
    _hook(stage, "teardown")()


# --- the driver's book-keeping -----------------------------------------------------------------------


@dataclass
class Job:
    """One task on its way through an executor."""

    index: int  # position in the task list given to `map`
    task: Any
    attempts: int = 0


@dataclass
class Failure:
    """A task that still failed after its retries."""

    task: Any
    attempts: int
    error: str  # "<ExceptionType>: message"
    exception: BaseException | None = field(default=None, repr=False, compare=False)


@dataclass
class MapResult:
    results: list  # per task, in task order: its stats (reused or new), None where it failed
    failures: list[Failure]
    ran: int  # tasks run to success by this map
    reused: int  # tasks skipped because their output was already complete
    retries: int  # attempts that failed and were given another go
    seconds: float

    def raise_first_failure(self) -> None:
        """Raise the first failed task's own exception (or a RuntimeError naming it)."""
        if self.failures:
            f = self.failures[0]
            if f.exception is not None:
                raise f.exception
            raise RuntimeError(f"{f.task}: {f.error} (after {f.attempts} attempts)")


class Progress:
    """A tqdm bar over the tasks a map runs; `postfix()` adds a live figure. With `lazy`, the bar is
    created at the first result, so that a forking pool forks before the bar's monitor thread exists."""

    def __init__(
        self,
        desc: str,
        *,
        enabled: bool = True,
        unit: str = "shard",
        leave: bool = True,
        lazy: bool = False,
        postfix: Callable[[], str] | None = None,
    ):
        self.desc, self.enabled, self.unit, self.leave, self.postfix = desc, enabled, unit, leave, postfix
        self.lazy = lazy
        self.total = 0
        self.bar = None

    def start(self, total: int) -> None:
        self.total = total
        if not self.lazy:
            self._open()

    def _open(self) -> None:
        if self.bar is None and self.enabled and self.total:
            from tqdm import tqdm

            self.bar = tqdm(
                total=self.total,
                desc=self.desc,
                unit=self.unit,
                leave=self.leave,
                file=sys.stderr,
                dynamic_ncols=True,
            )

    def update(self) -> None:
        self._open()
        if self.bar is None:
            return
        if self.postfix is not None:
            self.bar.set_postfix_str(self.postfix(), refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class Tally:
    """The tasks of one map still to run, their attempts, results and failures: the one retry policy.

    Executors take jobs with `next()` and report each attempt with `done` or `failed`; a failed job goes
    back to the front of the queue until it has had `retries` extra attempts, then it is a `Failure`.
    With `fail_fast`, the first `Failure` empties the queue (`stopped`): nothing new is started.
    """

    def __init__(
        self,
        stage: object,
        tasks: list,
        retries: int,
        on_result: Callable[[Any, Any], None] | None = None,
        progress: Progress | None = None,
        fail_fast: bool = False,
    ):
        self.stage, self.retries, self.fail_fast = stage, retries, fail_fast
        self.name = getattr(stage, "name", type(stage).__name__)
        self.on_result, self.progress = on_result, progress
        self.queue = deque(Job(i, t) for i, t in enumerate(tasks))
        self.results: dict[int, Any] = {}
        self.failures: list[Failure] = []
        self.retried = 0
        self.stopped = False

    def __len__(self) -> int:
        return len(self.queue)

    def next(self) -> Job:
        job = self.queue.popleft()
        job.attempts += 1
        return job

    def done(self, job: Job, result: Any) -> None:
        if isinstance(result, dict):
            result = dict(result, attempts=job.attempts)
        self.results[job.index] = result
        if self.on_result is not None:
            self.on_result(job.task, result)
        if self.progress is not None:
            self.progress.update()

    def failed(self, job: Job, error: BaseException | str) -> None:
        """Record a failed attempt: retry it, or give up on the task. A `StageSetupError` is raised."""
        if isinstance(error, StageSetupError):
            raise error
        message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        label = _hook(self.stage, "label")(job.task)
        log.warning("%s: %s failed (attempt %d): %s", label, self.name, job.attempts, message)
        if isinstance(error, BaseException):
            log.debug("%s", "".join(traceback.format_exception(error)))
        if job.attempts <= self.retries:
            self.retried += 1
            self.queue.appendleft(job)
            return
        exception = error if isinstance(error, BaseException) else None
        self.failures.append(Failure(job.task, job.attempts, message, exception))
        if self.fail_fast:
            self.queue.clear()
            self.stopped = True


# --- executors -----------------------------------------------------------------------------------


class Executor:
    """Runs a stage's tasks; subclasses implement `_execute` (where `run` is called) and nothing else."""

    name = "executor"
    # What `hype plan` and the commands ask a plug-in instead of its name (class attributes):
    in_process = False  # runs in the driver's process: no start-up time, the driver's copies of models
    copies_models = False  # each worker fetches a bucket's model itself (one LIST + GET per worker)

    @classmethod
    def gpus_per_worker(cls, config: ExecutorConfig) -> float:
        """GPUs one worker holds on a cuda device, given the `executor` section."""
        return 1.0

    def __init__(self, retries: int = 2, *, fail_fast: bool = False):
        self.retries = retries
        self.fail_fast = fail_fast

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release the workers (processes, actors) kept between maps."""

    def worker_device(self, device: str) -> str:
        """The device `device` names on this executor's workers: `auto` resolved as they would resolve
        it (here: this machine's), so that the driver's fingerprints agree with theirs."""
        if device != "auto":
            return device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def map(
        self,
        stage: object,
        tasks: list,
        on_result: Callable[[Any, Any], None] | None = None,
        *,
        progress: Progress | None = None,
    ) -> MapResult:
        """Run `stage` on every task whose output is not complete; call `on_result(task, stats)` as each
        finishes. Failures after retries are returned, not raised; a `StageSetupError` is raised."""
        started = time.perf_counter()
        results: list = list(_hook(stage, "done_all")(tasks))
        todo = [t for t, r in zip(tasks, results, strict=True) if r is None]
        tally = Tally(stage, todo, self.retries, on_result, progress, self.fail_fast)
        if progress is not None:
            progress.start(len(todo))
        try:
            if todo:
                self._execute(stage, tally)
        finally:
            if progress is not None:
                progress.close()
        fresh = iter(tally.results.get(i) for i in range(len(todo)))
        merged = [next(fresh) if r is None else r for r in results]
        return MapResult(
            results=merged,
            failures=tally.failures,
            ran=len(tally.results),
            reused=len(tasks) - len(todo),
            retries=tally.retried,
            seconds=time.perf_counter() - started,
        )

    def _execute(self, stage: object, tally: Tally) -> None:
        raise NotImplementedError


class PoolExecutor(Executor):
    """Runs tasks in this process (`workers=1`, or a single task) or in a pool of `workers` local
    processes; a worker that dies (killed, out of memory) costs its tasks an attempt, and a fresh pool
    takes over. `start_method` is multiprocessing's (default: the platform's)."""

    name = "pool"

    def __init__(
        self, workers: int = 1, *, retries: int = 2, fail_fast: bool = False, start_method: str | None = None
    ):
        super().__init__(retries, fail_fast=fail_fast)
        self.workers = max(1, int(workers))
        self.start_method = start_method

    def _execute(self, stage: object, tally: Tally) -> None:
        if self.workers == 1 or len(tally) == 1:
            self._here(stage, tally)
            return
        while tally and not tally.stopped:
            self._pool_round(stage, tally)

    def _here(self, stage: object, tally: Tally) -> None:
        # A copy through the object's own reduce protocol, as a process pool or Ray ships it: the state
        # `setup()` builds stays off the driver's `stage`.
        worker = copy.deepcopy(stage)
        start_stage(worker, None)
        try:
            while tally:
                job = tally.next()
                try:
                    result = worker.run(job.task)
                except Exception as e:  # noqa: BLE001 - one task's failure must not stop the others
                    tally.failed(job, e)
                    continue
                tally.done(job, result)
        finally:
            stop_stage(worker)

    def _pool_round(self, stage: object, tally: Tally) -> None:
        """Run the queued jobs on one process pool, until they are done or a worker dies."""
        n = min(self.workers, len(tally))
        cpus = max(1.0, (os.cpu_count() or 1) / n)
        env = dict(stage_resources(stage).env)
        context = multiprocessing.get_context(self.start_method) if self.start_method else None
        # The stage travels pickled and is loaded after the worker has set `env`.
        pool = ProcessPoolExecutor(
            n,
            mp_context=context,
            initializer=_install,
            initargs=(pickle.dumps(stage), cpus, env, driver_storage_options()),
        )
        try:
            inflight: dict[Future, Job] = {}
            while (tally or inflight) and not tally.stopped:
                while tally:
                    job = tally.next()
                    inflight[pool.submit(_run_installed, job.task)] = job
                finished, _ = wait(inflight, return_when=FIRST_COMPLETED)
                for future in finished:
                    job = inflight.pop(future)
                    try:
                        result = future.result()
                    except BrokenProcessPool:
                        # A worker died: the jobs in flight lost their worker; a fresh pool takes them.
                        self._salvage(tally, {future: job, **inflight})
                        return
                    except Exception as e:  # noqa: BLE001 - one task's failure must not stop the others
                        tally.failed(job, e)
                        continue
                    tally.done(job, result)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    @staticmethod
    def _salvage(tally: Tally, inflight: dict[Future, Job]) -> None:
        """After a broken pool: keep what finished, count an attempt against every other job."""
        for future, job in inflight.items():
            if future.done() and not future.cancelled() and future.exception() is None:
                tally.done(job, future.result())
            else:
                tally.failed(job, "worker died (BrokenProcessPool)")


# Worker side of `PoolExecutor`: the stage this process holds, and its setup error if any.
_INSTALLED: tuple[object, str | None] | None = None


def _install(stage_bytes: bytes, cpus: float, env: dict[str, str], storage_options: dict) -> None:
    global _INSTALLED
    os.environ.update(env)  # the driver resolved them (a user's own setting wins there)
    stage = pickle.loads(stage_bytes)
    try:
        start_stage(stage, cpus, storage_options)
        _INSTALLED = (stage, None)
    except StageSetupError as e:  # reported to the driver on the first task
        _INSTALLED = (stage, str(e))


def _run_installed(task: Any) -> Any:
    assert _INSTALLED is not None
    stage, error = _INSTALLED
    if error is not None:
        raise StageSetupError(error)
    return stage.run(task)
