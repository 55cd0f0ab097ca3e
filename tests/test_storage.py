"""hype.io on a real S3 server (SeaweedFS on 127.0.0.1): whole-object writes, listings, the conditional
create, read-ahead streams with retries across a server restart, and the errors a user sees."""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from s3_support import CopiesAModel, S3Server

from hype.io import (
    atomic_write,
    cached_copy,
    open_input,
    read_bytes,
    read_json,
    read_parquet,
    sha256_file,
    storage,
    write_json,
    write_parquet,
)
from hype.io.tar import index_samples, read_samples, write_tar


class Problems:
    def __init__(self):
        self.seen = []

    def add(self, reason, message):
        self.seen.append((reason, message))


def test_location_keeps_local_paths_local(tmp_path):
    assert storage.location(str(tmp_path)) == tmp_path
    assert storage.location(f"file://{tmp_path}") == tmp_path
    assert not storage.is_url(tmp_path) and storage.is_url("s3://b/k") and storage.is_url("hf://datasets/x")
    assert (
        str(storage.location("s3://bucket/run") / "embed" / "a.parquet") == "s3://bucket/run/embed/a.parquet"
    )


def test_whole_object_writes_and_reads(s3):
    root = f"s3://{s3.bucket()}/run"
    table = pa.table({"uid": ["a", "b"], "x": [1.0, 2.0]})
    write_parquet(f"{root}/t.parquet", table)
    write_json(f"{root}/m.json", {"k": 1})
    assert read_json(f"{root}/m.json") == {"k": 1}
    assert read_json(f"{root}/missing.json") is None
    import pyarrow.parquet as pq

    with open_input(f"{root}/t.parquet") as f:
        assert pq.read_table(f).equals(table)
    assert storage.list_sizes(root) == {
        "t.parquet": storage.size(f"{root}/t.parquet"),
        "m.json": len(b'{\n  "k": 1\n}\n'),
    }
    assert storage.list_sizes(f"{root}/nothing-here") == {}

    # An error inside the block leaves no object, not a partial one (fsspec's own writer would commit it).
    with pytest.raises(RuntimeError), atomic_write(f"{root}/partial.bin") as f:
        f.write(b"x" * (6 << 20))
        raise RuntimeError("boom")
    assert not storage.exists(f"{root}/partial.bin")


def _kill_when_ready(s3, body: str, ready: str) -> None:
    """Run `body` in a child process configured for the server, wait until it prints `ready`, kill it."""
    header = "import time\nfrom hype.io import atomic_sink, atomic_write, storage\n"
    code = f"{header}storage.configure({s3.options!r})\n"
    proc = subprocess.Popen(
        [sys.executable, "-c", code + body], stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    line = proc.stdout.readline().strip()  # '' when the child ended without getting ready
    assert line == ready, f"the child ended before printing {ready!r} (exit {proc.wait(10)})"
    proc.kill()
    proc.wait(10)


def test_the_plans_price_of_each_storage_operation_is_what_the_server_counts(s3):
    """`hype plan` counts a run's bucket requests from a price per storage operation (hype.scoring.pricing);
    each price is checked against SeaweedFS's own request counters (HEAD counts as GET there, as on S3's
    bill), at the sizes where it changes: a Parquet file inside pyarrow's 64 KiB footer read, one of a
    few MB, one whose columns span two 32 MiB pre-buffer ranges."""
    from hype.scoring import pricing

    bucket = s3.bucket()
    root = f"s3://{bucket}/run"

    def count(op) -> dict[str, int]:
        before = s3.request_counts(bucket)
        op()
        after = s3.request_counts(bucket)
        return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}

    rng = np.random.default_rng(0)
    for rows, cols in ((100, 1), (20_000, 2), (2_500_000, 4)):  # ~1 KB, ~160 KB, ~40 MB
        table = pa.table({f"c{i}": rng.standard_normal(rows, dtype=np.float32) for i in range(cols)})
        url = f"{root}/t{rows}.parquet"
        assert count(lambda u=url, t=table: write_parquet(u, t)) == {"PUT": 1}
        n = storage.size(url)
        assert count(lambda u=url: read_parquet(u)) == {"GET": pricing.parquet_get(n)}, n
    assert pricing.parquet_get(1 << 10) == 2 and pricing.parquet_get(45 << 20) == 4  # the three prices

    assert count(lambda: write_json(f"{root}/m.json", {"k": 1})) == {"PUT": pricing.put(20)}
    assert count(lambda: read_json(f"{root}/m.json")) == {"GET": pricing.JSON_GET}
    missing = {k.upper(): v for k, v in pricing.MISSING.items()}
    assert count(lambda: read_json(f"{root}/not-yet.json")) == missing
    assert count(lambda: storage.list_sizes(root)) == {"LIST": pricing.lists(4)}
    assert count(lambda: storage.list_sizes(f"{root}/empty")) == {"LIST": pricing.lists(0)}
    big = f"{root}/t2500000.parquet"
    assert count(lambda: sha256_file(big)) == {"GET": pricing.stream_get(storage.size(big))}

    def written_digest():  # the reference stage's sets: written, then their size and digest for the marker
        write_json(f"{root}/set.json", {"k": 2})
        assert storage.size(f"{root}/set.json") and sha256_file(f"{root}/set.json")

    assert count(written_digest) == {"PUT": 1, "GET": pricing.written_digest(20)}


