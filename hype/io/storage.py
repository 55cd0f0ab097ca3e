"""Where files live: local paths and fsspec URLs (s3://, gs://, hf://, ...), behind one set of functions.

Every command names its inputs and outputs as strings; `location()` turns one into a `pathlib.Path`
(local: the fast path, unchanged) or a `upath.UPath` (a URL, on fsspec). The rest of `hype.io` takes
either, so the stages never ask which they hold. What object stores lack, and how it is made up for:

- No atomic rename. A remote file is written to a local temporary first and uploaded in one PUT (or one
  completed multipart upload) under its final name only when complete (`hype.io.files.atomic_write`); a
  write that fails or is killed leaves no object, and the completion marker is uploaded last as before.
- No advisory locks. `create_exclusive` is a conditional create (S3 `If-None-Match: *`), the one
  primitive the run directory's lock needs (see `hype.io.lock`).
- No cheap stat. `list_sizes(folder)` lists a folder once (one LIST call per 1000 names), so resuming a
  run reads one listing per stage instead of stat-ing every marker.
- A network. Sequential reads (pool shards) go through `RemoteStream`: a background thread fetches the
  next chunks while the caller decodes the current one (bounded memory: `depth` chunks), and a transient
  error (5xx, throttling, connection reset, timeout) is retried with exponential backoff; retries are
  counted (`retry_count`) so a stage can record them in its shard stats. A missing object, a missing
  bucket or refused credentials are not transient: they raise at once with the URL in the message.

Credentials come from where each filesystem looks for them (for S3: the AWS_* environment variables,
`~/.aws`, instance roles; AWS_ENDPOINT_URL for another S3 server), or from `configure(options)`, which
`hype --storage-options JSON` and the HYPE_STORAGE_OPTIONS environment variable call, over a config
file's `storage_options:` key (`configure_from_config`, from `hype.config.load`). They live in this
process's memory, travel to workers as an argument (`snapshot` / `configure`), and are never printed or
written into a run directory (a URL's string form carries none).
"""

from __future__ import annotations

import io
import json
import os
import queue
import re
import selectors
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from upath import UPath

    AnyPath = Path | UPath
else:
    AnyPath = Any

T = TypeVar("T")
ENV_OPTIONS = "HYPE_STORAGE_OPTIONS"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_OPTIONS: dict[str, Any] = {}  # in effect: the config file's under the command line's
_CLI: dict[str, Any] = {}
_FROM_CONFIG: dict[str, Any] = {}
_RETRIES = {"attempts": 6, "base_s": 0.5, "max_s": 8.0}  # 0.5 + 1 + 2 + 4 + 8 s: rides out a restart
_retry_lock = threading.Lock()
_retry_total = 0


class StorageError(OSError):
    """A storage problem a user must fix (missing bucket, refused credentials): the message names the URL
    and the fix."""


# --- names --------------------------------------------------------------------------------------------


def is_url(path: str | PathLike | AnyPath) -> bool:
    """True for a URL on a filesystem other than the local one (`file://` counts as local)."""
    if isinstance(path, Path):
        return False
    if not isinstance(path, str):
        protocol = getattr(path, "protocol", None)
        if protocol is not None:
            return protocol not in ("", "file", "local")
        path = os.fspath(path)
    m = _SCHEME.match(path)
    return m is not None and m.group(1).lower() not in ("file", "local")


def location(path: str | PathLike | AnyPath) -> AnyPath:
    """`path` as a path object: `pathlib.Path` for a local path (or `file://` URL), `UPath` for a URL,
    with this process's storage options."""
    if isinstance(path, Path):
        return path
    if not isinstance(path, str) and hasattr(path, "protocol"):  # a UPath already
        return path if is_url(path) else Path(path.path)
    text = os.fspath(path)
    if not is_url(text):
        return Path(text[len("file://") :] if text.startswith("file://") else text)
    from upath import UPath

    protocol = _SCHEME.match(text).group(1).lower()
    return UPath(text, **options_for(protocol))


def absolute(path: str | PathLike) -> str:
    """A URL as given; a local path made absolute (`~` expanded), so workers find it from any folder."""
    text = os.fspath(path)
    return text if is_url(text) else str(Path(text).expanduser().resolve())


def join(base: str | PathLike | AnyPath, *parts: str) -> AnyPath:
    out = location(base)
    for part in parts:
        out = out / part
    return out


