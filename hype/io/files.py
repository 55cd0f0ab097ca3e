"""Files: the one way in (`open_input`) and the one way out (`atomic_write`), and the helpers on them.

Every output is written to a hidden temporary name in its folder (`.<name>.tmp-<pid>-<8 hex>`), flushed,
fsynced and renamed over the target, so a reader sees the old file or the new one, never part of one; a
write that fails or is killed leaves at most a temporary, which `is_temp_name` recognises and the commands
delete on their next run. A completion marker (`_stats.json`, `meta.json`, ...) is written the same way
and last, after the data it vouches for. Files get the user's default mode (0666 minus the umask), also
when a library writes the temporary itself (`atomic_path`).

Paths go through these two functions only, so a later object-storage layer (fsspec URLs) plugs in here,
not in the stages.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from os import PathLike
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

TMP_TAG = ".tmp-"
_DIGESTS: dict[str, Callable[[], Any]] = {
    "sha256": hashlib.sha256,  # what a user can check with sha256sum: checkpoints, subsets, submissions
    "blake2b-128": lambda: hashlib.blake2b(digest_size=16),  # the scoring run directory's fingerprints
}


# --- in and out -----------------------------------------------------------------------------------


def open_input(path: str | PathLike, mode: str = "rb") -> IO:
    """Open a file for reading (the one place where inputs are opened)."""
    if "r" not in mode or any(c in mode for c in "wax+"):
        raise ValueError(f"open_input opens for reading only, got mode {mode!r}")
    return open(path, mode)


def temp_name(path: str | PathLike) -> Path:
    """A fresh temporary name next to `path`: hidden, unique per process and call."""
    path = Path(path)
    return path.with_name(f".{path.name}{TMP_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def is_temp_name(name: str) -> bool:
    """True for a temporary left by an interrupted write (also the older `.<name>.tmp` names)."""
    return name.startswith(".") and (TMP_TAG in name or name.endswith(".tmp"))


@contextmanager
def atomic_write(path: str | PathLike, mode: str = "wb", *, encoding: str | None = None) -> Iterator[IO]:
    """Write `path` atomically: yields a file open on a temporary name in the same folder; on a clean exit
    it is flushed, fsynced and renamed over `path`, on an error removed (the old `path`, if any, stays)."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_write writes whole files, mode 'wb' or 'w', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        with open(tmp, mode, encoding=encoding if "b" not in mode else None) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_path(path: str | PathLike) -> Iterator[Path]:
    """`atomic_write` for libraries that write a file by name (safetensors, a streaming Parquet writer, a
    copy or hard link): yields the temporary path; on a clean exit the file gets the user's default mode
    (safetensors creates 0600 files), is fsynced and renamed over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def sync(f: IO) -> None:
    """Flush a file open for writing or appending down to the disk (an append-only log's commit point)."""
    f.flush()
    os.fsync(f.fileno())


def replace_tree(tmp: str | PathLike, out: str | PathLike) -> None:
    """Move the finished folder `tmp` to `out`, replacing a previous `out`, so `out` only ever holds a
    complete tree (a crash between the two renames leaves the old tree as `.<out>.old`)."""
    tmp, out = Path(tmp), Path(out)
    if not out.exists():
        tmp.rename(out)
        return
    old = out.parent / f".{out.name}.old"
    if old.exists():
        shutil.rmtree(old)
    out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old)


def _umask() -> int:
    # os.umask can only be read by setting it, which races with threads creating files; Linux shows it here.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# --- formats --------------------------------------------------------------------------------------


def write_bytes(path: str | PathLike, data: bytes) -> Path:
    with atomic_write(path) as f:
        f.write(data)
    return Path(path)


def write_text(path: str | PathLike, text: str) -> Path:
    """UTF-8 text, written atomically."""
    return write_bytes(path, text.encode("utf-8"))


def json_text(obj: Any, *, indent: int | None = 2, sort_keys: bool = True, **dumps: Any) -> str:
    """`obj` as the commands write JSON files: indented, keys sorted unless asked otherwise, a final newline.
    `dumps` goes to json.dumps (default=, ensure_ascii=, allow_nan=)."""
    return json.dumps(obj, indent=indent, sort_keys=sort_keys, **dumps) + "\n"


def write_json(path: str | PathLike, obj: Any, **options: Any) -> Path:
    """Write `obj` as JSON atomically (`options`: see `json_text`)."""
    return write_text(path, json_text(obj, **options))


def read_json(path: str | PathLike) -> dict | None:
    """The JSON object in `path`, or None when it is missing, unreadable or not an object: a summary or
    marker cut short (by a user, or an interrupted copy) counts as absent, never as an error."""
    try:
        with open_input(path) as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def parquet_bytes(table: pa.Table, **options: Any) -> bytes:
    """The Parquet file of `table` (`options` go to pyarrow.parquet.write_table), in memory."""
    buf = io.BytesIO()
    pq.write_table(table, buf, **options)
    return buf.getvalue()


def write_parquet(path: str | PathLike, table: pa.Table, **options: Any) -> Path:
    """Write `table` as Parquet atomically (`options` go to pyarrow.parquet.write_table)."""
    with atomic_write(path) as f:
        pq.write_table(table, f, **options)
    return Path(path)


def save_npy(path: str | PathLike, array: np.ndarray) -> Path:
    """np.save atomically, never pickling."""
    with atomic_write(path) as f:
        np.save(f, array, allow_pickle=False)
    return Path(path)


# --- digests --------------------------------------------------------------------------------------


def file_digest(path: str | PathLike, algorithm: str = "sha256") -> str:
    """Hex digest of a file's bytes, read in blocks (checkpoints and subsets can be gigabytes)."""
    with open_input(path) as f:
        return hashlib.file_digest(f, _DIGESTS[algorithm]).hexdigest()


def bytes_digest(data: bytes, algorithm: str = "sha256") -> str:
    """Hex digest of `data`, with the same algorithms as `file_digest`."""
    h = _DIGESTS[algorithm]()
    h.update(data)
    return h.hexdigest()
