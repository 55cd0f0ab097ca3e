"""synth -> score -> select -> reshard with every path in a bucket of a real S3 server (SeaweedFS on
127.0.0.1), on the local and the two-node Ray executor, against the same chain on local disk; a killed
run, a server stopped mid-run, and the errors a user sees for a missing bucket, refused credentials and a
missing object.

What "the same output" means here: the scores table's `shard` column holds the input tar as given (a URL
here, a path there), so scores are compared column by column without it; everything else (per-shard
embeddings, subsets, reshards) must be byte-identical."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from ray_support import needs_ray, ray_env
from s3_support import ACCESS_KEY, SECRET_KEY, S3Server
from test_score_support import BASE_OVERRIDES, baseline, cli_command, kill9, models, wait_for, world

from hype.io import files as hype_files
from hype.io import read_bytes, storage

pytestmark = pytest.mark.slow


# --- helpers ------------------------------------------------------------------------------------------


def upload_tree(local: Path, url: str) -> None:
    for p in sorted(local.rglob("*")):
        if p.is_file():
            storage.upload(p, storage.location(f"{url}/{p.relative_to(local).as_posix()}"))


def hype(options: dict, *args: str):
    """`hype --storage-options JSON ARGS` in this process."""
    from hype.cli import main

    try:
        return CliRunner().invoke(
            main, ["--storage-options", json.dumps(options), *args], catch_exceptions=False
        )
    finally:
        storage.configure(options)  # the fixture's options stay in force for the test's own reads


def score_args(pool: str, meru: str, clip: str, classes: str, out: str, *extra: str) -> list[str]:
    return ["score", "--pool", pool, "--meru", meru, "--clip", clip, "--class-images", classes, "--out", out,
            *BASE_OVERRIDES, *extra]  # fmt: skip


def digest_list(folder, suffix: str) -> list[str]:
    """Sorted content digests of a folder's files (names hold a hash of the input path, so they differ)."""
    names = [n for n in storage.list_sizes(folder) if n.endswith(suffix)]
    return sorted(hashlib.sha256(read_bytes(storage.join(folder, n))).hexdigest() for n in names)


def scores_without_shard(run) -> dict:
    """{part name: table without the `shard` column}."""
    folder = storage.join(run, "scores")
    out = {}
    for name in sorted(storage.list_sizes(folder)):
        table = pq.read_table(io.BytesIO(read_bytes(storage.join(folder, name))))
        out[name] = table.drop_columns(["shard"])
    return out


def same_scores(a, b) -> None:
    ta, tb = scores_without_shard(a), scores_without_shard(b)
    assert list(ta) == list(tb) and ta
    for name in ta:
        assert ta[name].equals(tb[name]), name


def part_bytes(run) -> dict[str, bytes]:
    folder = storage.join(run, "scores")
    return {n: read_bytes(storage.join(folder, n)) for n in sorted(storage.list_sizes(folder))}


class Chain:
    """The synthetic world and the two tiny scorers, uploaded to one bucket."""

    def __init__(self, tmp_path_factory, server: S3Server):
        self.world = world(tmp_path_factory)
        self.meru, self.clip = models(tmp_path_factory)
        self.server = server
        self.bucket = f"s3://{server.bucket()}"
        storage.configure(server.options)
        upload_tree(self.world / "pool" / "shards", f"{self.bucket}/pool")
        upload_tree(self.world / "eval" / "reference" / "train", f"{self.bucket}/classes")
        for p in (self.meru, self.clip):
            storage.upload(p, storage.location(f"{self.bucket}/models/{p.name}"))

    def score(self, out: str, *extra: str) -> list[str]:
        b = self.bucket
        return score_args(f"{b}/pool", f"{b}/models/{self.meru.name}", f"{b}/models/{self.clip.name}",
                          f"{b}/classes", out, *extra)  # fmt: skip


@pytest.fixture(scope="module")
def chain(tmp_path_factory, s3_server):
    return Chain(tmp_path_factory, s3_server)


@pytest.fixture
def opts(chain):
    storage.configure(chain.server.options)
    try:
        yield chain.server.options
    finally:
        storage.configure(None)


def all_objects(bucket: str) -> dict[str, bytes]:
    fs = storage.location(bucket).fs
    keys = fs.find(bucket.removeprefix("s3://"))
    return {k: fs.cat_file(k) for k in keys}


# --- the chain ----------------------------------------------------------------------------------------