def display(path: str | PathLike | AnyPath) -> str:
    """How messages name a path: the URL, or the local path as given."""
    return str(path)


# --- options ------------------------------------------------------------------------------------------


def _parse_options(options: Mapping[str, Any] | str | None, where: str) -> dict[str, Any]:
    if isinstance(options, str):
        try:
            options = json.loads(options) if options.strip() else {}
        except ValueError as e:
            raise StorageError(
                f'{where} are not valid JSON ({e}); pass e.g. \'{{"endpoint_url": "http://127.0.0.1:9000"}}\''
            ) from None
    if options is not None and not isinstance(options, Mapping):
        raise StorageError(f"{where} must be a JSON object (a mapping), e.g. '{{\"anon\": true}}'")
    return dict(options or {})


def _merge(low: Mapping[str, Any], high: Mapping[str, Any]) -> dict[str, Any]:
    """`high` over `low`; a protocol section (`{"s3": {...}}`) present in both is merged key by key."""
    out = dict(low)
    for k, v in high.items():
        out[k] = {**out[k], **v} if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def configure(options: Mapping[str, Any] | str | None) -> None:
    """Set the storage options of this process (a dict or its JSON): `hype --storage-options`,
    HYPE_STORAGE_OPTIONS, a worker's copy of the driver's. Keys are fsspec's, passed to every URL's
    filesystem; a key naming a protocol (`{"s3": {...}, "gs": {...}}`) holds options for that one.
    They win over a config file's `storage_options` (`configure_from_config`)."""
    global _CLI, _OPTIONS
    _CLI = _parse_options(options, "storage options")
    _OPTIONS = _merge(_FROM_CONFIG, _CLI)


def configure_from_config(options: Mapping[str, Any] | None) -> None:
    """Set the options a command's config file gives under `storage_options:` (hype.config.load calls
    this and drops the key, so the options never reach a saved config). `configure`'s options win."""
    global _FROM_CONFIG, _OPTIONS
    _FROM_CONFIG = _parse_options(options, "storage_options")
    _OPTIONS = _merge(_FROM_CONFIG, _CLI)


def configure_from_env() -> None:
    """Read HYPE_STORAGE_OPTIONS (JSON) if set; the CLI's --storage-options wins over it."""
    if os.environ.get(ENV_OPTIONS):
        configure(os.environ[ENV_OPTIONS])


# A forked child (a process pool's worker, a DataLoader's) inherits the driver's fsspec event loop as an
# object, not its thread, and the driver's s3fs instances with their open connections. The child's first
# s3fs use drops those instances from fsspec's cache, and their finalizer closes each connection through
# that loop: its selector's epoll is the driver's own (a forked descriptor names the same kernel object),
# so every close removed a live driver connection from the driver's epoll, and the driver's next request
# on it waited out the read timeout (15 s) before botocore retried it. The child gets a selector of its
# own and a loop that is not running, so the finalizer closes the child's copies of the sockets only.
_FORKED_LOOP: list[Any] = []


def _before_fork() -> None:
    asyn = sys.modules.get("fsspec.asyn")
    _FORKED_LOOP[:] = [asyn.loop[0]] if asyn is not None and asyn.loop[0] is not None else []


def _after_fork_in_child() -> None:
    for loop in _FORKED_LOOP:  # fsspec imported asyncio; no import in a child just forked
        if isinstance(loop, sys.modules["asyncio"].selector_events.BaseSelectorEventLoop):  # fsspec's kind
            loop._selector = selectors.DefaultSelector()  # unregistering here no longer reaches the driver's
            loop._thread_id = None  # its thread stayed in the driver: not running here
    _FORKED_LOOP.clear()


os.register_at_fork(
    before=_before_fork, after_in_parent=_FORKED_LOOP.clear, after_in_child=_after_fork_in_child
)


def snapshot() -> dict[str, Any]:
    """This process's storage options, for a worker process (`configure(snapshot)` there)."""
    return dict(_OPTIONS)


