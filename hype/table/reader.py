"""Reading the scores table (`RUN_DIR/scores/part-*.parquet`, see `hype.table.schema`) in bounded memory.

The table is read in units of one Parquet row group, a few at a time on a small thread pool (Parquet
decoding releases the GIL), in a fixed order, so every pass over it sees the same rows in the same order
whatever the thread count. Only the columns a pass needs are read. Each batch is checked as it arrives:
metric values must be finite and non-null, and the error names the file, column, row and uid.

A table in a bucket is read so that each column leaves the bucket once per selection: a pass asked to
`spool` keeps the columns it downloaded in a local, memory-mapped Arrow IPC file (one record batch per
unit; ~4 bytes per row and float32 column, under `TMPDIR`), and later passes take those columns from it
and only the others (the uids) from the bucket. Footers are read once, when the table is opened (from a
bucket, all parts' footers from one cached object, `select_cache/footers-<key>.parquet`, when a previous
command left it). A local table is its own spool: nothing is copied.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from os import PathLike
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hype.data.errors import SelectError
from hype.data.uids import UidError, arrow_to_pairs
from hype.io import parquet_bytes, read_bytes, sha256_chunks, storage, write_bytes
from hype.io.runs import input_identity
from hype.io.storage import AnyPath
from hype.table.schema import METRICS, SCHEMA, scores_dir

NUMERIC_COLUMNS = (*METRICS, "width", "height")
# Rows per pass of the dedup across several runs (24 bytes each while a pass sorts them), as `hype score`'s.
ROWS_PER_PASS = 50_000_000
# A damaged part of a `hype score` run: the rerun checks every part against the digest its marker records
# and rewrites the damaged ones.
_REPAIR = (
    "rerun the same `hype score` command (or `hype score --config RUN_DIR/config.yaml`): it rewrites "
    "damaged parts"
)


@dataclass(frozen=True)
class _Unit:
    path: str
    row_group: int
    num_rows: int
    first_row: int  # global index of the unit's first row


class Batch:
    """One row group of the scores table: the columns a pass asked for, as NumPy on demand."""

    def __init__(self, data: pa.RecordBatch | pa.Table, source: str, first_row: int):
        self.data = data
        self.source = source
        self.first_row = first_row
        self._cache: dict[str, object] = {}

    def __len__(self) -> int:
        return self.data.num_rows

    def arrow(self, name: str) -> pa.Array:
        col = self.data.column(name)
        if isinstance(col, pa.ChunkedArray):
            col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
        return col

    def numeric(self, name: str) -> np.ndarray:
        """A numeric column as float64; nulls and non-finite values were rejected when the batch was read
        (metrics) or are NaN here (width/height, which rules treat as unknown)."""
        if name not in self._cache:
            col = self.arrow(name)
            if col.null_count:
                col = col.cast(pa.float64()).fill_null(float("nan"))
            self._cache[name] = col.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
        return self._cache[name]  # type: ignore[return-value]

    def raw(self, name: str) -> np.ndarray:
        """A numeric column in its stored dtype (zero-copy when possible; nulls were rejected for metrics)."""
        key = "__raw__" + name
        if key not in self._cache:
            col = self.arrow(name)
            if col.null_count:
                self._cache[key] = self.numeric(name)
            else:
                self._cache[key] = col.to_numpy(zero_copy_only=False)
        return self._cache[key]  # type: ignore[return-value]

    def texts(self, name: str = "text") -> list[str]:
        if name not in self._cache:
            self._cache[name] = [t or "" for t in self.arrow(name).to_pylist()]
        return self._cache[name]  # type: ignore[return-value]

    def uid_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """The rows' uids as `(hi, lo)` uint64 arrays (decoded once, validated)."""
        if "__uid__" not in self._cache:
            try:
                self._cache["__uid__"] = arrow_to_pairs(self.arrow("uid"), f"{self.source}: column 'uid'")
            except UidError as e:
                raise SelectError(str(e)) from None
        return self._cache["__uid__"]  # type: ignore[return-value]

    def filter(self, mask: np.ndarray, columns: Iterable[str] | None = None) -> Batch:
        """The rows where `mask` is true (of `columns` only, when given: filtering costs per column)."""
        data = self.data if columns is None else self.data.select(list(columns))
        return Batch(data.filter(pa.array(mask)), self.source, self.first_row)


