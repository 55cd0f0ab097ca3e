"""`hype score --executor ray` on a real two-node local Ray cluster: a worker killed with SIGKILL while it
holds a shard; every shard is still scored exactly once, byte-identical to the in-process run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.dataset as ds
import yaml
from ray_support import needs_ray, ray_env
from s3_support import CopiesAModel
from test_score_support import (
    NEARDUP_OVERRIDES,
    POOL_SIZE,
    baseline,
    cli_command,
    digests,
    kill9,
    models,
    neardup_run,
    score_args,
    wait_for,
    world,
)

pytestmark = needs_ray
REPO = Path(__file__).resolve().parents[1]


def test_ray_executor_survives_a_killed_worker_and_matches_the_local_run(
    tmp_path_factory, tmp_path, ray_cluster
):
    base = baseline(tmp_path_factory)
    w = world(tmp_path_factory)
    meru, clip = models(tmp_path_factory)
    run, pids = tmp_path / "run", tmp_path / "pids"
    args = score_args(
        w,
        meru,
        clip,
        run,
        "--executor",
        "ray",
        "--ray-address",
        ray_cluster,
        f"debug.pid_dir={pids}",
        "debug.hold_s=1.5",
        "executor.retries=2",
        *NEARDUP_OVERRIDES,  # the near-duplicate stage's two maps on Ray too
    )
    env = ray_env()
    proc = subprocess.Popen(
        cli_command(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        # A worker writes <pid_dir>/embed-<shard>.pid as it takes a shard, then holds it for 1.5 s.
        wait_for(lambda: any(pids.glob("embed-*.pid")), 240, proc, "a Ray worker to take a shard")
        victim = sorted(pids.glob("embed-*.pid"))[0]
        killed = int(victim.read_text())
        kill9(killed)
        (pids / "release").touch()  # killed while it held the shard: no other shard need be held
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out

    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "complete" and s["executor"] == "ray"
    assert s["stages"]["embed"]["retries"] >= 1 and not s["shards"]["failed"]
    shard = victim.name[len("embed-") : -len(".pid")]
    stats = json.loads((run / "embed" / f"{shard}_stats.json").read_text())
    assert stats["worker"]["pid"] != killed  # redone by another worker
    # Exactly once: one part and one marker per shard, every uid once, identical bytes to the local run.
    assert len(list((run / "merge").glob("*_stats.json"))) == 3
    table = ds.dataset(run / "scores", format="parquet").to_table()
    assert table.num_rows == POOL_SIZE and len(set(table.column("uid").to_pylist())) == POOL_SIZE
    assert digests(run / "scores") == digests(base / "scores")
    assert digests(run / "embed") == digests(base / "embed")
    local = neardup_run(tmp_path_factory)
    assert digests(run / "neardup") == digests(local / "neardup")  # groups, edges, per-group outputs
    assert s["neardup"]["members"] > 0
    assert (
        len({json.loads(p.read_text())["worker"]["pid"] for p in (run / "embed").glob("*_stats.json")}) >= 2
    )


def _map(address: str, stage, tasks: list, task_timeout: float, cwd: Path | None = None):
    import ray.cloudpickle

    from hype.pipelines.ray_executor import RayExecutor

    if cwd is not None:  # the folder the user runs hype from
        os.chdir(cwd)
    for module in {__name__, type(stage).__module__}:  # the workers cannot import tests/
        ray.cloudpickle.register_pickle_by_value(sys.modules[module])
    with RayExecutor(address, device="cpu", cpus_per_worker=1, retries=1, task_timeout=task_timeout) as ex:
        return ex.map(stage, tasks)


def _map_in_a_fresh_process(address: str, stage, tasks: list, task_timeout: float, cwd: Path | None = None):
    """`RayExecutor.map` in a new process, as `hype score` runs it: once pytest's own process had been a
    Ray driver (the in-process download tests), every actor a later in-process driver started died at
    once ("all references to the actor were removed"): one driver per process, as the CLI has."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_map, address, stage, tasks, task_timeout, cwd).result(timeout=600)


# The task timeout of the hung-task and slow-setup tests. It counts from the moment the driver sees a
# worker's set-up done, so it only has to cover an instant task's round trip: measured at <= 0.01 s from
# the driver seeing the set-up done to seeing the task's result, on 2 cores at load 8 with both cores
# also busy with CPU burners (where a worker's start took 9-11 s). Every second of it is waited out
# once by the hung attempts; 6 s keeps a margin of hundreds over that round trip.
TASK_TIMEOUT_S = 6.0


class _HangsOnce:
    """A stage whose first attempt at each task hangs (as a worker stuck in I/O would); the second runs."""

    name = "hangs-once"

    def __init__(self, folder: Path):
        self.folder = folder

    def run(self, task: int) -> dict:
        marker = self.folder / f"{task}.started"
        if not marker.exists():
            marker.write_text(str(os.getpid()))
            time.sleep(3600)
        return {"task": task, "square": task * task}