def options_for(protocol: str) -> dict[str, Any]:
    """fsspec options for one protocol: the flat options plus those under the protocol's own key."""
    import fsspec

    known = set(fsspec.available_protocols())
    flat = {k: v for k, v in _OPTIONS.items() if not (k in known and isinstance(v, Mapping))}
    opts = {**flat, **dict(_OPTIONS.get(protocol) or {})}
    if protocol in ("s3", "s3a"):
        # Several processes write one run directory: a cached listing would hide their files.
        opts.setdefault("use_listings_cache", False)
        if "endpoint_url" in opts:  # s3fs takes it inside client_kwargs
            opts.setdefault("client_kwargs", {})
            opts["client_kwargs"] = {**opts["client_kwargs"], "endpoint_url": opts.pop("endpoint_url")}
    return opts


_ARROW_FS: dict[str, Any] = {}
_ARROW_KEYS = {"key", "secret", "token", "anon", "client_kwargs", "use_listings_cache", "region"}


def arrow_filesystem(path: str | PathLike | AnyPath) -> tuple[Any, str] | None:
    """(pyarrow's native filesystem, path in it) for an s3:// URL whose options it understands, else None.

    For column reads of Parquet files (the scores table): Arrow's C++ S3 client reads the byte ranges of
    the columns concurrently, without the GIL, 1.5-1.8x faster than s3fs on the same objects. It finds
    credentials where boto does (AWS_* variables, ~/.aws, instance roles); options it has no equivalent
    for (a profile, other client settings) keep the read on fsspec."""
    p = location(path)
    if not is_url(p) or p.protocol not in ("s3", "s3a"):
        return None
    opts = options_for(p.protocol)
    client = dict(opts.get("client_kwargs") or {})
    if set(opts) - _ARROW_KEYS or set(client) - {"endpoint_url", "region_name"}:
        return None
    kw: dict[str, Any] = {}
    if opts.get("key"):
        kw.update(access_key=opts["key"], secret_key=opts.get("secret"), session_token=opts.get("token"))
    if opts.get("anon"):
        kw["anonymous"] = True
    endpoint = (
        client.get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
    )
    if endpoint:
        scheme, _, host = endpoint.partition("://")
        kw.update(endpoint_override=host.rstrip("/"), scheme=scheme)
    region = client.get("region_name") or opts.get("region")
    cache_key = json.dumps(kw, sort_keys=True, default=str) + f"|{region}"
    if cache_key not in _ARROW_FS:
        try:
            from pyarrow import fs as pafs

            if region is None and not endpoint:  # AWS itself: the bucket's own region
                region = pafs.resolve_s3_region(p.path.split("/", 1)[0])
            _ARROW_FS[cache_key] = pafs.S3FileSystem(region=region, **kw)
        except Exception:  # noqa: BLE001 - no native client for these settings: fsspec reads it
            _ARROW_FS[cache_key] = None
    native = _ARROW_FS[cache_key]
    return None if native is None else (native, p.path)


def fs_path(path: AnyPath) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) of a URL's `UPath`."""
    return path.fs, path.path


# --- errors and retries -------------------------------------------------------------------------------


def is_transient(error: BaseException) -> bool:
    """Worth another try: connection problems, timeouts, 5xx and throttling; not a missing object,
    refused credentials, a missing bucket or a bad request."""
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    text = f"{type(error).__module__}.{type(error).__name__}: {error}".lower()
    permanent = ("accessdenied", "signature", "invalidaccesskeyid", "nosuchbucket", "condition")
    if any(p in text for p in permanent):
        return False
    markers = (
        "aiohttp",
        "botocore.exceptions.endpoint",
        "connect",
        "timeout",
        "timed out",
        "reset",
        "slowdown",
        "throttl",
        "503",
        "500",
        "502",
        "504",
        "internalerror",
        "internal error",  # s3fs turns InternalError into OSError(EREMOTEIO, "... internal error ...")
        "please try again",
        "serviceunavailable",
        "broken pipe",
        "incomplete",
        "protocolerror",
        "serverdisconnected",
    )
    return any(m in text for m in markers)


def retry_count() -> int:
    """Transient errors retried by this process so far (a stage records the difference per shard)."""
    return _retry_total


def _count_retry() -> None:
    global _retry_total
    with _retry_lock:
        _retry_total += 1


def with_retries(call: Callable[[], T], what: str) -> T:
    """`call()`, retried with exponential backoff while it fails with a transient error."""
    delay = _RETRIES["base_s"]
    for attempt in range(1, int(_RETRIES["attempts"]) + 1):
        try:
            return call()
        except Exception as e:
            if attempt == _RETRIES["attempts"] or not is_transient(e):
                raise friendly_error(e, what) from e
            _count_retry()
            time.sleep(delay)
            delay = min(delay * 2, _RETRIES["max_s"])
    raise AssertionError("unreachable")


