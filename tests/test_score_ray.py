"""`hype score --executor ray` on a real two-node local Ray cluster: a worker killed with SIGKILL while it
holds a shard; every shard is still scored exactly once, byte-identical to the in-process run."""

from __future__ import annotations

import json
import subprocess

import pyarrow.dataset as ds
from ray_support import needs_ray, ray_env
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

pytestmark = needs_ray


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