def test_a_hung_task_times_out_and_is_retried_on_a_fresh_worker(ray_cluster, tmp_path):
    # The clock starts once a worker is set up, so the timeout only has to cover an instant task's round
    # trip (TASK_TIMEOUT_S: the one the slow-setup test already holds healthy tasks to, retries == 0).
    result = _map_in_a_fresh_process(ray_cluster, _HangsOnce(tmp_path), [2, 3], task_timeout=TASK_TIMEOUT_S)
    assert [r["square"] for r in result.results] == [4, 9] and not result.failures
    assert result.retries == 2 and result.ran == 2  # each task timed out once, then ran on a fresh worker
    hung = [int((tmp_path / f"{task}.started").read_text()) for task in (2, 3)]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(pid) for pid in hung):
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in hung)  # the hung workers were killed


class _SlowSetup:
    """A stage whose set-up (a model load) takes longer than the task timeout; its tasks are instant."""

    name = "slow-setup"

    def setup(self) -> None:
        time.sleep(TASK_TIMEOUT_S + 1)  # longer than the task timeout: a clock started at submission ran out

    def run(self, task: int) -> dict:
        return {"task": task, "square": task * task}


def test_a_slow_setup_does_not_count_against_the_task_timeout(ray_cluster):
    """Before: the clock started at submission, so a worker still starting or loading models (a minute
    under load) had its first task killed as hung, and its retry on a fresh worker the same."""
    result = _map_in_a_fresh_process(ray_cluster, _SlowSetup(), [2, 3], task_timeout=TASK_TIMEOUT_S)
    assert not result.failures and result.retries == 0
    assert [r["square"] for r in result.results] == [4, 9]


class _Niceness:
    """A stage that reports the scheduling priority (niceness) its worker process runs at, its import
    path, and whether torch was imported there."""

    name = "niceness"

    def run(self, task: int) -> dict:
        return {"task": task, "nice": os.nice(0), "path": sys.path, "torch": "torch" in sys.modules}


def test_workers_run_at_the_drivers_priority_and_never_import_from_its_folder(ray_cluster, tmp_path):
    """Before: Ray starts its workers at niceness 15, so any ordinary process on a node (the driver, another
    job, a test's CPU burners) took the CPU from them: the bucket test's Ray run took 10x the local run's
    time under load and hit its 600 s limit. The local executor's workers run at the driver's priority.
    And Ray put the driver's current folder first on the workers' import path: a `hype.py` there ran in
    every worker (#34 item 2)."""
    for name in ("hype", "filters"):
        (tmp_path / f"{name}.py").write_text(f"open({str(tmp_path / f'ran-{name}')!r}, 'w').close()\n")
    result = _map_in_a_fresh_process(ray_cluster, _Niceness(), [1, 2], task_timeout=0, cwd=tmp_path)
    assert not result.failures and not list(tmp_path.glob("ran-*"))
    assert [r["nice"] for r in result.results] == [os.nice(0)] * 2
    assert all(str(tmp_path) not in r["path"] for r in result.results)
    # Before: the worker's set-up imported torch (seconds of every worker's start) to empty a CUDA cache
    # that a stage which never imported torch cannot have filled.
    assert not any(r["torch"] for r in result.results)


def test_a_finished_run_leaves_no_downloaded_model_on_the_workers(ray_cluster, s3):
    """Before: the actors were killed at the end of a run, so their exit handlers never ran and each left
    its copy of every model it had read from a bucket in the node's /tmp (an L/14 is gigabytes), run after
    run. They are now asked to exit."""
    from hype.io import write_bytes

    url = f"s3://{s3.bucket()}/models/weights.bin"
    write_bytes(url, os.urandom(1 << 16))
    result = _map_in_a_fresh_process(ray_cluster, CopiesAModel(url, s3.options), [1, 2], task_timeout=0)
    assert not result.failures and all(r["held"] for r in result.results)
    copies = {Path(r["copy"]) for r in result.results}
    assert copies and not [c for c in copies if c.exists() or c.parent.exists()]


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def test_the_cluster_dashboard_listens_on_localhost_only():
    """configs/cluster/ray-gpu.yaml: the dashboard (which runs jobs) is reached through an SSH tunnel."""
    cfg = yaml.safe_load((REPO / "configs" / "cluster" / "ray-gpu.yaml").read_text())
    (start,) = [c for c in cfg["head_start_ray_commands"] if "ray start" in c]
    assert "--dashboard-host=127.0.0.1" in start
    assert "0.0.0.0" not in (REPO / "configs" / "cluster" / "ray-gpu.yaml").read_text()