def friendly_error(error: BaseException, url: str) -> BaseException:
    """`error` with the URL and the fix in its message, where a user can fix it."""
    text = str(error)
    low = text.lower()
    if isinstance(error, StorageError):
        return error
    if "bucket does not exist" in low or "nosuchbucket" in low:
        return StorageError(f"{url}: the bucket does not exist; create it or fix the URL")
    if (
        isinstance(error, PermissionError)
        or "signature" in low
        or "accessdenied" in low
        or "access key" in low
    ):
        return StorageError(
            f"{url}: access refused by the storage server ({text}); check the credentials "
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, ~/.aws, or --storage-options)"
        )
    if "unable to locate credentials" in low or "nocredentials" in low:
        return StorageError(
            f"{url}: no credentials found for this store; set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or "
            "~/.aws, an instance role), pass --storage-options, or '{\"anon\": true}' for a public bucket"
        )
    if isinstance(error, FileNotFoundError):
        return FileNotFoundError(f"{url}: no such object")
    if is_transient(error):
        return StorageError(
            f"{url}: the storage server did not answer after retries ({type(error).__name__}: "
            f"{text}); check the endpoint and rerun (finished work is kept)"
        )
    return error


# --- operations on either kind of path ----------------------------------------------------------------


def exists(path: str | PathLike | AnyPath) -> bool:
    p = location(path)
    if not is_url(p):
        return p.exists()
    fs, key = fs_path(p)
    return with_retries(lambda: fs.exists(key), str(p))


def size(path: str | PathLike | AnyPath) -> int:
    p = location(path)
    if not is_url(p):
        return p.stat().st_size
    fs, key = fs_path(p)
    return int(with_retries(lambda: fs.size(key), str(p)))


def info(path: str | PathLike | AnyPath) -> dict[str, Any]:
    """{"size", "version", "etag"} of a file: "version" changes whenever it is rewritten (the modification
    time in ns locally, the ETag or the store's equivalent in a bucket); "etag" is None locally."""
    p = location(path)
    if not is_url(p):
        st = p.stat()
        return {"size": st.st_size, "version": st.st_mtime_ns, "etag": None}
    fs, key = fs_path(p)
    found = with_retries(lambda: fs.info(key), str(p))
    version = _version(found)
    return {"size": int(found.get("size") or 0), "version": version, "etag": version}


def check_reachable(path: str | PathLike | AnyPath) -> None:
    """Raise a `StorageError` naming the URL and the fix unless `path`'s bucket exists and the
    credentials are accepted (one small listing); local paths pass."""
    p = location(path)
    if not is_url(p):
        return
    fs, key = fs_path(p)
    try:
        with_retries(lambda: fs.ls(key, detail=False, refresh=True), str(p))
    except FileNotFoundError:  # the prefix holds nothing yet: the bucket is there (else StorageError)
        pass


def is_dir(path: str | PathLike | AnyPath) -> bool:
    p = location(path)
    if not is_url(p):
        return p.is_dir()
    fs, key = fs_path(p)
    return with_retries(lambda: fs.isdir(key), str(p))


def is_file(path: str | PathLike | AnyPath) -> bool:
    p = location(path)
    if not is_url(p):
        return p.is_file()
    fs, key = fs_path(p)
    return with_retries(lambda: fs.isfile(key), str(p))


def makedirs(path: str | PathLike | AnyPath) -> None:
    """Create a folder and its parents (object stores have no folders: nothing to do there)."""
    p = location(path)
    if not is_url(p):
        p.mkdir(parents=True, exist_ok=True)


def remove(path: str | PathLike | AnyPath, *, missing_ok: bool = True) -> None:
    p = location(path)
    if not is_url(p):
        p.unlink(missing_ok=missing_ok)
        return
    fs, key = fs_path(p)
    try:
        with_retries(lambda: fs.rm_file(key), str(p))
    except FileNotFoundError:
        if not missing_ok:
            raise


