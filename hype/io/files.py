"""Files: the one way in (`open_input`) and the one way out (`atomic_write`), and the helpers on them.

Every output is written to a hidden temporary name in its folder (`.<name>.tmp-<pid>-<8 hex>`), flushed,
fsynced and renamed over the target, and then the folder itself is fsynced (the rename is an entry of the
folder: without it a power cut can undo a write that returned), so a reader sees the old file or the new
one, never part of one, and a file once written survives a crash; a
write that fails or is killed leaves at most a temporary, which `is_temp_name` recognises and the commands
delete on their next run. A completion marker (`_stats.json`, `meta.json`, ...) is written the same way
and last, after the data it vouches for. Files get the user's default mode (0666 minus the umask), also
when a library writes the temporary itself (`atomic_path`).

Paths go through these functions only, and each takes a local path or a URL (`hype.io.storage`): a URL
is read through fsspec, and written by uploading a finished local temporary in one request under its
final name (object stores have no rename), so the guarantee is the same: the old object or the new one.
"""

from __future__ import annotations

import errno
import io
import json
import multiprocessing.util
import os
import shutil
import stat
import tempfile
import tokenize
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from os import PathLike
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hype.io import storage

TMP_TAG = ".tmp-"


# --- in and out -----------------------------------------------------------------------------------


def open_input(path: str | PathLike | storage.AnyPath, mode: str = "rb", *, stream: bool = False) -> IO:
    """Open a file or URL for reading (the one place where inputs are opened). `stream`: it will be read
    front to back (a shard), so a URL is read ahead in a background thread with counted retries."""
    if "r" not in mode or any(c in mode for c in "wax+"):
        raise ValueError(f"open_input opens for reading only, got mode {mode!r}")
    p = storage.location(path)
    if not storage.is_url(p):
        return open(p, mode)
    f = storage.open_remote(p, stream=stream)
    return f if "b" in mode else io.TextIOWrapper(f, encoding="utf-8")


@contextmanager
def local_file(path: str | PathLike | storage.AnyPath) -> Iterator[Path]:
    """`path` as a local file for a library that opens files by name (safetensors, faiss, zip, torch):
    a local path as it is; a URL downloaded to a temporary file (same name at the end), deleted after."""
    p = storage.location(path)
    if not storage.is_url(p):
        yield p
        return
    folder = Path(tempfile.mkdtemp(prefix=".hype-download-"))
    tmp = folder / p.name
    try:
        storage.download(p, tmp)
        yield tmp
    finally:
        shutil.rmtree(folder, ignore_errors=True)


_CACHED: dict[tuple[str, str], Path] = {}


def cached_copy(path: str | PathLike | storage.AnyPath) -> Path:
    """`path` as a local file or folder that stays for the life of this process: a local path as it is;
    a URL (a checkpoint, an open_clip folder) downloaded once per process into a private temporary
    folder, removed at exit. For inputs several steps open by name (model config, digest, weights).
    Keyed by the URL and the storage options it is read with: the same name on another endpoint (or
    with other credentials) is another object."""
    p = storage.location(path)
    if not storage.is_url(p):
        return p
    # In memory only; the options (credentials too) are never written anywhere from here.
    key = (str(p), json.dumps(storage.options_for(p.protocol), sort_keys=True, default=repr))
    if key not in _CACHED or not _CACHED[key].exists():
        folder = Path(tempfile.mkdtemp(prefix=".hype-cache-"))
        # Removed at exit: multiprocessing's exit hook runs in this process at exit and also in a process
        # pool's worker, which ends without atexit (an atexit handler left every worker's copy behind).
        remove = {"ignore_errors": True}
        multiprocessing.util.Finalize(None, shutil.rmtree, args=(folder,), kwargs=remove, exitpriority=0)
        local = folder / p.name
        if storage.is_dir(p):
            storage.download_tree(p, local)
        else:
            storage.download(p, local)
        _CACHED[key] = local
    return _CACHED[key]


class UnsafePathError(OSError):
    """A name where hype creates its own file (a temporary, a lock) holds something else: a symbolic link,
    a hard link to another file, a folder. Never written through; the message names it and the fix."""


