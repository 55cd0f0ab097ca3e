"""Byte-deterministic writers of the synthetic world: img2dataset shards, and its JSON and Parquet style.

Files are written atomically by `hype.io`; tars by `hype.io.tar.write_tar`, whose members carry fixed
metadata (mtime 0, uid/gid 0, no user names); JSON is written with sorted keys. So the same content always
gives the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

import hype.io as hype_io
from hype.io.tar import write_tar


def write_json(path: Path, obj: object) -> None:
    hype_io.write_json(path, obj, ensure_ascii=False)


def write_parquet(path: Path, table: pa.Table) -> None:
    hype_io.write_parquet(path, table, compression="zstd")


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
    extra: dict | None = None  # more keys of the sample's JSON (GRIT's grounding)

    @property
    def sha256(self) -> str:
        return hype_io.sha256_bytes(self.jpeg)


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
        **(s.extra or {}),
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