def remove_tree(path: str | PathLike | AnyPath) -> None:
    """Delete a folder and everything under it (nothing when it does not exist)."""
    import shutil

    p = location(path)
    if not is_url(p):
        shutil.rmtree(p, ignore_errors=True)
        return
    fs, key = fs_path(p)
    try:  # recursive: also the folder entries some stores keep (SeaweedFS, buckets with folder markers)
        with_retries(lambda: fs.rm(key, recursive=True), str(p))
    except FileNotFoundError:
        pass


def list_names(folder: str | PathLike | AnyPath) -> list[str]:
    """Sorted names of the files and folders directly in `folder` ([] when it does not exist)."""
    p = location(folder)
    if not is_url(p):
        try:
            return sorted(os.listdir(p))
        except (FileNotFoundError, NotADirectoryError):
            return []
    fs, key = fs_path(p)
    try:
        found = with_retries(lambda: fs.ls(key, detail=False, refresh=True), str(p))
    except FileNotFoundError:
        return []
    return sorted(n.rstrip("/").rsplit("/", 1)[-1] for n in found)


def list_sizes(folder: str | PathLike | AnyPath) -> dict[str, int]:
    """{name: size} of the files directly in `folder` (one listing; {} when it does not exist)."""
    return {name: f["size"] for name, f in list_files(folder).items()}


def files_with_suffix(folder: AnyPath, suffix: str) -> list[AnyPath]:
    """The files directly in `folder` whose names end in `suffix`, sorted by name (one listing): e.g. the
    `<hash>.parquet` files of a DataComp metadata folder."""
    return [folder / n for n in sorted(list_sizes(folder)) if n.endswith(suffix)]


def list_files(folder: str | PathLike | AnyPath) -> dict[str, dict[str, Any]]:
    """{name: {"size", "version"}} of the files directly in `folder`, from one listing ({} when it does
    not exist). "version" changes whenever a file is rewritten: the modification time locally, the
    ETag (or the store's equivalent) in a bucket."""
    p = location(folder)
    if not is_url(p):
        try:
            entries = [(e.name, e.stat()) for e in os.scandir(p) if e.is_file()]
        except (FileNotFoundError, NotADirectoryError):
            return {}
        return {name: {"size": st.st_size, "version": str(st.st_mtime_ns)} for name, st in entries}
    fs, key = fs_path(p)
    try:
        found = with_retries(lambda: fs.ls(key, detail=True, refresh=True), str(p))
    except FileNotFoundError:
        return {}
    return {
        e["name"].rstrip("/").rsplit("/", 1)[-1]: {"size": int(e.get("size") or 0), "version": _version(e)}
        for e in found
        if e.get("type") == "file"
    }


def _version(entry: Mapping[str, Any]) -> str | None:
    # S3: ETag; GCS: md5Hash / generation; the Hub: the blob id. Each changes with the content.
    keys = ("ETag", "etag", "md5Hash", "generation", "blob_id")
    found = next((entry[k] for k in keys if entry.get(k)), None)
    return str(found).strip('"') if found else None


def glob(pattern: str) -> list[str]:
    """Sorted matches of a glob pattern, as URLs for a URL pattern."""
    if not is_url(pattern):
        import glob as _glob

        return sorted(_glob.glob(pattern))
    return sorted(glob_files(pattern))


def glob_files(pattern: str) -> dict[str, int]:
    """{path: size} of the files a glob pattern matches (a URL pattern: one listing, no request per
    match), in sorted order."""
    if not is_url(pattern):
        import glob as _glob

        return {m: os.path.getsize(m) for m in sorted(_glob.glob(pattern)) if os.path.isfile(m)}
    p = location(pattern)
    fs, key = fs_path(p)
    found = with_retries(lambda: fs.glob(key, detail=True), pattern)
    files = {
        f"{p.protocol}://{k}": int(v.get("size") or 0) for k, v in found.items() if v.get("type") == "file"
    }
    return dict(sorted(files.items()))


