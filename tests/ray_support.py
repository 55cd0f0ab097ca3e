"""A real two-node Ray cluster on 127.0.0.1 for the tests (`ray start` twice, private temp dir), stopped
by the pids of its own processes. Fixture: `ray_cluster` (its address)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

RAY = Path(sys.executable).with_name("ray")
needs_ray = pytest.mark.skipif(not RAY.exists(), reason="the ray CLI is not installed next to python")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes_using(marker: str) -> list[int]:
    """PIDs of the processes of this test's cluster: their command line or environment mentions `marker`
    (the cluster's private temp dir), or a file of theirs is in it. Ray's agents rename themselves, and the
    new title can overwrite the environment's memory: a dashboard and a runtime-env agent whose
    /proc environ had lost the marker outlived their raylet after a suite (measured); their logs are open
    in the temp dir."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                found = marker.encode() in (entry / "cmdline").read_bytes()
                found = found or f"HYPE_TEST_RAY={marker}".encode() in (entry / "environ").read_bytes()
                found = found or any(_inside(fd, marker) for fd in (entry / "fd").iterdir())
            except OSError:
                continue
            if found:
                pids.append(int(entry.name))
    return pids


def _inside(fd: Path, folder: str) -> bool:
    try:
        return os.readlink(fd).startswith(folder.rstrip("/") + "/")
    except OSError:  # closed meanwhile
        return False


def _stop_cluster(temp_dir: str) -> None:
    # Not `ray stop`: it would stop every Ray instance on the machine. Only this cluster's processes,
    # found by their private temp dir, are ended, by pid. SIGKILL at once: after SIGTERM the GCS server,
    # both raylets and the runtime-env agent were still running 8 s later (measured), so a graceful stop
    # only waited out its grace before the SIGKILL. Each pass kills what is still there (a raylet may have
    # started a worker meanwhile), until none is left.
    deadline = time.monotonic() + 10.0
    while (pids := _processes_using(temp_dir)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def ray_env(temp_dir: str = "") -> dict:
    # A private test cluster on 127.0.0.1: no usage stats, no token auth (recent Ray enables it by default
    # and refuses a node that joins with another token), and a marker to find its processes by.
    return dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled", HYPE_TEST_RAY=temp_dir)


@pytest.fixture(scope="session")
def _ray_cluster_of_the_session():
    """The cluster, started once per session (a start and a stop cost ~12 s on 2 cores idle, ~50 s loaded):
    each test's drivers are their own Ray jobs, whose actors end with them; a test that kills a worker
    kills an actor, not a node. Its address file is in its private temp dir, so a `ray.init()` without an
    address elsewhere in the session still starts its own local Ray instead of joining this one."""
    temp_dir = tempfile.mkdtemp(prefix="hray", dir="/tmp")  # short: Ray's socket paths must fit 107 chars
    port = _free_port()
    env = ray_env(temp_dir)
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
        yield f"127.0.0.1:{port}", env
    finally:
        _stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture
def ray_cluster(_ray_cluster_of_the_session, monkeypatch):
    """The address of the session's two-node Ray cluster (127.0.0.1, one CPU per node)."""
    address, env = _ray_cluster_of_the_session
    # A driver in this process (RayExecutor, the download's Ray distributor) must join with the
    # cluster's settings: `ray.init` leaves RAY_AUTH_MODE=token in os.environ, and a later driver in
    # token mode saw every actor it started on this auth-less cluster die at once.
    for name in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED"):
        monkeypatch.setenv(name, env[name])
    return address
