"""What runs inside img2dataset's download workers (processes or Ray tasks), importable by name so that
pickles of it load there."""

from __future__ import annotations

import functools
import io
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from img2dataset import downloader as i2d_downloader
from img2dataset.downloader import Downloader

from hype.download.network import SCHEME_REFUSED, NetworkPolicy, install_guard
from hype.io import atomic_write, open_input, read_bytes, storage, sync_path

# What the guard must refuse whatever the policy allows; a data: url needs neither network nor disk.
PROBE_URL = "data:,hype-guard-probe"
TESTED = "img2dataset>=1.47,<1.48"  # the versions whose fetch path hype has checked (pyproject.toml)


_verified: urllib.request.OpenerDirector | None = None  # the opener this process has checked


class GuardNotInUse(RuntimeError):
    """img2dataset does not fetch through hype's guarded opener: downloading would be unguarded."""


def verify_guard(opener: urllib.request.OpenerDirector) -> None:
    """Fail closed unless img2dataset's own fetch function goes through `opener` (the installed guard):
    it must refuse a probe url that the guard refuses whatever the policy. A version of img2dataset that
    opened urls another way (its own opener, another HTTP library) would bypass every check."""
    try:
        _, stream, error = i2d_downloader.download_image((0, PROBE_URL), 1, None, None)
    except Exception as e:  # noqa: BLE001 - another signature, another behaviour: not the tested code
        stream, error = None, f"{type(e).__name__}: {e}"
    if stream is not None or SCHEME_REFUSED not in str(error) or urllib.request._opener is not opener:
        raise GuardNotInUse(
            "img2dataset does not fetch through hype's network guard (its download of the probe url "
            f"{PROBE_URL} was not refused by the guard: {error!r}); nothing was downloaded. hype is tested "
            f"with {TESTED}: install that version"
        )


class GuardedDownloader(Downloader):
    """img2dataset's Downloader that obeys a `NetworkPolicy` in whichever process runs it: img2dataset
    pickles the downloader into every worker, and the guard is installed there before the first fetch.

    A local shard is made durable in the order that counts: img2dataset writes the tar and the parquet,
    then the `_stats.json` that marks the shard done (for hype's summary and for both resumes), and
    syncs none of them; here the data files are synced when the writer closes (before the marker is
    written), then the marker and the folder, so a power cut never leaves a marker over a lost shard."""

    def __init__(
        self, *args, policy: NetworkPolicy, storage_options: Mapping[str, Any] | None = None, **kwargs
    ):
        super().__init__(*args, **kwargs)
        self.policy = policy
        # The driver's storage options travel with the downloader into every task (an argument, never the
        # environment or a Ray runtime_env): a worker on another node has no other way to get them, and
        # without them it would write with whatever credentials and endpoint that node has.
        self.storage_options = dict(storage_options or {})
        self.local = not storage.is_url(self.output_folder)
        self.sample_writer_class = functools.partial(_OrderedWriter, self.sample_writer_class)
        if self.local:
            self.sample_writer_class = functools.partial(_SyncedWriter, self.sample_writer_class)

    def __call__(self, row):
        global _verified
        configure_fsspec(self.storage_options, self.output_folder, row[1])  # OUT, the shard's input file
        opener = install_guard(self.policy)
        if _verified is not opener:  # once per process (and after a reinstall)
            verify_guard(opener)  # raised, not caught by img2dataset: the download stops
            _verified = opener
        return super().__call__(row)

    def download_shard(self, row):
        super().download_shard(row)
        if self.local:
            name = f"{row[0]:0{self.oom_shard_count}d}_stats.json"
            sync_path(Path(self.output_folder) / name)
            sync_path(self.output_folder)


def protocols(*paths: Any) -> list[str]:
    """The fsspec protocols of the URLs among `paths` (local paths have none)."""
    found = set()
    for path in paths:
        if storage.is_url(path):
            protocol = storage.location(path).protocol
            found.add(protocol if isinstance(protocol, str) else protocol[0])
    return sorted(found)


def configure_fsspec(options: Mapping[str, Any], *paths: Any) -> None:
    """Worker side: the driver's storage `options` become this process's, and fsspec's defaults for the
    protocols of `paths`, since img2dataset opens its files through fsspec itself."""
    import fsspec.config

    storage.configure(options)
    for protocol in protocols(*paths):
        fsspec.config.conf[protocol] = storage.options_for(protocol)


class _SyncedWriter:
    """Wraps an img2dataset sample writer: on close, the shard's files and their folder are synced."""

    def __init__(self, writer_class, shard_id, output_folder, *args, **kwargs):
        self.writer = writer_class(shard_id, output_folder, *args, **kwargs)
        self.folder = Path(output_folder)
        self.stem = f"{shard_id:0{self.writer.oom_shard_count}d}"

    def write(self, *args, **kwargs):
        return self.writer.write(*args, **kwargs)

    def close(self) -> None:
        self.writer.close()
        for path in sorted(self.folder.glob(f"{self.stem}.*")):  # .tar and .parquet (or other formats')
            sync_path(path)
        sync_path(self.folder)


class _OrderedWriter:
    """Wraps an img2dataset webdataset sample writer so that a shard holds its samples in metadata order
    whatever the thread count: img2dataset writes them as their downloads finish. On close (before the
    shard's `_stats.json` marks it done) the tar's members are rewritten sorted by key (the zero-padded
    row position, so metadata order) with a fixed mtime, and the parquet's rows sorted the same way; the
    same pool then gives the same shard bytes with 1 or 128 threads. One member is in memory at a time."""

    def __init__(self, writer_class, shard_id, output_folder, *args, **kwargs):
        self.writer = writer_class(shard_id, output_folder, *args, **kwargs)
        self.oom_shard_count = self.writer.oom_shard_count
        self.base = f"{str(output_folder).rstrip('/')}/{shard_id:0{self.oom_shard_count}d}"

    def write(self, *args, **kwargs):
        return self.writer.write(*args, **kwargs)

    def close(self) -> None:
        self.writer.close()
        reorder_shard(self.base + ".tar", self.base + ".parquet")


def reorder_shard(tar: str, parquet: str) -> None:
    """Rewrite a webdataset tar and its img2dataset parquet in key order (see `_OrderedWriter`)."""
    import pyarrow.parquet as pq

    table = pq.read_table(io.BytesIO(read_bytes(parquet)))  # a shard's parquet: one row per sample
    if "key" in table.column_names:
        table = table.sort_by("key")
        _replace(parquet, lambda f: pq.write_table(table, f, row_group_size=100))  # img2dataset's buffer size
    _replace(tar, lambda f: _sorted_tar(tar, f))


def _sorted_tar(src: str, dst) -> None:
    import tarfile

    with open_input(src) as raw, tarfile.open(fileobj=raw, mode="r:") as tin:
        members = tin.getmembers()
        # webdataset's key is the name up to its first dot; stable within a key (jpg, txt, json as written)
        order = sorted(range(len(members)), key=lambda i: (members[i].name.split(".", 1)[0], i))
        with tarfile.open(fileobj=dst, mode="w:") as tout:  # webdataset's TarWriter: the default format
            for i in order:
                info = members[i]
                info.mtime = 0  # the download's clock is no part of the sample (webdataset's float
                info.pax_headers = {k: v for k, v in info.pax_headers.items() if k != "mtime"}  # goes too)
                tout.addfile(info, tin.extractfile(info))


def _replace(path: str, write) -> None:
    """Write `path` anew through `write(file)` with hype's atomic writer (a crash leaves the old file
    whole; on object storage one upload replaces the object)."""
    with atomic_write(path, "wb") as f:
        write(f)