def create_exclusive(path: str | PathLike | AnyPath, data: bytes) -> bool:
    """Create `path` holding `data` only if it does not exist; False if it does. Atomic on local disks
    (O_EXCL) and on S3 (a conditional PUT, `If-None-Match: *`, which AWS S3, MinIO, SeaweedFS and R2
    honour). On a filesystem without conditional writes it checks, then writes: two runs starting within
    the same second could both get through (documented in DESIGN)."""
    p = location(path)
    if not is_url(p):
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True
    fs, key = fs_path(p)
    if p.protocol in ("s3", "s3a") and hasattr(fs, "_call_s3"):
        from fsspec.asyn import sync

        bucket, _, name = key.partition("/")

        def put() -> bool:
            try:
                sync(fs.loop, fs._call_s3, "put_object", Bucket=bucket, Key=name, Body=data, IfNoneMatch="*")
            except OSError as e:
                if "condition" in str(e).lower() or "412" in str(e):  # PreconditionFailed: it exists
                    return False
                raise
            return True

        return with_retries(put, str(p))
    if with_retries(lambda: fs.exists(key), str(p)):
        return False
    with_retries(lambda: fs.pipe_file(key, data), str(p))
    return True


def upload(local: str | PathLike, path: AnyPath) -> None:
    """Copy a finished local file to `path` in one upload (retried: an upload is idempotent)."""
    fs, key = fs_path(path)
    with_retries(lambda: fs.put_file(os.fspath(local), key), str(path))


STREAMING_PROTOCOLS = ("s3", "s3a")  # multipart uploads that can be cancelled (s3fs' discard), tested


class StreamingUpload(io.RawIOBase):
    """A file open for writing to the URL `path` whose bytes go up while it is being written: a multipart
    upload in parts of `part_size`, sent by a background thread (the writer does not wait for the network
    unless `depth` parts are already queued). The object appears under its name only at `commit()`, which
    completes the upload (a file smaller than one part is a one-part upload). `abort()`, or a crash
    before `commit`, leaves no object: the store keeps an unfinished multipart upload, which it does not
    list and which a bucket's lifecycle rule for incomplete uploads deletes."""

    def __init__(self, path: AnyPath, *, part_size: int = 8 << 20, depth: int = 2):
        super().__init__()
        self.url = str(path)
        fs, key = fs_path(path)
        # autocommit off: closing the file (fsspec's finalizer does, at interpreter exit too) uploads what is
        # left but does not complete the upload; only `commit()` does.
        self._file = with_retries(
            lambda: fs.open(key, "wb", block_size=part_size, autocommit=False), self.url
        )
        self._part_size = part_size
        self._buffer = bytearray()
        self._written = 0
        self._parts: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._error: BaseException | None = None
        self._aborting = False
        self._sender = threading.Thread(target=self._send, name="hype-upload", daemon=True)
        self._sender.start()

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._written

    def write(self, b) -> int:
        self._raise_if_failed()
        n = len(memoryview(b).cast("B"))
        self._buffer += b
        self._written += n
        while len(self._buffer) >= self._part_size:
            self._parts.put(bytes(self._buffer[: self._part_size]))
            del self._buffer[: self._part_size]
        return n

    def commit(self) -> None:
        """Send the rest and complete the upload: the object is there, whole, when this returns."""
        self._parts.put(bytes(self._buffer))
        self._buffer = bytearray()
        self._stop()
        self._raise_if_failed()
        try:
            self._file.close()  # uploads the last part
            self._file.commit()  # completes the multipart upload
        except Exception as e:
            self._discard()
            raise friendly_error(e, self.url) from e
        super().close()

    def abort(self) -> None:
        """Cancel the upload; nothing appears under the name (idempotent)."""
        if self.closed:
            return
        self._aborting = True
        self._stop()
        self._discard()
        super().close()

    def close(self) -> None:
        """Without `commit` first, an abort: io's finalizer and writers that close their sink call this."""
        self.abort()

    def _send(self) -> None:
        while (part := self._parts.get()) is not None:
            if self._error is None and not self._aborting:
                try:
                    self._file.write(part)  # s3fs uploads a part whenever a block is full
                except BaseException as e:  # noqa: BLE001 - handed to the writer
                    self._error = e

    def _stop(self) -> None:
        if self._sender.is_alive():
            self._parts.put(None)
            self._sender.join()

    def _discard(self) -> None:
        try:
            self._file.discard()  # aborts the multipart upload, if one was started
        except Exception:  # noqa: BLE001 - the store forgets an unfinished upload by itself
            pass
        finally:
            self._file.closed = True  # so that fsspec's own finalizer never completes it

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error = self._error
            self.abort()
            raise friendly_error(error, self.url) from error


# --- reading ------------------------------------------------------------------------------------------


