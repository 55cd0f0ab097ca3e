"""DataComp pool metadata as the pool's uid list and, with its `.npz`, the source of cos θ and the CLIP
image features (`hype score --metadata DIR`).

DataComp ships, next to the shards, a flat folder of `<hash>.parquet` (columns include `uid`, `text` and
`clip_l14_similarity_score`) and, only with `download_upstream.py --download_npz`, a row-aligned
`<hash>.npz` (arrays `l14_img`, `l14_txt`, `b32_img`, ..., L2-normalized). Where the metadata's values
come from (`feature_source`):

    every .parquet has its .npz   CLIP image features from the .npz (`features_key`), cos θ from the
                                  parquet's `score_column`: both OpenAI's L/14, so they agree; --clip, if
                                  given, only embeds --class-images
    some or all .npz missing      --clip computes the CLIP image features and cos θ for the whole pool
                                  (one model for both); without --clip this is an error

Either way the metadata defines the pool: samples whose uid it does not list are skipped
(`not_in_metadata`). Samples are not in the same order as the shards, so the driver builds one sorted
index of every metadata row once per run directory:

    RUN_DIR/metadata/index.npy   structured array (hi, lo, file, row, score), sorted by uid (hi, lo)
    RUN_DIR/metadata/index.json  completion marker: the metadata files (name, size, mtime) it covers

28 bytes per row on disk; workers memory-map it and look a shard's uids up with a binary search, then
read the feature rows from the few `.npz` files they fall in (kept in a small per-worker cache).
`.npz` files are opened with `allow_pickle=False`.

The index is built in bounded memory: the rows the Parquet footers declare are checked against the memory
this process can use before anything is read (a small file can declare tens of millions of rows), the
files are read in batches into columns of that size, sorted by one integer sort (`sort_order`), and the
`.npy` is written in slices: ~40 bytes per row at the peak (`INDEX_BUILD_BYTES_PER_ROW`, plus a fixed
`INDEX_BUILD_RESERVE`) instead of each file's table, its copies and the sorted copy in memory at once.
"""

from __future__ import annotations

import time
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hype.data.uids import normalize_arrow_uids, sort_order, uids_to_pairs
from hype.executor import available_memory
from hype.io import atomic_write, load_npy, open_input, storage
from hype.io.storage import AnyPath
from hype.scoring.rundir import atomic_write_json, file_identity, fingerprint, read_json

INDEX_DTYPE = np.dtype([("hi", "<u8"), ("lo", "<u8"), ("file", "<u4"), ("row", "<u4"), ("score", "<f4")])
# The build's peak: per declared row the index's five columns (28 bytes) and the sort's one array of keys,
# then row numbers (8), with margin; and the Parquet reader and a batch's decoding, whatever the rows.
# Measured: 8M rows in 507 MB (bench/metadata_index.py).
INDEX_BUILD_BYTES_PER_ROW = 40
INDEX_BUILD_RESERVE = 256 * 2**20
_BATCH_ROWS = 1 << 18  # rows per read: ~25 MiB of uid strings and their decoding
_SLICE_ROWS = 1 << 20  # index rows gathered per write


class MetadataError(ValueError):
    """A metadata folder that cannot be used; the message names the file and the fix."""


def metadata_files(folder: str | Path) -> list[AnyPath]:
    folder = storage.location(folder)
    if not storage.is_dir(folder):
        raise MetadataError(f"{folder}: metadata folder not found")
    files = storage.files_with_suffix(folder, ".parquet")
    if not files:
        raise MetadataError(f"{folder}: no <hash>.parquet metadata files in this folder")
    return files


def feature_source(files: list[AnyPath], have_clip: bool) -> tuple[str, list[AnyPath]]:
    """("npz", []) when every parquet has its row-aligned .npz; else ("clip", the missing .npz files),
    which needs the CLIP scorer (`have_clip`)."""
    present = set(storage.list_sizes(files[0].parent)) if files else set()  # one listing
    missing = [p.with_suffix(".npz") for p in files if p.with_suffix(".npz").name not in present]
    if not missing:
        return "npz", []
    if not have_clip:
        raise MetadataError(
            f"{missing[0]}: no row-aligned .npz next to {missing[0].with_suffix('.parquet').name} "
            f"({len(missing)} of {len(files)} metadata files have none), so the metadata holds no CLIP "
            "features; download the .npz files too (DataComp: download_upstream.py --download_npz) or "
            "pass --clip CKPT to compute the CLIP features and cos θ"
        )
    return "clip", missing