def test_a_killed_writer_leaves_no_object(s3, tmp_path):
    url = f"s3://{s3.bucket()}/killed.bin"
    body = f"""
with atomic_write({url!r}) as f:
    f.write(b"x" * (1 << 20)); f.flush()
    print("writing", flush=True)
    time.sleep(60)
"""
    _kill_when_ready(s3, body, "writing")
    assert not storage.exists(url)


MB = 1 << 20


def _wait_for_parts(upload: storage.StreamingUpload, n: int) -> None:
    """Until the background sender has handed `n` parts to the store (bounded)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if upload._file.mpu is not None and len(upload._file.parts or []) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} parts were uploaded in 30 s")


def test_a_streaming_upload_appears_whole_only_at_commit(s3):
    url = f"s3://{s3.bucket()}/streamed.bin"
    data = np.random.default_rng(0).integers(0, 256, 13 * MB, dtype=np.uint8).tobytes()
    upload = storage.StreamingUpload(storage.location(url), part_size=5 * MB)
    for i in range(0, len(data), 100_000):  # small writes, as a Parquet writer makes them
        upload.write(data[i : i + 100_000])
    assert upload.tell() == len(data)
    _wait_for_parts(upload, 2)  # two parts are in the store while the writer goes on...
    assert not storage.exists(url)  # ...and the object is not there before the commit
    upload.commit()
    assert read_bytes(url) == data


@pytest.mark.parametrize("how", ["abort", "error", "exit"])
def test_an_unfinished_streaming_upload_leaves_no_object(s3, how):
    from hype.io import atomic_sink

    url = f"s3://{s3.bucket()}/unfinished-{how}.bin"
    if how == "error":
        with pytest.raises(RuntimeError), atomic_sink(url) as sink:
            sink.write(b"x" * 11 * MB)
            _wait_for_parts(sink, 1)
            raise RuntimeError("boom")
    elif how == "abort":
        upload = storage.StreamingUpload(storage.location(url), part_size=5 * MB)
        upload.write(b"x" * 11 * MB)
        _wait_for_parts(upload, 2)
        upload.abort()
    else:  # a program that ends without committing: the finalizers that run at exit must not complete it
        code = f"""
import time
from hype.io import storage
storage.configure({s3.options!r})
upload = storage.StreamingUpload(storage.location({url!r}), part_size=5 << 20)
upload.write(b"x" * (11 << 20))
while len(upload._file.parts or []) < 2:
    time.sleep(0.05)
"""
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=dict(os.environ))
    assert not storage.exists(url)


def test_parquet_streamed_to_a_bucket_equals_the_local_file(s3, tmp_path):
    import pyarrow.parquet as pq

    from hype.io import atomic_sink

    rng = np.random.default_rng(1)
    table = pa.table({"uid": [f"{x:032x}" for x in rng.integers(0, 2**62, 10**6)], "x": rng.random(10**6)})
    url = f"s3://{s3.bucket()}/t.parquet"
    for where in (tmp_path / "t.parquet", url):
        with atomic_sink(where) as sink, pq.ParquetWriter(sink, table.schema, compression="zstd") as w:
            for batch in table.to_batches(max_chunksize=100_000):
                w.write_batch(batch)
        if isinstance(sink, storage.StreamingUpload):
            assert sink._file.parts, "expected a multipart upload"  # the file is larger than one part
    assert read_bytes(url) == (tmp_path / "t.parquet").read_bytes()
    assert pq.read_table(pa.BufferReader(read_bytes(url))).equals(table)


def test_a_killed_streaming_writer_leaves_no_object(s3):
    url = f"s3://{s3.bucket()}/killed-stream.bin"
    body = f"""
