"""The per-shard stages of `hype score` on the executor contract (`hype.executor`).

A stage is a small picklable object holding its settings and the run directory. An executor (in-process,
a process pool, Ray: see `hype.executor` and `pipelines/`) ships it to each worker once, calls
`prepare_process(cpus)` and `setup()` there (load models, references, centroids: once per worker), then
`run(task)` for every shard it is given. `run` reads its inputs from the run directory, writes its
outputs there atomically with the completion marker last (`_finish`, the one place; the run contract,
`hype.io.runs`), and returns the small stats dict it wrote in that marker; nothing else leaves the
worker. Stages know nothing about the executor; executors know a stage only through that interface and
`resources()`.

`fingerprint(task)` is what the shard's output depends on; the executor skips tasks whose marker already
records it (`done`), and `run` stores it, so both sides agree without talking.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import torch

from hype.executor import Resources, Stage
from hype.io.runs import write_marker
from hype.scoring.decode import SHARED_CORE_ENV
from hype.scoring.rundir import RunDir, ShardTask, atomic_write_bytes, completed, read_json, write_parquet


class ShardStage(Stage):
    """Base class of the per-shard stages."""

    name = "stage"
    verify_outputs = False  # reuse an output only after checking its digest (reads it back)

    def __init__(self, run: RunDir, *, device: str = "cpu", threads: int = 0, debug=None):
        self.run_dir = run
        self.device = device
        self.threads = threads
        self.debug = debug
        self._digests: dict[tuple[str, str], str] = {}

    def __getstate__(self) -> dict:
        # Workers receive settings only: models, thread pools and driver caches (`_*`) stay behind and
        # are rebuilt by `setup` in the worker.
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._digests = {}

    def upstream_digest(self, stage: str, task: ShardTask) -> str | None:
        """Digest of this shard's output of an earlier stage (from its marker; cached by the driver)."""
        key = (stage, task.shard_id)
        if key not in self._digests:
            stats = read_json(self.run_dir.shard_stats(stage, task)) or {}
            digest = (stats.get("output") or {}).get("digest")
            if digest is None:
                return None
            self._digests[key] = digest
        return self._digests[key]

    def remember(self, stage: str, task: ShardTask, stats: dict) -> None:
        self._digests[(stage, task.shard_id)] = stats["output"]["digest"]

    # --- driver side ------------------------------------------------------------------------------

    def fingerprint(self, task: ShardTask) -> str:
        raise NotImplementedError

    def done(self, task: ShardTask, sizes: dict | None = None) -> dict | None:
        """The stats of this shard's finished output, or None when it must be (re)computed."""
        return completed(
            self.run_dir.shard_stats(self.name, task),
            self.fingerprint(task),
            self.run_dir.shard_output(self.name, task),
            sizes,
            verify=self.verify_outputs,
        )

    def done_all(self, tasks: list[ShardTask]) -> list[dict | None]:
        """`done` for every task from one listing of the marker folder and one of the output folder:
        resuming a run of 100k shards in a bucket reads the markers that exist, nothing more."""
        if not tasks:
            return []
        folders = {self.run_dir.shard_stats(self.name, tasks[0]).parent}
        folders.add(self.run_dir.shard_output(self.name, tasks[0]).parent)
        sizes: dict[str, int] = {}
        for folder in folders:
            sizes.update(self.run_dir.listing(folder))
        return [self.done(t, sizes) for t in tasks]

    def label(self, task: ShardTask) -> str:
        return task.path

    def resources(self) -> Resources:
        """CPUs and GPUs: the executor's share (a CPU device needs no GPU); the environment: torch's
        OpenMP threads share the cores with the decode workers (see `hype.scoring.decode`)."""
        env = {key: os.environ.get(key, value) for key, value in SHARED_CORE_ENV.items()}
        return Resources(gpus=0.0 if self.device == "cpu" else None, env=env)

    # --- worker side ------------------------------------------------------------------------------

    def prepare_process(self, cpus: float | None) -> None:
        # Unless set, torch threads and decode workers use the worker's CPU budget, not the whole node's.
        if not self.threads and cpus is not None:
            self.threads = max(1, int(cpus))

    def setup(self) -> None:
        """Per-worker initialisation; subclasses load their heavy state and call this first."""
        if self.threads:
            torch.set_num_threads(self.threads)

    def run(self, task: ShardTask) -> dict:
        raise NotImplementedError

    def teardown(self) -> None:
        """Per-worker clean-up after the last shard (decode processes, ...)."""

    def _debug_hook(self, task: ShardTask) -> None:
        # Lets a test find the process holding a shard and kill it mid-shard. A test that has done what it
        # held the shards for writes <pid_dir>/release (this hold and every later one end), or lets one
        # shard go on with <pid_dir>/<stage>-<shard id>.release.
        dbg = self.debug
        if dbg is None or dbg.pid_dir is None or dbg.stage != self.name:
            return
        folder = Path(dbg.pid_dir)
        folder.mkdir(parents=True, exist_ok=True)
        # renamed into place: a test polling for the file never reads it empty
        atomic_write_bytes(folder / f"{self.name}-{task.shard_id}.pid", str(os.getpid()).encode())
        releases = (folder / "release", folder / f"{self.name}-{task.shard_id}.release")
        deadline = time.monotonic() + dbg.hold_s
        while time.monotonic() < deadline and not any(r.exists() for r in releases):
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def _write_output(self, task: ShardTask, table) -> dict:
        """Write the shard's output table; its `write_parquet` record (a stage with its own layout
        overrides this)."""
        return write_parquet(self.run_dir.shard_output(self.name, task), table)

    def _finish(
        self, task: ShardTask, fingerprint: str, table, started: float, *, rate: int | None = None, **extra
    ) -> dict:
        """Write the shard's output table, then its `_stats.json` marker (last: the marker means done),
        and return the marker. `rate`: samples behind `samples_per_s`; `extra`: more marker fields."""
        output = self._write_output(task, table)
        seconds = time.perf_counter() - started
        stats = {
            "stage": self.name,
            "shard": task.path,
            "shard_id": task.shard_id,
            "index": task.index,
            "output": output,
            "seconds": round(seconds, 4),
            "worker": {"host": socket.gethostname(), "pid": os.getpid()},
        }
        if rate is not None:
            stats["samples_per_s"] = round(rate / seconds, 2) if seconds > 0 else None
        stats.update(extra)
        return write_marker(self.run_dir.shard_stats(self.name, task), fingerprint, **stats)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but CUDA is not available on {socket.gethostname()}")
    return device