def create_own_file(path: str | PathLike, *, reuse: bool = False, mode: int = 0o666) -> int:
    """The one way hype creates a file of its own (a temporary, a lock): an fd open read-write on `path`,
    a new regular file (`O_EXCL`), never reached through a symbolic link (`O_NOFOLLOW`). `reuse`: an
    existing regular file with one name is taken over (a lock file its last holder left behind). A link
    planted at the name (in a shared folder, or a copied tree) would otherwise turn the write, or a lock's
    truncation, onto the file it points at; it is refused instead, and left as it is."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (0 if reuse else os.O_EXCL)
    try:
        fd = os.open(path, flags, mode)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.EEXIST, errno.EISDIR, errno.ENXIO):
            raise
        fd = None
    st = os.fstat(fd) if fd is not None else None
    if st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
        return fd
    if fd is not None:
        os.close(fd)
    raise _unsafe(path, "a hard link to another file" if st is not None and st.st_nlink > 1 else _kind(path))


def overlap(path: str | PathLike, folder: str | PathLike) -> str | None:
    """How `path` relates to `folder`, both as real local paths: "is", "lies in", "holds", or None when they
    are disjoint (what keeps a selection target or a proxy task set apart from the evaluation images)."""
    p, f = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    return "is" if p == f else "lies in" if p.is_relative_to(f) else "holds" if f.is_relative_to(p) else None


def check_own_folder(path: str | PathLike) -> None:
    """Refuse a name where hype keeps a folder of its own (a temporary tree, the previous tree it replaces)
    that holds something else: a symbolic link, whose target would be filled or deleted, or a file."""
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        raise _unsafe(path, _kind(path), "folder")


def _unsafe(path: str | PathLike, what: str, kind: str = "file") -> UnsafePathError:
    return UnsafePathError(
        f"{path}: {what} where hype creates its own {kind}; it was left untouched. "
        "Remove it (hype did not create it) and run again"
    )


def _kind(path: str | PathLike) -> str:
    try:
        st = os.lstat(path)
    except OSError:
        return "something hype cannot create"
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    return "a folder" if stat.S_ISDIR(st.st_mode) else "an existing file"


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
    if storage.is_url(path):
        with (
            _upload_on_success(path) as tmp,
            open(tmp, mode, encoding=encoding if "b" not in mode else None) as f,
        ):
            yield f
        return
    path = Path(path)
    make_folder(path.parent)
    tmp = temp_name(path)
    fd = create_own_file(tmp)
    try:
        with open(fd, mode, encoding=encoding if "b" not in mode else None) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        _rename_durably(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_path(path: str | PathLike) -> Iterator[Path]:
    """`atomic_write` for libraries that write a file by name (safetensors, a streaming Parquet writer, a
    copy or hard link): yields the temporary path; on a clean exit the file gets the user's default mode
    (safetensors creates 0600 files), is fsynced and renamed over `path`. For a URL the temporary is a
    local file, uploaded in one request on a clean exit."""
    if storage.is_url(path):
        with _upload_on_success(path) as tmp:
            yield tmp
        return
    path = Path(path)
    make_folder(path.parent)
    tmp = temp_name(path)
    os.close(create_own_file(tmp))  # taken as a new regular file: the library then writes into ours
    try:
        yield tmp
        if not stat.S_ISREG(os.lstat(tmp).st_mode):  # replaced behind our back: never published
            raise UnsafePathError(f"{tmp}: replaced by something other than the file hype wrote; not used")
        os.chmod(tmp, 0o666 & ~_umask())
        sync_path(tmp)
        _rename_durably(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_sink(path: str | PathLike) -> Iterator[Path | storage.StreamingUpload]:
    """Where a streaming writer (pyarrow's ParquetWriter, which takes a path or a file) should write
    `path`, atomically: a local temporary name (`atomic_path`), or for a URL of a store with cancellable
    multipart uploads a `storage.StreamingUpload`, so that the bytes go up while they are written instead
    of after. Either way the object appears whole on a clean exit and never after an error."""
    if not storage.is_url(path) or storage.location(path).protocol not in storage.STREAMING_PROTOCOLS:
        with atomic_path(path) as tmp:
            yield tmp
        return
    upload = storage.StreamingUpload(storage.location(path))
    try:
        yield upload
    except BaseException:
        upload.abort()
        raise
    upload.commit()


@contextmanager
def _upload_on_success(path: str | PathLike | storage.AnyPath) -> Iterator[Path]:
    """A local temporary file (keeping the target's name as suffix, for libraries that look at it),
    uploaded to the URL `path` only when the block exits cleanly, then deleted either way."""
    target = storage.location(path)
    fd, name = tempfile.mkstemp(prefix=".hype-upload-", suffix=f"-{target.name}")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        storage.upload(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def sync(f: IO) -> None:
    """Flush a file open for writing or appending down to the disk (an append-only log's commit point)."""
    f.flush()
    os.fsync(f.fileno())


def sync_path(path: str | PathLike) -> None:
    """fsync a local file or folder by name: a file's bytes, or a folder's entries (files created, renamed
    or removed in it), reach the disk. For files written by a library that does not sync them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_folder(folder: str | PathLike) -> None:
    """`mkdir -p folder`, durably: each folder it creates is synced into its parent, so that a file
    written into it and synced is not lost with a folder entry a power cut undid."""
    folder = Path(folder)
    if folder.is_dir():
        return
    missing = []
    p = folder
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    folder.mkdir(parents=True, exist_ok=True)
    for created in reversed(missing):
        sync_path(created.parent)


def _rename_durably(src: Path, dst: Path) -> None:
    os.replace(src, dst)
    sync_path(dst.parent)  # the rename is an entry of the folder: synced, it survives a power cut


def replace_tree(tmp: str | PathLike, out: str | PathLike) -> None:  # local folders only (hype synth)
    """Move the finished folder `tmp` to `out`, replacing a previous `out`, so `out` only ever holds a
    complete tree (a crash between the two renames leaves the old tree as `.<out>.old`); the renames are
    synced into the parent folder before the old tree is deleted."""
    tmp, out = Path(tmp), Path(out)
    if not out.exists():
        tmp.rename(out)
        sync_path(out.parent)
        return
    old = out.parent / f".{out.name}.old"
    check_own_folder(old)
    if old.exists():
        shutil.rmtree(old)
    out.rename(old)
    tmp.rename(out)
    sync_path(out.parent)
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
    return storage.location(path)


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
    return storage.location(path)


def read_bytes(path: str | PathLike | storage.AnyPath) -> bytes:
    """A whole file's bytes (a URL in one request, retried)."""
    p = storage.location(path)
    if not storage.is_url(p):
        return p.read_bytes()
    return storage.with_retries(lambda: p.fs.cat_file(p.path), str(p))


def read_parquet(
    path: str | PathLike | storage.AnyPath, columns: list[str] | None = None, **options: Any
) -> pa.Table:
    """A Parquet file (or only `columns` of it: a URL is read by ranges, the other columns stay behind);
    `options` go to pyarrow.parquet.read_table."""
    p = storage.location(path)
    if not storage.is_url(p):
        return pq.read_table(p, columns=columns, **options)

    def read() -> pa.Table:
        with open_input(p) as f:
            return pq.read_table(f, columns=columns, **options)

    return storage.with_retries(read, str(p))


def read_parquet_schema(path: str | PathLike | storage.AnyPath) -> pa.Schema:
    p = storage.location(path)
    if not storage.is_url(p):
        return pq.read_schema(p)

    def read() -> pa.Schema:
        with open_input(p) as f:
            return pq.read_schema(f)

    return storage.with_retries(read, str(p))


# What np.load raises for a damaged or hostile `.npy` (numpy parses the header dict with Python's tokenizer:
# an unterminated header is a tokenize.TokenError, a malformed one a SyntaxError, odd values TypeErrors).
NPY_ERRORS = (ValueError, EOFError, SyntaxError, TypeError, OverflowError, tokenize.TokenError)


def load_npy(path: str | PathLike | storage.AnyPath, *, mmap: bool = False) -> np.ndarray:
    """np.load of a `.npy`, never unpickling; `mmap` maps a local file (a URL is read into memory). A file
    that is not a readable `.npy` is a ValueError naming it."""
    p = storage.location(path)
    try:
        if not storage.is_url(p):
            return np.load(p, mmap_mode="r" if mmap else None, allow_pickle=False)
        return np.load(io.BytesIO(read_bytes(p)), allow_pickle=False)
    except NPY_ERRORS as e:
        raise ValueError(f"{p}: not a readable .npy file ({type(e).__name__}: {e})") from None


def save_npy(path: str | PathLike, array: np.ndarray) -> Path:
    """np.save atomically, never pickling."""
    with atomic_write(path) as f:
        np.save(f, array, allow_pickle=False)
    return storage.location(path)