with atomic_sink({url!r}) as f:
    f.write(b"x" * (20 << 20))
    deadline = time.monotonic() + 120  # bounded: a server that takes no part ends the child, not the suite
    while not f._file.parts:
        if time.monotonic() > deadline:
            raise SystemExit("no part uploaded in 120 s")
        time.sleep(0.05)
    print("uploading", flush=True)
    time.sleep(60)
"""
    _kill_when_ready(s3, body, "uploading")
    assert not storage.exists(url)


def test_create_exclusive_is_conditional(s3):
    url = f"s3://{s3.bucket()}/run/.lock"
    assert storage.create_exclusive(url, b"one")
    assert not storage.create_exclusive(url, b"two")
    with open_input(url) as f:
        assert f.read() == b"one"
    storage.remove(url)
    assert storage.create_exclusive(url, b"three")


def _tar_members(n: int, seed: int = 0) -> list[tuple[str, bytes]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        out.append((f"{i:09d}.jpg", rng.bytes(int(rng.integers(1000, 300_000)))))
        out.append((f"{i:09d}.txt", f"caption {i}".encode()))
    return out


def test_streamed_tar_equals_the_local_one(s3, tmp_path):
    local = tmp_path / "00000.tar"
    write_tar(local, _tar_members(60))
    url = f"s3://{s3.bucket()}/pool/00000.tar"
    storage.upload(local, storage.location(url))
    p_local, p_url = Problems(), Problems()
    assert list(read_samples(url, p_url)) == list(read_samples(local, p_local))
    assert list(index_samples(url, p_url)) == list(index_samples(local, p_local))
    assert p_url.seen == p_local.seen == []
    assert sha256_file(url) == hashlib.sha256(local.read_bytes()).hexdigest()
    # Small chunks: many read-ahead ranges, seeks back and forth.
    f = io.BufferedReader(
        storage.RemoteStream(
            storage.location(url).fs,
            storage.location(url).path,
            local.stat().st_size,
            url=url,
            chunk=4096,
            depth=2,
        )
    )
    data = local.read_bytes()
    assert f.read(10_000) == data[:10_000]
    f.seek(5)
    assert f.read(20_000) == data[5:20_005]
    f.seek(len(data) - 100)
    assert f.read() == data[-100:]
    f.close()


@pytest.mark.slow
def test_a_server_restart_mid_stream_is_retried_and_counted(tmp_path):
    # Its own server: this one is stopped and started again.
    server = S3Server(tmp_path / "server")
    # A port another process took after it was picked makes weed exit at once: a first start picks others
    # (before, it raised: one run of this file failed so, in under 2 s, while other servers were starting).
    taken = server.ports["metrics"]
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", taken))
        blocker.listen()
        server.start()
    assert server.ports["metrics"] != taken
    try:
        # botocore's own retries off (a storage option a user can set too): it retried each refused request
        # for up to 15 s before hype's counted retries began, and the restart below waits for those.
        storage.configure({**server.options, "config_kwargs": {"retries": {"max_attempts": 1}}})
        local = tmp_path / "00000.tar"
        write_tar(local, _tar_members(40, seed=1))
        url = f"s3://{server.bucket()}/pool/00000.tar"
        storage.upload(local, storage.location(url))
        before = storage.retry_count()
        loc = storage.location(url)
        # Small ranges, so that most of the object is fetched after the server went away.
        stream = io.BufferedReader(
            storage.RemoteStream(loc.fs, loc.path, local.stat().st_size, url=url, chunk=1 << 16, depth=2)
        )
        head = stream.read(1 << 16)
        server.stop()

        def start_once_retried() -> None:
            # Back once the reader has counted a retry: a fixed outage shorter than s3fs's and botocore's
            # own retries was ridden out uncounted. Bounded: a reader that never counts one fails below.
            deadline = time.monotonic() + 120
            while storage.retry_count() == before and time.monotonic() < deadline:
                time.sleep(0.05)
            server.start()

        restarter = threading.Thread(target=start_once_retried)
        restarter.start()
        rest = stream.read()
        restarter.join()
        assert head + rest == local.read_bytes()
        assert storage.retry_count() > before
    finally:
        storage.configure(None)
        server.stop(term_s=0)
    # The killed server's unix sockets (weed names them by port in /tmp) went with it; its logs were its own.
    ports = {str(p) for port in server.ports.values() for p in (port, port + 10000)}
    assert not [s for s in Path("/tmp").glob("seaweedfs-*.sock") if s.stem.rsplit("-", 1)[1] in ports]
    assert list((tmp_path / "server").glob("weed.*INFO*"))


def test_a_cached_copy_is_of_the_url_read_with_these_storage_options(s3, monkeypatch):
    from hype.io import files

    monkeypatch.setattr(files, "_CACHED", {})
    url = f"s3://{s3.bucket()}/models/m.bin"
    write_json(url, {"v": 1})
    first = cached_copy(url)
    assert read_json(first) == {"v": 1} and cached_copy(url) == first  # downloaded once
    # The same name read with other options (another endpoint, other credentials) is not that copy: with a
    # wrong secret it is refused, not answered from the cache (it was, when the URL alone was the key).
    storage.configure({**s3.options, "secret": "wrong"})
    with pytest.raises(storage.StorageError, match="access refused"):
        cached_copy(url)
    storage.configure(s3.options)
    assert cached_copy(url) == first


def test_pool_workers_remove_their_downloaded_models_when_they_end(s3, tmp_path, monkeypatch):
    # Before: the copies were removed by atexit handlers, which a process pool's worker never runs (it
    # ends with os._exit), so `hype score --workers N` left N copies of every model in a bucket in /tmp.
    import tempfile

    from hype.executor import PoolExecutor

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the workers' temporary folder (forked)
    url = f"s3://{s3.bucket()}/models/weights.bin"
    write_json(url, {"weights": list(range(100))})
    result = PoolExecutor(2, start_method="fork").map(CopiesAModel(url, s3.options), [1, 2, 3, 4])
    assert not result.failures and all(r["held"] for r in result.results)
    assert {Path(r["copy"]).parent.parent for r in result.results} == {tmp_path}
    assert not list(tmp_path.glob(".hype-cache-*"))  # both workers' copies are gone


# A driver process as `hype score --workers 2` is on a bucket: it writes, runs a forked pool whose workers
# read the bucket, and reports which descriptors its fsspec loop's epoll watches before and after.
_FORKED_DRIVER = """
import json, re, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import fsspec.asyn
from s3_support import CopiesAModelThenCollects
from hype.executor import PoolExecutor
from hype.io import read_json, storage, write_json

