"""Reading the scores table (`RUN_DIR/scores/part-*.parquet`, see `hype.scoring.schema`) in bounded memory.

The table is read in units of one Parquet row group, a few at a time on a small thread pool (Parquet
decoding releases the GIL), in a fixed order, so every pass over it sees the same rows in the same order
whatever the thread count. Only the columns a pass needs are read. Each batch is checked as it arrives:
metric values must be finite and non-null, and the error names the file, column, row and uid.
"""

from __future__ import annotations

import json
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from os import PathLike

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hype.data.uids import UidError, arrow_to_pairs
from hype.io import read_bytes, storage
from hype.io.storage import AnyPath
from hype.scoring.schema import METRICS, SCHEMA, scores_dir
from hype.select.errors import SelectError

NUMERIC_COLUMNS = (*METRICS, "width", "height")


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
    """The partitioned scores table of a run directory (or a folder of Parquet files given directly)."""

    def __init__(self, run_dir: str | PathLike):
        self.run_dir = storage.location(run_dir)
        folder = scores_dir(self.run_dir)
        listing = _parts(folder)
        if not listing:
            listing = _parts(self.run_dir)
            if listing:
                folder = self.run_dir  # the scores folder itself was passed
            elif not storage.exists(self.run_dir):
                raise SelectError(
                    f"{self.run_dir}: no such run directory; pass the --out folder of `hype score`"
                )
        self.folder = folder
        # name -> {"size", "version"} from one listing (a bucket: no request per part)
        self.listing = listing
        self.files = [folder / name for name in listing]
        if not self.files:
            raise SelectError(
                f"{self.run_dir}: no scores found (expected {folder}/part-*.parquet); run "
                f"`hype score ... --out {self.run_dir}` first, or pass the run directory it wrote"
            )
        self.units: list[_Unit] = []
        self.schemas: dict[str, pa.Schema] = {}
        row = 0
        for path, (meta, schema) in zip(self.files, _footers(self.files), strict=True):
            self.schemas[str(path)] = schema
            for g in range(meta.num_row_groups):
                n = meta.row_group(g).num_rows
                if n:
                    self.units.append(_Unit(str(path), g, n, row))
                    row += n
        self.num_rows = row
        if self.num_rows == 0:
            raise SelectError(f"{folder}: the scores table has no rows; rerun `hype score` (see its summary)")

    def run_summary(self) -> dict | None:
        """The `summary.json` `hype score` keeps next to the scores (None when absent or unreadable)."""
        try:
            data = json.loads(read_bytes(self.folder.parent / "summary.json"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def require_finished(self) -> list[str]:
        """Refuse a table that `hype score` is still writing; return warnings for one whose run failed."""
        summary = self.run_summary() or {}
        status = summary.get("status")
        if status == "running":
            raise SelectError(
                f"{self.folder.parent}: hype score is still running there (summary.json status 'running'), "
                "so its scores table is incomplete; wait for it to finish, or rerun it to resume an "
                "interrupted run"
            )
        if status == "failed":
            failed = (summary.get("shards") or {}).get("failed") or []
            return [
                f"the scoring run failed on {len(failed)} shard(s) (summary.json status 'failed'): their "
                "samples are not in the scores table; rerun hype score to retry them"
            ]
        return []

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
                    f"hype.scoring.schema.SCHEMA ({', '.join(SCHEMA.names)}). Rescore, or drop the option "
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
    ) -> Iterator[Batch]:
        """Every row once, in table order, with `columns` only. The metric columns among `check` (default:
        every metric read) must be finite and non-null: the first bad value raises `SelectError`."""
        columns = list(dict.fromkeys(columns))
        self.require(columns)
        checked = [c for c in (columns if check is None else check) if c in METRICS and c in columns]
        bar = _progress(progress, self.num_rows)
        try:
            for unit, data in _prefetch(self.units, columns, max(1, workers)):
                batch = Batch(data, unit.path, unit.first_row)
                for c in checked:
                    _check_finite(batch, c, unit)
                yield batch
                if bar is not None:
                    bar.update(unit.num_rows)
        finally:
            if bar is not None:
                bar.close()


def _read_unit(unit: _Unit, columns: list[str]) -> pa.Table:
    try:
        with _open_part(unit.path, columns, unit.row_group) as f:
            return pq.ParquetFile(f, pre_buffer=True).read_row_group(
                unit.row_group, columns=columns, use_threads=False
            )
    except (pa.ArrowInvalid, OSError) as e:
        raise SelectError(
            f"{unit.path}: row group {unit.row_group} cannot be read ({e}); rescore it"
        ) from None


def _prefetch(units: list[_Unit], columns: list[str], workers: int) -> Iterator[tuple[_Unit, pa.Table]]:
    """Read units on `workers` threads, at most `workers + 1` ahead, yielding them in order."""
    if units and storage.is_url(units[0].path):
        workers = max(workers, REMOTE_READERS)  # waiting on the network, not on the CPU
    if workers == 1:
        for u in units:
            yield u, _read_unit(u, columns)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hype-read") as pool:
        pending: deque = deque()
        it = iter(units)
        for u in it:
            pending.append((u, pool.submit(_read_unit, u, columns)))
            if len(pending) > workers:
                break
        while pending:
            u, fut = pending.popleft()
            nxt = next(it, None)
            if nxt is not None:
                pending.append((nxt, pool.submit(_read_unit, nxt, columns)))
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
    uids = batch.arrow("uid") if "uid" in batch.data.column_names else _read_unit(unit, ["uid"]).column(0)
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


def _footers(files: list[AnyPath]) -> list[tuple[pq.FileMetaData, pa.Schema]]:
    """(metadata, Arrow schema) of every part; from a bucket, footers only, read concurrently."""

    def read(path: AnyPath) -> tuple[pq.FileMetaData, pa.Schema]:
        try:
            with _open_part(str(path), None, None) as f:
                part = pq.ParquetFile(f)
                return part.metadata, part.schema_arrow
        except (pa.ArrowInvalid, OSError) as e:
            raise SelectError(
                f"{path}: not a readable Parquet file ({e}); delete it and rescore that part"
            ) from None

    if not files or not storage.is_url(files[0]):
        return [read(p) for p in files]
    with ThreadPoolExecutor(max_workers=REMOTE_READERS * 2, thread_name_prefix="hype-footer") as pool:
        return list(pool.map(read, files))


def _open_part(path: str, columns: list[str] | None, row_group: int | None):
    """A part open for reading. Locally the file itself; from a bucket only what is read (fsspec's
    Parquet-aware opener fetches the footer, then the byte ranges of `columns` in `row_group` in one
    concurrent request: the other columns, e.g. captions, never leave the bucket)."""
    if not storage.is_url(path):
        return open(path, "rb")
    native = storage.arrow_filesystem(path)
    if native is not None:  # Arrow's own S3 client: reads the column chunks concurrently, off the GIL
        fs, key = native
        return storage.with_retries(lambda: fs.open_input_file(key), path)
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