def test_score_select_reshard_in_a_bucket_equal_the_local_disk_run(chain, opts, tmp_path_factory, tmp_path):
    base = baseline(tmp_path_factory)
    b = chain.bucket
    r = hype(opts, *chain.score(f"{b}/run"))
    assert r.exit_code == 0, r.output
    same_scores(f"{b}/run", base)
    assert digest_list(f"{b}/run/embed", ".parquet") == digest_list(base / "embed", ".parquet")
    assert read_bytes(f"{b}/run/reference.safetensors") == (base / "reference.safetensors").read_bytes()
    summary = json.loads(read_bytes(f"{b}/run/summary.json"))
    assert summary["status"] == "complete" and summary["shards"]["storage_retries"] == 0
    assert not storage.exists(f"{b}/run/.lock")  # released

    # select from the bucket == select from local disk, byte for byte
    r = hype(opts, "select", "--scores", f"{b}/run", "--frac", "0.2", "--out", f"{b}/subset.npy")
    assert r.exit_code == 0, r.output
    local_subset = tmp_path / "subset.npy"
    r = hype(opts, "select", "--scores", str(base), "--frac", "0.2", "--out", str(local_subset))
    assert r.exit_code == 0, r.output
    assert read_bytes(f"{b}/subset.npy") == local_subset.read_bytes()
    assert read_bytes(f"{b}/subset.parquet") == local_subset.with_suffix(".parquet").read_bytes()

    # reshard from the bucket's pool to the bucket == local reshard, byte for byte
    args = ["--shard-size", "12", "--workers", "2", "--no-progress"]
    r = hype(
        opts, "reshard", "--pool", f"{b}/pool", "--subset", f"{b}/subset.npy", "--out", f"{b}/reshard", *args
    )
    assert r.exit_code == 0, r.output
    local_out = tmp_path / "reshard"
    pool = str(chain.world / "pool" / "shards")
    r = hype(opts, "reshard", "--pool", pool, "--subset", str(local_subset), "--out", str(local_out), *args)
    assert r.exit_code == 0, r.output
    remote = {
        n: read_bytes(f"{b}/reshard/{n}") for n in storage.list_sizes(f"{b}/reshard") if n != "meta.json"
    }
    local = {p.name: p.read_bytes() for p in local_out.iterdir() if p.name != "meta.json"}
    assert remote.keys() == local.keys() and any(n.endswith(".tar") for n in local)
    for name, data in local.items():
        if name.endswith(".tar"):
            assert remote[name] == data, name
        else:  # DataComp's fields equal; the fingerprints name their own inputs (bucket or local tars)
            datacomp = ("successes", "count")
            assert [json.loads(remote[name])[k] for k in datacomp] == [json.loads(data)[k] for k in datacomp]
    meta = json.loads(read_bytes(f"{b}/reshard/meta.json"))
    assert (
        meta["verified"]
        and meta["output_shard_count"]
        == json.loads((local_out / "meta.json").read_text())["output_shard_count"]
    )
    # The resume state is removed when done (SeaweedFS keeps the emptied folder entries; no object is left).
    assert not [k for k in all_objects(b) if "/reshard/.reshard/" in k]

    # nothing hype wrote holds the credentials
    for key, data in all_objects(b).items():
        assert SECRET_KEY.encode() not in data and ACCESS_KEY.encode() not in data, key