class ScoresTable:
    """The partitioned scores table of a run directory (or a folder of Parquet files given directly), or of
    several runs read as one table: their parts in the order given, a uid seen in an earlier run (or earlier
    in the table) counted in `duplicates` and read once, as one run over all their pools keeps it."""

    def __init__(self, run_dir: str | PathLike | Sequence[str | PathLike]):
        runs = [run_dir] if isinstance(run_dir, (str, PathLike)) else list(run_dir)
        if not runs:
            raise SelectError("no scores table given: pass --scores RUN_DIR")
        opened = [_open_run(storage.location(r)) for r in runs]
        self.run_dir = opened[0][0]
        self.folder = opened[0][1]
        self.folders = [folder for _, folder, _ in opened]
        # name -> {"size", "version"} from one listing (a bucket: no request per part)
        self.listing = opened[0][2]
        self.listings = [listing for _, _, listing in opened]
        self.files = [folder / name for _, folder, listing in opened for name in listing]
        self.remote = storage.is_url(self.folder)
        # From a bucket, a part opened by Arrow's S3 client stays open for the later passes: opening
        # costs a HEAD request (its size), reading a range of an open file does not.
        self._handles: dict[str, Any] | None = {} if self.remote else None
        self._spool: _Spool | None = None
        self.units: list[_Unit] = []
        self.schemas: dict[str, pa.Schema] = {}
        self.footers: dict[str, pq.FileMetaData] = {}  # reused by every read: no footer request per unit
        row = 0
        for path, (meta, schema) in zip(self.files, self._read_footers(), strict=True):
            self.schemas[str(path)] = schema
            self.footers[str(path)] = meta
            for g in range(meta.num_row_groups):
                n = meta.row_group(g).num_rows
                if n:
                    self.units.append(_Unit(str(path), g, n, row))
                    row += n
        self.num_rows = row
        if self.num_rows == 0:
            raise SelectError(
                f"{self.folder}: the scores table has no rows; rerun `hype score` (see its summary)"
            )
        self._drops = np.zeros(0, np.int64)  # global rows left out: uids repeated across runs
        self.duplicates = 0
        if len(opened) > 1:
            self.require(["uid"], "reading several runs as one table")
            self._drops = self._repeated_rows()
            self.duplicates = len(self._drops)
            self.num_rows -= self.duplicates

    @property
    def source(self) -> str | list[str]:
        """The scores folder(s) this table reads (for summaries)."""
        return str(self.folder) if len(self.folders) == 1 else [str(f) for f in self.folders]

    def _repeated_rows(self) -> np.ndarray:
        """Sorted global row ids whose uid appeared earlier in the table (the first occurrence is kept), in
        passes over disjoint uid groups (`hi % passes`) so that memory stays bounded (as `hype score`'s
        dedup does)."""
        passes = max(1, -(-self.num_rows // ROWS_PER_PASS))
        found = []
        for p in range(passes):
            his, los, ids = [], [], []
            for batch in self.iter_batches(["uid"]):
                hi, lo = batch.uid_pairs()
                rows = np.arange(batch.first_row, batch.first_row + len(batch), dtype=np.int64)
                if passes > 1:
                    sel = (hi % np.uint64(passes)) == np.uint64(p)
                    hi, lo, rows = hi[sel], lo[sel], rows[sel]
                his.append(hi)
                los.append(lo)
                ids.append(rows)
            hi, lo, gid = np.concatenate(his), np.concatenate(los), np.concatenate(ids)
            order = np.lexsort((gid, lo, hi))  # by uid, then table order: the first occurrence leads
            hi, lo, gid = hi[order], lo[order], gid[order]
            same = (hi[1:] == hi[:-1]) & (lo[1:] == lo[:-1])
            found.append(gid[1:][same])
        return np.sort(np.concatenate(found))

    def cache_path(self, kind: str, suffix: str) -> AnyPath | None:
        """Where commands cache what depends only on the table's parts (`select_cache/` beside the scores),
        keyed by the parts' names, sizes and versions (mtime / ETag) from the table's listing: rewriting
        any part changes the key, so a stale cache is never read. None (no cache) when the store gives a
        part no version."""
        if len(self.folders) > 1 or any(f["version"] is None for f in self.listing.values()):
            return None  # several runs: nothing is cached (no one folder owns the table)
        key = sha256_chunks(
            f"{name}\0{f['size']}\0{f['version']}\n".encode() for name, f in self.listing.items()
        )
        return self.folder.parent / "select_cache" / f"{kind}-{key[:20]}{suffix}"

    def _read_footers(self) -> list[tuple[pq.FileMetaData, pa.Schema]]:
        """Every part's footer. From a bucket, all of them from one cached object when it is there (one
        request instead of two per part), else read concurrently and cached for the next command."""
        if not self.remote:
            return _footers(self.files)
        cache = self.cache_path("footers", ".parquet")
        cached = None if cache is None else _load_footer_cache(cache, list(self.listing))
        if cached is not None:
            return cached
        footers = _footers(self.files, self._handles)
        if cache is not None:
            _save_footer_cache(cache, list(self.listing), [meta for meta, _ in footers])
        return footers

    def run_summary(self, folder: AnyPath | None = None) -> dict | None:
        """The `summary.json` `hype score` keeps next to the scores (None when absent or unreadable)."""
        try:
            data = json.loads(read_bytes((folder or self.folder).parent / "summary.json"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def identity(self) -> list[dict]:
        """What identifies the table's content without reading it (`hype.io.runs.input_identity`, per run):
        every part's size and version from the listings already made, and the run's summary.json, which
        each `hype score` run rewrites (the outputs a filter attaches, e.g. decontamination's matches,
        change only with a run)."""
        return [
            {"parts": listing, "summary": input_identity(folder.parent / "summary.json")}
            for folder, listing in zip(self.folders, self.listings, strict=True)
        ]

    def require_finished(self) -> None:
        """Refuse a table that `hype score` is still writing or whose last run failed: its parts may be
        missing, or left by an earlier run with other settings (a failed rerun does not remove them)."""
        for folder in self.folders:
            _require_finished(folder, self.run_summary(folder))

    def has_column(self, name: str) -> bool:
        return all(name in s.names for s in self.schemas.values())

    def present_metrics(self) -> list[str]:
        return [m for m in METRICS if self.has_column(m)]

    def require(self, columns: Iterable[str], why: str = "") -> None:
        """Raise naming the first file that lacks a needed column (or holds it with the wrong type)."""
        columns = list(dict.fromkeys(columns))
        for path, schema in self.schemas.items():
            missing = [c for c in columns if c not in schema.names]
            if missing:
                reason = f" (needed by {why})" if why else ""
                raise SelectError(
                    f"{path}: missing column(s) {', '.join(missing)}{reason}; the scores table must follow "
                    f"hype.table.schema.SCHEMA ({', '.join(SCHEMA.names)}). Rescore, or drop the option "
                    "that needs the column"
                )
            for c in columns:
                t = schema.field(c).type
                if c in NUMERIC_COLUMNS and not (pa.types.is_floating(t) or pa.types.is_integer(t)):
                    raise SelectError(f"{path}: column {c!r} has type {t}, expected a number (float32)")
                if c in ("uid", "text", "shard", "key") and not (
                    pa.types.is_string(t) or pa.types.is_large_string(t)
                ):
                    raise SelectError(f"{path}: column {c!r} has type {t}, expected a string")

    def iter_batches(
        self,
        columns: Iterable[str],
        *,
        workers: int = 2,
        progress: str | None = None,
        check: Iterable[str] | None = None,
        spool: bool = False,
    ) -> Iterator[Batch]:
        """Every row once, in table order, with `columns` only. The metric columns among `check` (default:
        every metric read) must be finite and non-null: the first bad value raises `SelectError`.
        `spool`: a later pass will read these columns again; from a bucket, keep a local copy of them
        (kept once the pass has read every row, until `release_spool`)."""
        columns = list(dict.fromkeys(columns))
        self.require(columns)
        checked = [c for c in (columns if check is None else check) if c in METRICS and c in columns]
        local = self._spool.columns if self._spool is not None else {}
        fetch = [c for c in columns if c not in local]
        writer = None
        if spool and self.remote and fetch:
            if self._spool is None:
                self._spool = _Spool()
            writer = self._spool.writer(fetch)
        bar = _progress(progress, self.num_rows)
        try:
            for i, (unit, data) in enumerate(
                _prefetch(self.units, fetch, max(1, workers), self.footers, self._handles)
            ):
                if writer is not None:
                    writer.add(data)
                if local:
                    data = self._spool.join(i, data, columns)  # type: ignore[union-attr]
                batch = Batch(data, unit.path, unit.first_row)
                for c in checked:
                    _check_finite(batch, c, unit)
                batch = self._without_repeats(batch, unit)
                if len(batch):
                    yield batch
                if bar is not None:
                    bar.update(unit.num_rows)
            if writer is not None:
                self._spool.commit(writer)  # type: ignore[union-attr]
                writer = None
        finally:
            if writer is not None:
                writer.discard()
            if bar is not None:
                bar.close()

    def _without_repeats(self, batch: Batch, unit: _Unit) -> Batch:
        """The unit's rows less those whose uid an earlier run (or row) of the table already holds."""
        lo, hi = np.searchsorted(self._drops, [unit.first_row, unit.first_row + unit.num_rows])
        if hi == lo:
            return batch
        keep = np.ones(unit.num_rows, dtype=bool)
        keep[self._drops[lo:hi] - unit.first_row] = False
        return batch.filter(keep)

    def release_spool(self) -> None:
        """Delete the local copy of the columns read from a bucket and close the parts' open files (a no-op
        for a local table); a later pass downloads and opens again."""
        if self._spool is not None:
            self._spool.close()
            self._spool = None
        if self._handles:
            for handle in self._handles.values():
                handle.close()
            self._handles.clear()


def _open_run(run_dir: AnyPath) -> tuple[AnyPath, AnyPath, dict[str, dict]]:
    """(run directory, scores folder, its parts' listing) of one --scores."""
    folder = scores_dir(run_dir)
    listing = _parts(folder)
    if not listing:
        listing = _parts(run_dir)
        if listing:
            folder = run_dir  # the scores folder itself was passed
        elif not storage.exists(run_dir):
            raise SelectError(f"{run_dir}: no such run directory; pass the --out folder of `hype score`")
    if not listing:
        raise SelectError(
            f"{run_dir}: no scores found (expected {folder}/part-*.parquet); run "
            f"`hype score ... --out {run_dir}` first, or pass the run directory it wrote"
        )
    return run_dir, folder, listing


def _require_finished(folder: AnyPath, summary: dict | None) -> None:
    run = folder.parent
    if summary is None:
        if not any(storage.exists(run / name) for name in ("summary.json", "plan.json", "config.yaml")):
            return  # a table `hype score` did not write: it keeps no status
        # A run directory without a readable status (lost, cut short, edited): fail closed.
        raise SelectError(
            f"{run / 'summary.json'}: missing, unreadable or not a JSON object, so whether the last hype "
            f"score run there finished is unknown and its scores may be partial or stale; finish the run: "
            f"{_rerun(run)}"
        )
    status = summary.get("status")
    if status == "running":
        raise SelectError(
            f"{run}: hype score is still running there (summary.json status 'running'), so its scores "
            f"table is incomplete; wait for it to finish, or resume an interrupted run: {_rerun(run)}"
        )
    if status == "failed":
        failed = (summary.get("shards") or {}).get("failed") or []
        why = f"{len(failed)} shard(s) failed" if failed else str(summary.get("error") or "see it")
        raise SelectError(
            f"{run}: the last hype score run there failed (summary.json status 'failed': {why}), so its "
            "scores table may lack shards or hold parts of an earlier run with other settings; fix the "
            f"cause and finish the run: {_rerun(run)}"
        )


def _rerun(run: AnyPath) -> str:
    """The command that reruns the scoring of this run directory with its own settings."""
    config = run / "config.yaml"
    if storage.exists(config):
        return f"`hype score --config {config}` (finished work is kept)"
    return "rerun the same `hype score` command (finished work is kept)"


class _Spool:
    """Local copies of columns read from a bucket: per spooling pass, one Arrow IPC file holding that pass's
    downloaded columns as one record batch per unit, memory-mapped back (zero-copy) once complete."""

    def __init__(self):
        self._dir = tempfile.TemporaryDirectory(prefix="hype-select-spool-")
        self.columns: dict[str, pa.ipc.RecordBatchFileReader] = {}
        self._files = 0

    def writer(self, columns: list[str]) -> _SpoolWriter:
        self._files += 1
        return _SpoolWriter(f"{self._dir.name}/pass-{self._files}.arrow", columns)

    def commit(self, writer: _SpoolWriter) -> None:
        reader = writer.finish()
        for c in writer.columns:
            self.columns[c] = reader

    def join(self, i: int, fetched: pa.Table | None, columns: list[str]) -> pa.Table:
        """Unit `i` with `columns`: the spooled ones from local disk, the rest from `fetched`."""
        batches: dict[int, pa.RecordBatch] = {}
        arrays = []
        for c in columns:
            reader = self.columns.get(c)
            if reader is None:
                assert fetched is not None
                arrays.append(fetched.column(c))
            else:
                batch = batches.get(id(reader))
                if batch is None:
                    batch = batches[id(reader)] = reader.get_batch(i)
                arrays.append(batch.column(c))
        return pa.table(arrays, names=columns)

    def close(self) -> None:
        self.columns.clear()
        self._dir.cleanup()


class _SpoolWriter:
    def __init__(self, path: str, columns: list[str]):
        self.path, self.columns = path, columns
        self._sink: pa.ipc.RecordBatchFileWriter | None = None

    def add(self, data: pa.Table | None) -> None:
        assert data is not None
        (record,) = data.select(self.columns).combine_chunks().to_batches()  # units are never empty
        if self._sink is None:
            self._sink = pa.ipc.new_file(self.path, record.schema)
        self._sink.write_batch(record)

    def finish(self) -> pa.ipc.RecordBatchFileReader:
        assert self._sink is not None
        self._sink.close()
        return pa.ipc.open_file(pa.memory_map(self.path))

    def discard(self) -> None:
        if self._sink is not None:
            self._sink.close()


def _read_unit(
    unit: _Unit,
    columns: list[str],
    footers: dict[str, pq.FileMetaData] | None = None,
    handles: dict[str, Any] | None = None,
) -> pa.Table | None:
    """The unit's `columns` (None when there are none to read); `footers`: the parts' metadata, read
    when the table was opened, so that no request goes to the footer again."""
    if not columns:
        return None
    try:
        with _open_part(unit.path, columns, unit.row_group, handles) as f:
            meta = footers.get(unit.path) if footers else None
            part = pq.ParquetFile(f, pre_buffer=True, metadata=meta, page_checksum_verification=True)
            return part.read_row_group(unit.row_group, columns=columns, use_threads=False)
    except (pa.ArrowInvalid, OSError) as e:
        raise SelectError(
            f"{unit.path}: row group {unit.row_group} cannot be read ({e}); {_REPAIR}"
        ) from None


def _prefetch(
    units: list[_Unit],
    columns: list[str],
    workers: int,
    footers: dict[str, pq.FileMetaData] | None,
    handles: dict[str, Any] | None = None,
) -> Iterator[tuple[_Unit, pa.Table | None]]:
    """Read units on `workers` threads, at most `workers + 1` ahead, yielding them in order."""
    if not columns:  # every column is in the spool
        for u in units:
            yield u, None
        return
    if units and storage.is_url(units[0].path):
        workers = max(workers, REMOTE_READERS)  # waiting on the network, not on the CPU
    if workers == 1:
        for u in units:
            yield u, _read_unit(u, columns, footers, handles)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hype-read") as pool:
        pending: deque = deque()
        it = iter(units)
        for u in it:
            pending.append((u, pool.submit(_read_unit, u, columns, footers, handles)))
            if len(pending) > workers:
                break
        while pending:
            u, fut = pending.popleft()
            nxt = next(it, None)
            if nxt is not None:
                pending.append((nxt, pool.submit(_read_unit, nxt, columns, footers, handles)))
            yield u, fut.result()


def _check_finite(batch: Batch, name: str, unit: _Unit) -> None:
    col = batch.arrow(name)
    if col.null_count:
        values = col.cast(pa.float64()).fill_null(float("nan")).to_numpy(zero_copy_only=False)
    else:
        values = col.to_numpy(zero_copy_only=False)
        # One pass: a float64 sum is finite iff every value is (float32 values cannot overflow it; for
        # float64 columns an overflowing sum just falls through to the element-wise check).
        if np.isfinite(values.sum(dtype=np.float64)):
            return
    finite = np.isfinite(values)
    if finite.all():
        return
    bad = np.flatnonzero(~finite)
    i = int(bad[0])
    if "uid" in batch.data.column_names:
        uids = batch.arrow("uid")
    else:
        uids = _read_unit(unit, ["uid"]).column(0)  # type: ignore[union-attr]
    raise SelectError(
        f"{unit.path}: column {name!r} has {len(bad)} NaN/null/inf value(s) in row group {unit.row_group} "
        f"(first at row {i}, uid {uids[i].as_py()}, value {values[i]}); rescore those shards or drop the "
        f"rows, or give {name} weight 0 (--weights) so that it is not read"
    )


def _progress(desc: str | None, total: int):
    if not desc:
        return None
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=" rows",
        unit_scale=True,
        file=sys.stderr,
        dynamic_ncols=True,
    )


def _parts(folder: AnyPath) -> dict[str, dict]:
    files = storage.list_files(folder)
    return {n: files[n] for n in sorted(files) if n.startswith("part-") and n.endswith(".parquet")}


REMOTE_READERS = 8  # concurrent part reads from a bucket
FOOTER_SAMPLE = 64 << 10  # bytes read from a part's end for its footer (a scores part's is a few KB)


def _footers(
    files: list[AnyPath], handles: dict[str, Any] | None = None
) -> list[tuple[pq.FileMetaData, pa.Schema]]:
    """(metadata, Arrow schema) of every part; from a bucket, footers only, read concurrently."""

    def read(path: AnyPath) -> tuple[pq.FileMetaData, pa.Schema]:
        try:
            with _open_part(str(path), None, None, handles) as f:
                part = pq.ParquetFile(f)
                return part.metadata, part.schema_arrow
        except (pa.ArrowInvalid, OSError) as e:
            raise SelectError(f"{path}: not a readable Parquet file ({e}); {_REPAIR}") from None

    if not files or not storage.is_url(files[0]):
        return [read(p) for p in files]
    with ThreadPoolExecutor(max_workers=REMOTE_READERS * 2, thread_name_prefix="hype-footer") as pool:
        return list(pool.map(read, files))


def _load_footer_cache(path: AnyPath, names: list[str]) -> list[tuple[pq.FileMetaData, pa.Schema]] | None:
    """The parts' footers from the cache object (a Parquet table of part name -> footer bytes as Parquet
    writes them), in `names` order; None when absent, unreadable or for other parts."""
    try:
        table = pq.read_table(pa.BufferReader(read_bytes(path)))
        found = dict(zip(table.column("name").to_pylist(), table.column("footer").to_pylist(), strict=True))
        metas = [pq.read_metadata(pa.BufferReader(found[n])) for n in names]
        return [(m, m.schema.to_arrow_schema()) for m in metas]
    except (OSError, KeyError, ValueError, TypeError, pa.ArrowException):
        return None


def _save_footer_cache(path: AnyPath, names: list[str], metas: list[pq.FileMetaData]) -> None:
    blobs = []
    for meta in metas:
        buf = pa.BufferOutputStream()
        meta.write_metadata_file(buf)
        blobs.append(buf.getvalue().to_pybytes())
    table = pa.table({"name": pa.array(names, pa.string()), "footer": pa.array(blobs, pa.binary())})
    try:
        write_bytes(path, parquet_bytes(table))
    except OSError:
        pass  # a read-only bucket: the footers are read from the parts next time


def _open_part(
    path: str, columns: list[str] | None, row_group: int | None, handles: dict[str, Any] | None = None
):
    """A part open for reading. Locally the file itself; from a bucket only what is read (fsspec's
    Parquet-aware opener fetches the footer, then the byte ranges of `columns` in `row_group` in one
    concurrent request: the other columns, e.g. captions, never leave the bucket)."""
    if not storage.is_url(path):
        return open(path, "rb")
    native = storage.arrow_filesystem(path)
    if native is not None:  # Arrow's own S3 client: reads the column chunks concurrently, off the GIL
        fs, key = native
        if handles is None:
            return storage.with_retries(lambda: fs.open_input_file(key), path)
        handle = handles.get(path)
        if handle is None:  # two threads may both open it: one handle wins, the other is dropped
            handle = handles.setdefault(path, storage.with_retries(lambda: fs.open_input_file(key), path))
        return contextlib.nullcontext(handle)  # ReadAt on an Arrow file is thread-safe
    import fsspec.parquet

    loc = storage.location(path)
    return storage.with_retries(
        lambda: fsspec.parquet.open_parquet_file(
            loc.path,
            fs=loc.fs,
            columns=columns if columns is not None else [],
            row_groups=[row_group] if row_group is not None else [],
            engine="pyarrow",
            footer_sample_size=FOOTER_SAMPLE,
        ),
        path,
    )