def download(path: AnyPath, local: str | PathLike) -> None:
    """Copy the object at `path` to the local file `local` (retried: a download is idempotent)."""
    fs, key = fs_path(path)
    with_retries(lambda: fs.get_file(key, os.fspath(local)), str(path))


def download_tree(path: AnyPath, local: str | PathLike) -> None:
    """Copy the folder at `path` (every object under it) into the local folder `local`."""
    fs, key = fs_path(path)
    with_retries(lambda: fs.get(key.rstrip("/") + "/", os.fspath(local), recursive=True), str(path))


def open_remote(path: AnyPath, *, stream: bool = False) -> io.BufferedIOBase:
    """A URL open for reading: a `RemoteStream` (read-ahead, counted retries) for sequential reads, else
    fsspec's own random-access file."""
    fs, key = fs_path(path)
    if stream:
        total = int(with_retries(lambda: fs.size(key), str(path)))
        return io.BufferedReader(RemoteStream(fs, key, total, url=str(path)), buffer_size=1 << 16)
    return with_retries(lambda: fs.open(key, "rb", block_size=4 << 20, cache_type="readahead"), str(path))


class RemoteStream(io.RawIOBase):
    """Reads an object front to back in `chunk`-byte ranges, `depth` of them fetched ahead by a thread.

    Seeking is allowed (tar readers check the end-of-archive marker): a seek inside the chunk at hand
    moves within it, any other seek restarts the read-ahead at the new position. Each range is retried
    on transient errors (`with_retries`); a permanent error (the object deleted meanwhile) is raised to
    the reader at the position where it happened.
    """

    def __init__(self, fs, key: str, total: int, *, url: str, chunk: int = 8 << 20, depth: int = 3):
        super().__init__()
        self.fs, self.key, self.total, self.url = fs, key, total, url
        self.chunk, self.depth = chunk, depth
        self.pos = 0  # the reader's position
        self._buf = b""
        self._buf_start = 0
        self._queue: queue.Queue | None = None
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    # io.RawIOBase
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = {io.SEEK_SET: offset, io.SEEK_CUR: self.pos + offset, io.SEEK_END: self.total + offset}[
            whence
        ]
        self.pos = max(0, target)
        if not (self._buf_start <= self.pos <= self._buf_start + len(self._buf)):
            self._halt()
            self._buf, self._buf_start = b"", self.pos
        return self.pos

    def readinto(self, b) -> int:
        if self.pos >= self.total:
            return 0
        if self.pos >= self._buf_start + len(self._buf):
            self._next_chunk()
        offset = self.pos - self._buf_start
        n = min(len(b), len(self._buf) - offset)
        b[:n] = self._buf[offset : offset + n]
        self.pos += n
        return n

    def close(self) -> None:
        self._halt()
        super().close()

    # the read-ahead
    def _next_chunk(self) -> None:
        if self._thread is None or self._buf_start + len(self._buf) != self.pos:
            self._start(self.pos)
        item = self._queue.get()
        if isinstance(item, BaseException):
            self._halt()
            raise item
        self._buf_start, self._buf = item

    def _start(self, start: int) -> None:
        self._halt()
        self._queue = queue.Queue(maxsize=self.depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._fetch, args=(start, self._queue, self._stop), daemon=True, name="hype-read-ahead"
        )
        self._thread.start()

    def _halt(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        while self._thread.is_alive():  # unblock a put on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                self._thread.join(0.05)
        self._thread = self._queue = self._stop = None

    def _fetch(self, start: int, out: queue.Queue, stop: threading.Event) -> None:
        pos = start
        while pos < self.total and not stop.is_set():
            end = min(self.total, pos + self.chunk)
            try:
                data = with_retries(lambda p=pos, e=end: self.fs.cat_file(self.key, start=p, end=e), self.url)
                if len(data) != end - pos:
                    raise StorageError(
                        f"{self.url}: got {len(data)} bytes for range {pos}-{end}: "
                        "the object changed while it was read"
                    )
            except BaseException as e:  # noqa: BLE001 - handed to the reader, raised there
                out.put(e)
                return
            out.put((pos, data))
            pos = end


def iter_chunks(path: AnyPath, chunk: int = 8 << 20) -> Iterator[bytes]:
    """The bytes of a URL in chunks, read ahead (for digests and copies)."""
    with open_remote(path, stream=True) as f:
        while block := f.read(chunk):
            yield block