@needs_ray
def test_ray_executor_with_the_run_directory_in_the_bucket(chain, opts, ray_cluster, tmp_path_factory):
    test_local = f"{chain.bucket}/run"
    if not storage.exists(f"{test_local}/summary.json"):
        r = hype(opts, *chain.score(test_local))
        assert r.exit_code == 0, r.output
    out = f"{chain.bucket}/run-ray"
    # Credentials from the environment variable, as on a cluster; the workers get them from the driver.
    env = {**ray_env(), "HYPE_STORAGE_OPTIONS": json.dumps(opts)}
    args = chain.score(out, "--executor", "ray", "--ray-address", ray_cluster)[1:]
    done = subprocess.run(cli_command(args), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert part_bytes(out) == part_bytes(test_local)  # same URLs in `shard`: byte-identical
    summary = json.loads(read_bytes(f"{out}/summary.json"))
    assert summary["executor"] == "ray" and summary["status"] == "complete"
    assert SECRET_KEY not in done.stdout + done.stderr


def test_storage_options_from_a_score_config_file_reach_every_stage_and_no_run_file(chain, opts, tmp_path):
    reference = f"{chain.bucket}/run"
    if not storage.exists(f"{reference}/summary.json"):
        r = hype(opts, *chain.score(reference))
        assert r.exit_code == 0, r.output
    # The endpoint and key in the config file, the secret as a key=value override; nothing in the
    # environment or on the command line.
    config = tmp_path / "bucket.yaml"
    config.write_text(f"storage_options:\n  endpoint_url: {opts['endpoint_url']}\n  key: {opts['key']}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "HYPE_STORAGE"))}
    out = f"{chain.bucket}/run-config"
    args = [*chain.score(out, f"storage_options.secret={opts['secret']}")[1:], "--config", str(config)]
    done = subprocess.run(cli_command(args), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert part_bytes(out) == part_bytes(reference)
    written = {k: v for k, v in all_objects(chain.bucket).items() if "/run-config/" in k}
    assert any(k.endswith("summary.json") for k in written)
    for key, data in written.items():
        assert SECRET_KEY.encode() not in data and ACCESS_KEY.encode() not in data, key
    assert SECRET_KEY not in done.stdout + done.stderr


def test_a_killed_run_leaves_no_partial_object_and_a_rerun_is_identical(
    chain, opts, tmp_path_factory, tmp_path
):
    base = baseline(tmp_path_factory)
    out, pids = f"{chain.bucket}/run-killed", tmp_path / "pids"
    # TMPDIR: the killed process cannot remove its copies of the bucket's models; they stay in pytest's folder
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "HYPE_STORAGE_OPTIONS": json.dumps(opts), "TMPDIR": str(tmp_path / "tmp")}
    args = chain.score(out, f"debug.pid_dir={pids}", "debug.hold_s=3")[1:]
    proc = subprocess.Popen(
        cli_command(args), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_for(lambda: any(pids.glob("embed-*.pid")), 240, proc, "the first shard to start")
        next(pids.glob("embed-*.pid")).with_suffix(".release").touch()  # it is to finish: let it go at once
        marker = lambda: any(n.endswith("_stats.json") for n in storage.list_sizes(f"{out}/embed"))  # noqa: E731
        wait_for(marker, 240, proc, "the first shard's marker")
        wait_for(lambda: len(list(pids.glob("embed-*.pid"))) >= 2, 60, proc, "the second shard to start")
        kill9(proc.pid)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    embed = storage.list_sizes(f"{out}/embed")
    assert sum(n.endswith("_stats.json") for n in embed) == 1
    assert sum(n.endswith(".parquet") for n in embed) == 1  # no partial object under a final name
    assert storage.exists(f"{out}/.lock")  # the killed driver could not release it

    r = hype(opts, *chain.score(out))  # same host, dead pid: the lock is taken over
    assert r.exit_code == 0, r.output
    summary = json.loads(read_bytes(f"{out}/summary.json"))
    assert summary["stages"]["embed"]["shards_reused"] == 1 and summary["stages"]["embed"]["shards_run"] == 2
    same_scores(out, base)
    assert digest_list(f"{out}/embed", ".parquet") == digest_list(base / "embed", ".parquet")


def test_a_live_lock_in_the_bucket_refuses_a_second_run(chain, opts):
    out = f"{chain.bucket}/run-locked"
    holder = {"host": "another-node", "pid": 1, "token": "t", "since": 0}
    storage.location(f"{out}/.lock").fs.pipe_file(
        f"{out}/.lock".removeprefix("s3://"), json.dumps(holder).encode()
    )
    r = hype(opts, *chain.score(out))
    assert r.exit_code != 0
    assert "another `hype score` (pid 1 on another-node)" in r.output and f"{out}/.lock" in r.output


def test_a_server_stopped_mid_run_fails_cleanly_or_retries_and_a_rerun_completes(tmp_path_factory, tmp_path):
    base = baseline(tmp_path_factory)
    server = S3Server(tmp_path / "server")
    server.start()
    try:
        chain = Chain(tmp_path_factory, server)
        out, pids = f"{chain.bucket}/run", tmp_path / "pids"
        # botocore's own retries off (a storage option a user can set too): each refused request is one of
        # hype's counted retries, whose back-off (0.5 s doubling) ends soon after the server is back, where
        # botocore's (up to 15 s per try) kept the run waiting ~10 s after it.
        options = {**server.options, "config_kwargs": {"retries": {"max_attempts": 1}}}
        env = {**os.environ, "HYPE_STORAGE_OPTIONS": json.dumps(options)}
        # The first shard is held until the server is down (released below), later shards not at all.
        args = chain.score(out, f"debug.pid_dir={pids}", "debug.hold_s=240", "executor.retries=1")[1:]
        proc = subprocess.Popen(
            cli_command(args), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            wait_for(lambda: any(pids.glob("embed-*.pid")), 240, proc, "a shard to start")
            server.stop()  # 500s for a second, then killed
            (pids / "release").touch()  # the held shard reads its tar from the stopped server
            released, back = time.monotonic(), []
            # Started again at once: it refuses connections until it answers, 2.4-3 s on (more if loaded).
            restart = threading.Thread(target=lambda: (server.start(), back.append(time.monotonic())))
            restart.start()
            output, _ = proc.communicate(timeout=400)
            restart.join()
        finally:
            if proc.poll() is None:
                proc.kill()
        # Either the retries rode the outage out (and were counted), or the run ended with a message, not a
        # traceback.
        storage.configure(server.options)
        if proc.returncode != 0:
            assert "Traceback" not in output, output
            assert "storage server" in output or "rerun" in output, output
        else:
            summary = json.loads(read_bytes(f"{out}/summary.json"))
            assert summary["status"] == "complete", output
            if back and back[0] - released < 15:  # within hype's retries (0.5 + 1 + 2 + 4 + 8 s): counted
                assert summary["shards"]["storage_retries"] > 0, output
        r = hype(server.options, *chain.score(out))
        assert r.exit_code == 0, r.output
        same_scores(out, base)
        assert digest_list(f"{out}/embed", ".parquet") == digest_list(base / "embed", ".parquet")
    finally:
        storage.configure(None)
        server.stop(term_s=0)


# --- bad input ----------------------------------------------------------------------------------------


def test_missing_bucket_wrong_credentials_and_missing_object_are_clear_errors(chain, opts):
    b = chain.bucket
    r = hype(opts, *chain.score("s3://no-such-bucket-hype/run"))
    assert (
        r.exit_code != 0
        and "s3://no-such-bucket-hype/run" in r.output
        and "bucket does not exist" in r.output
    )

    wrong = {**opts, "secret": "not-the-secret"}
    r = hype(wrong, *chain.score(f"{b}/run-wrong"))
    assert r.exit_code != 0 and "check the credentials" in r.output
    assert "not-the-secret" not in r.output

    args = chain.score(f"{b}/run-missing")
    args[args.index("--meru") + 1] = f"{b}/models/nope.safetensors"
    r = hype(opts, *args)
    assert r.exit_code != 0 and f"{b}/models/nope.safetensors" in r.output

    r = hype(opts, "select", "--scores", f"{b}/no-run", "--frac", "0.2", "--out", f"{b}/s.npy")
    assert r.exit_code != 0 and f"{b}/no-run" in r.output


# --- what `hype plan` counts ----------------------------------------------------------------------------

# Largest miss accepted between the plan's bucket requests and the server's, per type: the model matches
# this run exactly (bench/plan_requests.py: also at 8 shards and 4 groups of clusters); a stage left out
# (the card: 20% of the GETs, 38% of the LISTs; neardup's split: 15% of the GETs) is well beyond it.
REQUEST_TOLERANCE = 0.05


def test_the_plans_bucket_requests_are_what_the_server_counts_for_the_run(
    chain, opts, tmp_path_factory, monkeypatch
):
    """A fresh run (near-duplicate stage included) in a bucket of its own, counted by SeaweedFS's request
    counters, against `hype plan`'s estimate from a probe of the same size: the same world scored on local
    disk, so the plan's request model is checked without extrapolation (bench/plan_requests.py runs the
    whole `hype plan` and larger pools)."""
    import yaml
    from test_score_support import NEARDUP_OVERRIDES, neardup_run

    from hype.scoring.config import load_score_config
    from hype.scoring.plan import estimate, pool_size, probe_from_run

    local = neardup_run(tmp_path_factory)
    # A `hype score` process starts without models fetched; in this test process, earlier tests fetched the
    # same model URLs into `cached_copy`'s cache (2 pool LISTs and GETs fewer in a full suite run).
    monkeypatch.setattr(hype_files, "_CACHED", {})
    run_bucket = chain.server.bucket("run")
    before = chain.server.request_counts(run_bucket), chain.server.request_counts(chain.bucket[5:])
    # with the copy check (the default): the split streams the pool tars, the groups read their rows twice
    r = hype(opts, *chain.score(f"s3://{run_bucket}/run", *NEARDUP_OVERRIDES, "neardup.copy_check=true"))
    assert r.exit_code == 0, r.output
    after = chain.server.request_counts(run_bucket), chain.server.request_counts(chain.bucket[5:])
    run, pool = ({k: a.get(k, 0) - b.get(k, 0) for k in a} for a, b in zip(after, before, strict=True))

    cfg = load_score_config(yaml.safe_load(read_bytes(f"s3://{run_bucket}/run/config.yaml")))  # as it ran
    size = pool_size(cfg.pool)
    summary = json.loads((local / "summary.json").read_text())
    probe = probe_from_run(local, summary, samples=size.total, shards=len(size.shards), workers=1)
    plan = estimate(cfg, size, probe)["total"]["requests"]
    measured = {"get": run["GET"], "put": run["PUT"], "list": run["LIST"], "delete": run.get("DELETE", 0),
                "pool_get": pool["GET"], "pool_list": pool["LIST"]}  # fmt: skip
    assert measured["get"] > 300 and measured["list"] > 40  # the whole run was counted
    for kind, n in measured.items():
        assert abs(plan[kind] - n) <= REQUEST_TOLERANCE * n + 1, f"{kind}: plan {plan}, server {measured}"