def watched(loop):
    info = Path(f"/proc/self/fdinfo/{loop._selector.fileno()}").read_text()
    return sorted(int(fd) for fd in re.findall(r"^tfd:\\s+(\\d+)", info, re.M))

options, url = json.loads(sys.argv[1]), sys.argv[3]
storage.configure(options)
write_json(url, {"weights": [1, 2, 3]})  # the driver now holds an open connection to the server
before = watched(fsspec.asyn.get_loop())
result = PoolExecutor(2, start_method="fork").map(CopiesAModelThenCollects(url, options), [1, 2, 3, 4])
after = watched(fsspec.asyn.get_loop())
print(json.dumps({"before": before, "after": after, "failures": len(result.failures),
                  "read": read_json(url)}))
"""


def test_forked_workers_leave_the_drivers_connections_watched(s3):
    # Before: a forked worker's first s3fs use dropped the driver's inherited s3fs instance, whose
    # finalizer closed its connections through the driver's loop object, and so removed each from the
    # epoll that driver and worker share (a forked descriptor names the same kernel object). The driver's
    # next request on one waited 15 s (the read timeout) before botocore retried it: in this file, the
    # error test took 16 s after the pool test.
    url = f"s3://{s3.bucket()}/models/weights.bin"
    run = subprocess.run(
        [sys.executable, "-c", _FORKED_DRIVER, json.dumps(s3.options), str(Path(__file__).parent), url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["failures"] == 0 and got["read"] == {"weights": [1, 2, 3]}
    assert len(got["before"]) >= 2  # the loop's wake-up socket and the connection
    assert set(got["before"]) <= set(got["after"]), got


def test_errors_name_the_url_and_the_fix(s3):
    bucket = s3.bucket()
    with pytest.raises(FileNotFoundError, match=f"s3://{bucket}/missing.tar"):
        open_input(f"s3://{bucket}/missing.tar", stream=True)
    with pytest.raises(storage.StorageError, match="bucket does not exist; create it"):
        storage.list_sizes("s3://no-such-bucket-hype/x") or storage.exists("s3://no-such-bucket-hype/x/y")
        write_json("s3://no-such-bucket-hype/x/m.json", {})
    storage.configure({**s3.options, "secret": "wrong"})
    with pytest.raises(storage.StorageError, match="access refused.*check the credentials"):
        storage.list_sizes(f"s3://{bucket}")
    assert "wrong" not in str(storage.location(f"s3://{bucket}/x"))
    with pytest.raises(storage.StorageError, match="not valid JSON"):
        storage.configure("{endpoint")


def test_transient_errors_are_told_apart(monkeypatch):
    assert storage.is_transient(ConnectionResetError())
    assert storage.is_transient(OSError("503 Service Unavailable: SlowDown"))
    assert storage.is_transient(OSError(121, "We encountered an internal error, please try again."))
    assert not storage.is_transient(FileNotFoundError("x"))
    assert not storage.is_transient(PermissionError("AccessDenied"))
    # The back-off's waits are recorded instead of slept (the module's own `time`, nothing else's).
    slept: list[float] = []
    monkeypatch.setattr(storage, "time", types.SimpleNamespace(sleep=slept.append))
    calls = []

    def flaky(failures: int):
        calls.append(1)
        if len(calls) <= failures:
            raise ConnectionResetError("reset by peer")
        return "ok"

    before = storage.retry_count()
    assert storage.with_retries(lambda: flaky(2), "s3://b/k") == "ok"
    assert storage.retry_count() - before == 2 and slept == [0.5, 1.0]

    # Doubling up to `max_s`, `attempts` tries in all, then the error with the URL and the fix.
    slept.clear()
    calls.clear()
    monkeypatch.setitem(storage._RETRIES, "max_s", 2.0)
    with pytest.raises(storage.StorageError, match="s3://b/k: the storage server did not answer after"):
        storage.with_retries(lambda: flaky(99), "s3://b/k")
    assert len(calls) == storage._RETRIES["attempts"] == 6 and slept == [0.5, 1.0, 2.0, 2.0, 2.0]
    # A permanent error is raised at once, not retried.
    slept.clear()

    def gone():
        raise FileNotFoundError("gone")

    with pytest.raises(FileNotFoundError, match="s3://b/k: no such object"):
        storage.with_retries(gone, "s3://b/k")
    assert slept == []


def test_a_vanished_shard_is_counted_missing_and_a_dead_store_is_raised_not_counted(
    s3, tmp_path, monkeypatch
):
    from hype.io.tar import MISSING_SHARD, UNREADABLE_SHARD

    url = f"s3://{s3.bucket()}/pool/00000.tar"
    problems = Problems()
    assert list(read_samples(url, problems)) == []
    assert [r for r, _ in problems.seen] == [MISSING_SHARD] and url in problems.seen[0][1]

    # A store that does not answer: after the retries the error leaves the reader (the shard fails and
    # is retried by the executor) instead of being recorded as a damaged shard that was read.
    local = tmp_path / "00000.tar"
    write_tar(local, _tar_members(3))
    storage.upload(local, storage.location(url))
    monkeypatch.setitem(storage._RETRIES, "attempts", 2)
    monkeypatch.setitem(storage._RETRIES, "base_s", 0.05)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    # botocore's own retries of a refused connection (~9 s each time) are not what is tested: hype's are.
    no_boto_retries = {"config_kwargs": {"retries": {"max_attempts": 1}}}
    storage.configure({**s3.options, "endpoint_url": f"http://127.0.0.1:{dead}", **no_boto_retries})
    before, problems = storage.retry_count(), Problems()
    with pytest.raises(storage.StorageError, match="did not answer"):
        list(read_samples(url, problems))
    assert not [r for r, _ in problems.seen if r == UNREADABLE_SHARD]
    assert storage.retry_count() > before


def test_no_credentials_at_all_is_a_clear_error(s3, tmp_path, monkeypatch):
    for var in [v for v in os.environ if v.startswith("AWS_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to ask for
    storage.configure({"endpoint_url": s3.endpoint})
    with pytest.raises(storage.StorageError, match="no credentials found") as err:
        storage.list_sizes(f"s3://{s3.bucket()}/pool")
    assert "s3://" in str(err.value)
