"""Byte-deterministic, atomic writers: tars, Parquet, JSON, text, and img2dataset shards.

Every file is written to a hidden temporary name next to its target and renamed into place, so a reader
never sees half a file. Tar members carry fixed metadata (mtime 0, uid/gid 0, no user names) and JSON is
written with sorted keys, so the same content always gives the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def write_bytes(path: Path, data: bytes) -> None:
    tmp = _tmp(path)
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_text(path: Path, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: Path, obj: object) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _ustar_header(name: str, size: int) -> bytes:
    """A POSIX ustar header with fixed metadata; the same bytes `tarfile` writes for such a member."""
    raw = name.encode("utf-8")
    if len(raw) > 100:
        raise ValueError(f"tar member name too long for ustar: {name!r}")
    head = b"".join(
        [
            raw.ljust(100, b"\0"),
            b"0000644\0",  # mode
            b"0000000\0",  # uid
            b"0000000\0",  # gid
            b"%011o\0" % size,
            b"00000000000\0",  # mtime
            b"        ",  # checksum placeholder
            b"0",  # regular file
            b"\0" * 100,  # linkname
            b"ustar\x0000",
            b"\0" * 64,  # uname, gname
            b"\0" * 16,  # devmajor, devminor: empty for regular files, as tarfile writes them
            b"\0" * 155,  # prefix
        ]
    ).ljust(BLOCK, b"\0")
    chksum = b"%06o\0 " % sum(head)
    return head[:148] + chksum + head[156:]


BLOCK = 512
RECORD = 20 * BLOCK


def write_tar(path: Path, members: Iterable[tuple[str, bytes]]) -> int:
    """Write `(name, data)` members in the given order; returns the number of members.

    Hand-rolled because `tarfile` spends more time building headers than writing our tiny files.
    """
    tmp = _tmp(path)
    n = 0
    written = 0
    with open(tmp, "wb") as f:
        for name, data in members:
            pad = -len(data) % BLOCK
            chunk = _ustar_header(name, len(data)) + data + b"\0" * pad
            f.write(chunk)
            written += len(chunk)
            n += 1
        end = 2 * BLOCK
        end += -(written + end) % RECORD
        f.write(b"\0" * end)
    os.replace(tmp, path)
    return n


def write_parquet(path: Path, table: pa.Table) -> None:
    tmp = _tmp(path)
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, path)


@dataclass(frozen=True)
class ShardSample:
    """One successfully 'downloaded' sample of an img2dataset shard."""

    key: str
    uid: str
    url: str
    caption: str
    jpeg: bytes
    width: int
    height: int

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.jpeg).hexdigest()


SHARD_PARQUET_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("uid", pa.string()),
        ("url", pa.string()),
        ("caption", pa.string()),
        ("status", pa.string()),
        ("error_message", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("original_width", pa.int32()),
        ("original_height", pa.int32()),
        ("sha256", pa.string()),
    ]
)


def sample_json(s: ShardSample, sha256: str) -> dict:
    return {
        "uid": s.uid,
        "key": s.key,
        "url": s.url,
        "caption": s.caption,
        "status": "success",
        "error_message": None,
        "width": s.width,
        "height": s.height,
        "original_width": s.width,
        "original_height": s.height,
        "sha256": sha256,
    }


def write_img2dataset_shard(folder: Path, shard: int, samples: Sequence[ShardSample]) -> dict:
    """`{shard:08d}.tar` + `.parquet` + `_stats.json` (written last: the completion marker).

    Returns the stats dict.
    """
    stem = f"{shard:08d}"
    shas = [s.sha256 for s in samples]
    members: list[tuple[str, bytes]] = []
    for s, sha in zip(samples, shas, strict=True):
        meta = json.dumps(sample_json(s, sha), sort_keys=True, ensure_ascii=False).encode("utf-8")
        members += [
            (f"{s.key}.jpg", s.jpeg),
            (f"{s.key}.txt", s.caption.encode("utf-8")),
            (f"{s.key}.json", meta),
        ]
    write_tar(folder / f"{stem}.tar", members)
    table = pa.table(
        {
            "key": [s.key for s in samples],
            "uid": [s.uid for s in samples],
            "url": [s.url for s in samples],
            "caption": [s.caption for s in samples],
            "status": ["success"] * len(samples),
            "error_message": [None] * len(samples),
            "width": [s.width for s in samples],
            "height": [s.height for s in samples],
            "original_width": [s.width for s in samples],
            "original_height": [s.height for s in samples],
            "sha256": shas,
        },
        schema=SHARD_PARQUET_SCHEMA,
    )
    write_parquet(folder / f"{stem}.parquet", table)
    stats = {
        "count": len(samples),
        "successes": len(samples),
        "failed_to_download": 0,
        "failed_to_resize": 0,
        "duration": 0,
        "start_time": 0,
        "end_time": 0,
        "status_dict": {"success": len(samples)} if samples else {},
    }
    write_json(folder / f"{stem}_stats.json", stats)
    return stats


class FileWriter:
    """Writes small files from a thread pool; leaving the `with` block waits for all of them.

    Creating a file is latency-bound on virtual and network file systems and releases the GIL, so many
    threads write several times faster than a loop, and overlap with the caller's own work.
    """

    def __init__(self, threads: int = 32):
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future] = []

    def __enter__(self) -> FileWriter:
        self._pool = ThreadPoolExecutor(self._threads)
        return self

    def write(self, path: Path, data: bytes) -> None:
        assert self._pool is not None, "use FileWriter in a with block"
        self._futures.append(self._pool.submit(path.write_bytes, data))

    def __exit__(self, *exc) -> None:
        assert self._pool is not None
        self._pool.shutdown(wait=True)
        for f in self._futures:
            f.result()  # re-raise the first write error, if any
