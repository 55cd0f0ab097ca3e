"""THE run-directory layout of `hype score`, shard ids, atomic writes and completion markers.

    RUN_DIR/
      config.yaml                       resolved config of the latest run
      plan.json                         the input shards: index, path as given, shard id
      summary.json                      status (running | complete | failed), counts, skips, timings
      embed/<id>.parquet                per-shard embeddings and pair scores (see hype.scoring.embed_format)
      embed/<id>_stats.json             completion marker + metrics of that shard
      dedup/duplicates.parquet (+ .json)        rows whose uid already appeared in an earlier shard
      reference/top_n.safetensors (+ .json)     the N pairs with the highest cos θ (selection step 1)
      reference/<id>.parquet, <id>_stats.json   mean L_e of each image/text against them (step 2)
      reference.safetensors (+ reference.json)  S_i and S_t (tangent vectors), selected or copied
      specificity/<id>.parquet, <id>_stats.json ε_i, ε_t
      classes/<id>.parquet, <id>_stats.json     CLIP features of --class-images
      captions/<id>.parquet, <id>_stats.json    DataComp's caption filter (c_IN, k-means training rows)
      clusters/centroids.npy, targets.npy (+ model.json)   k-means centroids and c_IN targets
      clusters/<id>.parquet, <id>_stats.json    nearest centroid, caption filter, c_IN
      metadata/index.npy (+ index.json)         uid -> (metadata file, row, cos θ) with --metadata
      scores/part-<index:08d>.parquet           THE scores table (hype.scoring.schema)
      merge/<id>_stats.json                     completion markers of the score parts

A shard id is `<tar stem>-<8 hex of blake2b(absolute tar path)>`: readable, unique per input path, and
stable across reruns, so resume state is keyed on the input tar path (DESIGN §4.1).

Every file is written to a temporary name in its folder, fsynced and renamed (`hype.io`), and a stage's
`_stats.json` (or `.json`) marker is written after its data. A marker records a fingerprint of
everything the output depends on (input file identity, upstream output digests, the settings that
change results); an output counts as done only when its marker's fingerprint matches, so a rerun
skips finished work and redoes exactly what changed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

import pyarrow as pa

import hype.io as hype_io
from hype.io import is_temp_name, read_json
from hype.scoring.schema import scores_dir

SHARD_STAGES = ("embed", "reference", "specificity", "classes", "captions", "clusters", "merge")
RUN_DIGEST = "blake2b-128"  # recorded in markers' fingerprints: changing it would redo every finished output
# Parquet writer settings are fixed here so that identical tables give identical bytes.
_PARQUET_OPTS = {"compression": "snappy", "row_group_size": 1 << 20, "write_statistics": True}


class RunDirError(RuntimeError):
    """A run directory that cannot be used (locked by another run, unwritable)."""


@dataclass(frozen=True)
class ShardTask:
    """One input shard: the unit of work, retry, resume and metrics (DESIGN §4.1)."""

    index: int  # position in the pool's shard list (shard order)
    path: str  # the tar as given (stored in the scores table's `shard` column)
    shard_id: str
    source: str = ""  # absolute path: what workers read, whatever their working directory

    def __post_init__(self) -> None:
        if not self.source:
            object.__setattr__(self, "source", str(Path(self.path).resolve()))


def shard_id(path: str | PathLike) -> str:
    """`<stem>-<8 hex>` from the absolute path of an input tar."""
    p = Path(path)
    digest = hashlib.blake2b(str(p.resolve()).encode(), digest_size=4).hexdigest()
    stem = p.name[: -len(".tar")] if p.name.endswith(".tar") else p.stem
    return f"{stem}-{digest}"


def make_tasks(paths: Iterable[str]) -> list[ShardTask]:
    return [ShardTask(i, p, shard_id(p), str(Path(p).resolve())) for i, p in enumerate(paths)]


def file_identity(path: str | PathLike) -> dict:
    """What identifies an input file's content cheaply: absolute path, size, modification time."""
    st = os.stat(path)
    return {"path": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def file_digest(path: str | PathLike) -> str:
    """The run directory's digest of a file (model files, class features, its own outputs)."""
    return hype_io.file_digest(path, RUN_DIGEST)


def fingerprint(obj: Any) -> str:
    """Digest of a JSON-able description of everything an output depends on."""
    return hashlib.blake2b(json.dumps(obj, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()


# --- atomic writes (hype.io), in the run directory's JSON and Parquet style -----------------------


def atomic_write_bytes(path: str | PathLike, data: bytes) -> Path:
    """Write `data` to a temporary file next to `path`, fsync it and rename it over `path`."""
    return hype_io.write_bytes(path, data)


def atomic_write_json(path: str | PathLike, obj: Any) -> Path:
    return hype_io.write_json(path, obj, default=str)


def parquet_bytes(table: pa.Table) -> bytes:
    return hype_io.parquet_bytes(table, **_PARQUET_OPTS)


def write_parquet(path: str | PathLike, table: pa.Table) -> dict:
    """Write a table atomically; return `{"file", "rows", "bytes", "digest"}` for the stage's marker."""
    data = parquet_bytes(table)
    atomic_write_bytes(path, data)
    return {
        "file": Path(path).name,
        "rows": table.num_rows,
        "bytes": len(data),
        "digest": hype_io.bytes_digest(data, RUN_DIGEST),
    }


# --- the layout -----------------------------------------------------------------------------------


class RunDir:
    """Paths of one run directory (see the module docstring)."""

    def __init__(self, root: str | PathLike):
        self.root = Path(root)

    def __reduce__(self):  # small and picklable: travels to Ray actors
        return (RunDir, (str(self.root),))

    # files
    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def reference(self) -> Path:
        return self.root / "reference.safetensors"

    @property
    def reference_marker(self) -> Path:
        return self.root / "reference.json"

    @property
    def top_n(self) -> Path:
        return self.root / "reference" / "top_n.safetensors"

    @property
    def duplicates(self) -> Path:
        return self.root / "dedup" / "duplicates.parquet"

    @property
    def centroids(self) -> Path:
        return self.root / "clusters" / "centroids.npy"

    @property
    def targets(self) -> Path:
        return self.root / "clusters" / "targets.npy"

    @property
    def clusters_marker(self) -> Path:
        return self.root / "clusters" / "model.json"

    @property
    def metadata_index(self) -> Path:
        return self.root / "metadata" / "index.npy"

    @property
    def scores(self) -> Path:
        return scores_dir(self.root)

    def marker_of(self, artifact: Path) -> Path:
        """`x.parquet` / `x.safetensors` / `x.npy` -> `x.json`."""
        return artifact.with_suffix(".json")

    # per-shard outputs
    def shard_output(self, stage: str, task: ShardTask) -> Path:
        if stage == "merge":
            return self.scores / f"part-{task.index:08d}.parquet"
        return self.root / stage / f"{task.shard_id}.parquet"

    def shard_stats(self, stage: str, task: ShardTask) -> Path:
        return self.root / stage / f"{task.shard_id}_stats.json"

    def debug_dir(self) -> Path:
        return self.root / "debug"

    # lifecycle
    def create(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for stage in SHARD_STAGES:
                (self.root / stage).mkdir(exist_ok=True)
            for sub in ("scores", "dedup", "metadata"):
                (self.root / sub).mkdir(exist_ok=True)
        except OSError as e:
            raise RunDirError(f"{self.root}: cannot create the run directory ({e})") from e

    def remove_stale_temporaries(self) -> int:
        """Delete temporary files left by a killed run (call only while holding the lock)."""
        n = 0
        for folder in (self.root, *(self.root / d for d in (*SHARD_STAGES, "scores", "dedup", "metadata"))):
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            for entry in entries:
                if is_temp_name(entry.name):
                    Path(entry.path).unlink(missing_ok=True)
                    n += 1
        return n

    def lock(self) -> RunLock:
        return RunLock(self.root / ".lock")


class RunLock:
    """An exclusive advisory lock so two `hype score` drivers never write one run directory at once."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = Path(self.path).read_text().strip() or "?"
            os.close(self._fd)
            self._fd = None
            raise RunDirError(
                f"{self.path.parent}: another `hype score` (pid {holder}) is running on this run directory; "
                "wait for it or use another --out"
            ) from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, str(os.getpid()).encode())
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def completed(marker: Path, expected_fingerprint: str, output: Path | None = None) -> dict | None:
    """The marker's content when it records `expected_fingerprint` and its output file is intact."""
    stats = read_json(marker)
    if stats is None or stats.get("fingerprint") != expected_fingerprint:
        return None
    if output is not None:
        want = (stats.get("output") or {}).get("bytes")
        try:
            if want is None or output.stat().st_size != want:
                return None
        except OSError:
            return None
    return stats