def build_index(folder: str | Path, index_path: Path, score_column: str | None) -> dict:
    """Write the sorted uid index of a metadata folder (atomically, marker last); reuse a current one.
    `score_column` None: uids only (the scores are NaN)."""
    files = metadata_files(folder)
    fp = fingerprint({"files": [file_identity(p) for p in files], "score_column": score_column})
    marker = index_path.with_suffix(".json")
    done = read_json(marker)
    if done is not None and done.get("fingerprint") == fp and storage.is_file(index_path):
        return done
    started = time.perf_counter()
    columns = ["uid"] if score_column is None else ["uid", score_column]
    cols = _IndexColumns(_declared_rows(files, columns))  # checked against memory before allocation
    malformed = 0
    for i, path in enumerate(files):
        with _parquet(path, columns) as pf:
            malformed += _read_rows(path, pf, columns, i, cols)
    _write_sorted(index_path, cols)
    info = {
        "fingerprint": fp,
        "folder": storage.absolute(folder),
        "files": [p.name for p in files],
        "rows": cols.n,
        "malformed_uids": malformed,  # rows without a 32-hex uid: left out, they match no sample
        "score_column": score_column,
        "seconds": round(time.perf_counter() - started, 3),
    }
    atomic_write_json(marker, info)
    return info


@contextmanager
def _parquet(path: AnyPath, columns: list[str]) -> Iterator[pq.ParquetFile]:
    """The Parquet file `path` with its footer read (nothing else yet), checked to have `columns`."""
    with open_input(path) as f:
        try:
            pf = pq.ParquetFile(f, pre_buffer=False)  # pre-buffered, a file's read column chunks stay held
        except (pa.ArrowException, OSError, ValueError) as e:
            if isinstance(e, MemoryError):
                raise
            raise MetadataError(
                f"{path}: not a readable Parquet file ({e}); replace it with the original"
            ) from None
        missing = [c for c in columns if c not in pf.schema_arrow.names]
        if missing:
            raise MetadataError(
                f"{path}: no column {', '.join(missing)}; set metadata.score_column to the CLIP score column "
                "of this metadata"
            )
        yield pf


def _declared_rows(files: list[AnyPath], columns: list[str]) -> int:
    """The rows the files' footers declare, refused before anything is allocated for them when the index
    would not fit in the memory left (a small file can declare tens of millions of rows)."""
    declared = []
    for path in files:
        with _parquet(path, columns) as pf:
            declared.append(pf.metadata.num_rows)
    biggest = files[int(np.argmax(declared))]
    if max(declared) >= 2**32:  # the index keeps each row's number in 32 bits
        raise MetadataError(
            f"{biggest}: declares {max(declared):,} rows, more than the 2^32 one metadata file may hold; "
            "split it into files of fewer rows (with their .npz)"
        )
    need = sum(declared) * INDEX_BUILD_BYTES_PER_ROW + INDEX_BUILD_RESERVE
    left = available_memory()
    if left is not None and need > left:
        raise MetadataError(
            f"{biggest}: the metadata's footers declare {sum(declared):,} rows ({max(declared):,} in this "
            f"file, {len(files)} files), and its uid index needs {need / 2**30:.1f} GiB to build; this "
            f"process can use {left / 2**30:.1f} GiB. Check that the file is DataComp's, or run on a machine "
            "with more memory (or score the pool in parts, each with its own metadata folder)"
        )
    return sum(declared)


def _write_sorted(index_path: Path, cols: _IndexColumns) -> None:
    """Write the index as a `.npy`, sorted by uid, gathering `_SLICE_ROWS` rows at a time."""
    order = sort_order(cols.hi[: cols.n], cols.lo[: cols.n])  # stable: a repeated uid keeps its first row
    header = {"descr": np.lib.format.dtype_to_descr(INDEX_DTYPE), "fortran_order": False, "shape": (cols.n,)}
    with atomic_write(index_path) as f:
        np.lib.format.write_array_header_1_0(f, header)  # what np.save writes for this array
        out = np.empty(min(cols.n, _SLICE_ROWS), INDEX_DTYPE)
        for a in range(0, cols.n, _SLICE_ROWS):
            rows = order[a : a + _SLICE_ROWS]
            part = out[: len(rows)]
            for name in INDEX_DTYPE.names:
                part[name] = getattr(cols, name)[rows]
            f.write(part.data)


class _IndexColumns:
    """The index's columns, allocated once at the declared number of rows and filled batch by batch."""

    def __init__(self, rows: int):
        self.n = 0
        for name in INDEX_DTYPE.names:
            setattr(self, name, np.empty(rows, INDEX_DTYPE[name]))

    def add(self, hi: np.ndarray, lo: np.ndarray, file: int, row: np.ndarray, score: np.ndarray) -> None:
        a, b = self.n, self.n + len(hi)
        self.hi[a:b], self.lo[a:b], self.file[a:b], self.row[a:b], self.score[a:b] = hi, lo, file, row, score
        self.n = b


