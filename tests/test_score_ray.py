"""`hype score --executor ray` on a real two-node local Ray cluster: a worker killed with SIGKILL while it
holds a shard; every shard is still scored exactly once, byte-identical to the in-process run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.dataset as ds
import pytest
from test_score_support import (
    POOL_SIZE,
    baseline,
    cli_command,
    digests,
    kill9,
    models,
    score_args,
    wait_for,
    world,
)

RAY = Path(sys.executable).with_name("ray")
pytestmark = pytest.mark.skipif(not RAY.exists(), reason="the ray CLI is not installed next to python")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes_using(marker: str) -> list[int]:
    """PIDs of the processes of this test's cluster: their command line or environment mentions `marker`
    (the cluster's private temp dir; Ray's agents rename themselves, but inherit the environment)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                found = marker.encode() in (entry / "cmdline").read_bytes()
                found = found or f"HYPE_TEST_RAY={marker}".encode() in (entry / "environ").read_bytes()
            except OSError:
                continue
            if found:
                pids.append(int(entry.name))
    return pids


def _stop_cluster(temp_dir: str) -> None:
    # Not `ray stop`: it would stop every Ray instance on the machine. Only this cluster's processes,
    # found by their private temp dir, are ended, by pid.
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        pids = _processes_using(temp_dir)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline and _processes_using(temp_dir):
            time.sleep(0.1)


def _ray_env(temp_dir: str = "") -> dict:
    # A private test cluster on 127.0.0.1: no usage stats, no token auth (recent Ray enables it by default
    # and refuses a node that joins with another token), and a marker to find its processes by.
    return dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled", HYPE_TEST_RAY=temp_dir)


@pytest.fixture
def ray_cluster():
    temp_dir = tempfile.mkdtemp(prefix="hray", dir="/tmp")  # short: Ray's socket paths must fit 107 chars
    port = _free_port()
    env = _ray_env(temp_dir)
    common = ["--num-cpus", "1", "--disable-usage-stats"]
    try:
        for cmd in (
            [
                str(RAY),
                "start",
                "--head",
                "--port",
                str(port),
                "--temp-dir",
                temp_dir,
                "--include-dashboard=false",
            ],
            [str(RAY), "start", "--address", f"127.0.0.1:{port}"],  # a second node
        ):
            done = subprocess.run([*cmd, *common], env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, f"{' '.join(cmd)}:\n{done.stdout}\n{done.stderr}"
        yield f"127.0.0.1:{port}"
    finally:
        _stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


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
    )
    env = _ray_env()
    proc = subprocess.Popen(
        cli_command(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        # A worker writes <pid_dir>/embed-<shard>.pid as it takes a shard, then holds it for 1.5 s.
        wait_for(lambda: any(pids.glob("embed-*.pid")), 240, proc, "a Ray worker to take a shard")
        victim = sorted(pids.glob("embed-*.pid"))[0]
        killed = int(victim.read_text())
        kill9(killed)
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
    assert (
        len({json.loads(p.read_text())["worker"]["pid"] for p in (run / "embed").glob("*_stats.json")}) >= 2
    )