def _read_rows(path: AnyPath, pf: pq.ParquetFile, columns: list[str], file: int, cols: _IndexColumns) -> int:
    """Add the rows of one metadata file with a valid uid to `cols`, reading `_BATCH_ROWS` at a time;
    returns the number of rows without one (they match no sample)."""
    malformed, start = 0, 0
    try:
        for batch in pf.iter_batches(batch_size=_BATCH_ROWS, columns=columns):
            # The uids as shard samples' are read (`normalize_uid`); a row without one matches no sample.
            hi, lo, valid = normalize_arrow_uids(batch.column(0))
            rows = np.flatnonzero(valid)
            malformed += len(valid) - len(rows)
            score = (
                np.nan
                if len(columns) == 1
                else batch.column(1).to_numpy(zero_copy_only=False).astype(np.float32)[rows]
            )
            # the row in the file (and in its row-aligned .npz)
            cols.add(hi[rows], lo[rows], file, (rows + start).astype(np.uint32), score)
            start += len(valid)
    except (pa.ArrowException, OSError, ValueError, TypeError) as e:
        if isinstance(e, MemoryError):
            raise
        raise MetadataError(
            f"{path}: cannot read columns {', '.join(columns)} ({e}); set metadata.score_column to "
            "the CLIP score column of this metadata"
        ) from None
    return malformed


class MetadataLookup:
    """Per-worker uid lookups in the index and feature reads from the `.npz` files (`features_key` None:
    lookups only)."""

    def __init__(self, folder: str | Path, index_path: Path, features_key: str | None, cache_files: int = 4):
        self.folder = storage.location(folder)
        info = read_json(index_path.with_suffix(".json")) or {}
        self.files = [self.folder / name for name in info.get("files", [])]
        self.index = load_npy(index_path, mmap=True)
        self.features_key = features_key
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cache_files = cache_files

    def feature_dim(self) -> int:
        """Width of the feature array, from the first .npz's array header (nothing else is read)."""
        path = self.files[0].with_suffix(".npz")
        try:
            with open_input(path) as raw, zipfile.ZipFile(raw) as z, z.open(f"{self.features_key}.npy") as f:
                major, _ = np.lib.format.read_magic(f)
                read_header = (
                    np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                )
                shape, _, _ = read_header(f)
        except KeyError:
            raise MetadataError(
                f"{path}: no array {self.features_key!r}; set metadata.features_key (e.g. l14_img, b32_img)"
            ) from None
        except (OSError, ValueError, zipfile.BadZipFile) as e:
            raise MetadataError(f"{path}: unreadable .npz ({e})") from None
        if len(shape) != 2:
            raise MetadataError(f"{path}: {self.features_key} has shape {shape}, expected (rows, d)")
        return int(shape[1])

    def lookup(self, uids: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(found mask, scores, features of the found rows (n_found, d) float32, or None without
        `features_key`)."""
        hi, lo = uids_to_pairs(uids)
        idx_hi, idx_lo = self.index["hi"], self.index["lo"]
        left = np.searchsorted(idx_hi, hi, side="left")
        right = np.searchsorted(idx_hi, hi, side="right")
        pos = np.full(len(uids), -1, dtype=np.int64)
        for i in range(len(uids)):  # hi collisions are vanishingly rare: a short scan of lo
            a, b = int(left[i]), int(right[i])
            if a < b:
                j = a + int(np.searchsorted(idx_lo[a:b], lo[i], side="left"))
                if j < b and idx_lo[j] == lo[i]:
                    pos[i] = j
        found = pos >= 0
        rec = self.index[pos[found]]
        scores = np.full(len(uids), np.nan, dtype=np.float32)
        scores[found] = rec["score"]
        if not found.any() or self.features_key is None:
            return found, scores, None
        feats = None
        order = np.argsort(rec["file"], kind="stable")
        for f in np.unique(rec["file"]):
            sel = order[rec["file"][order] == f]
            arr = self._features(int(f))
            block = np.asarray(arr[rec["row"][sel].astype(np.int64)], dtype=np.float32)
            if feats is None:
                feats = np.empty((len(rec), block.shape[1]), dtype=np.float32)
            feats[sel] = block
        return found, scores, feats

    def _features(self, file_index: int) -> np.ndarray:
        if file_index in self._cache:
            self._cache.move_to_end(file_index)
            return self._cache[file_index]
        path = self.files[file_index].with_suffix(".npz")
        try:
            with open_input(path) as raw, np.load(raw, allow_pickle=False) as npz:
                arr = npz[self.features_key]
        except KeyError:
            raise MetadataError(
                f"{path}: no array {self.features_key!r}; set metadata.features_key (e.g. l14_img, b32_img)"
            ) from None
        except (OSError, ValueError) as e:
            raise MetadataError(f"{path}: unreadable .npz ({e})") from None
        if arr.ndim != 2:
            raise MetadataError(f"{path}: {self.features_key} has shape {arr.shape}, expected (rows, d)")
        self._cache[file_index] = arr
        while len(self._cache) > self._cache_files:
            self._cache.popitem(last=False)
        return arr
