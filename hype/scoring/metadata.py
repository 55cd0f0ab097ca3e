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
"""

from __future__ import annotations

import io
import time
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np

from hype.data.uids import normalize_arrow_uids, uids_to_pairs
from hype.io import load_npy, open_input, read_parquet, storage
from hype.io.storage import AnyPath
from hype.scoring.rundir import atomic_write_bytes, atomic_write_json, file_identity, fingerprint, read_json

INDEX_DTYPE = np.dtype([("hi", "<u8"), ("lo", "<u8"), ("file", "<u4"), ("row", "<u4"), ("score", "<f4")])


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
    parts, malformed = [], 0
    for i, path in enumerate(files):
        columns = ["uid"] if score_column is None else ["uid", score_column]
        try:
            table = read_parquet(path, columns=columns)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for bad files/columns
            raise MetadataError(
                f"{path}: cannot read columns {', '.join(columns)} ({e}); set metadata.score_column to "
                "the CLIP score column of this metadata"
            ) from None
        # The uids as shard samples' are read (`normalize_uid`); a row without one matches no sample.
        hi, lo, valid = normalize_arrow_uids(table.column("uid"))
        rows = np.flatnonzero(valid)
        malformed += len(valid) - len(rows)
        part = np.empty(len(rows), INDEX_DTYPE)
        part["hi"], part["lo"], part["file"] = hi[rows], lo[rows], i
        part["row"] = rows.astype(np.uint32)  # the row in the file (and in its row-aligned .npz)
        part["score"] = (
            np.nan
            if score_column is None
            else table.column(score_column).to_numpy(zero_copy_only=False).astype(np.float32)[rows]
        )
        parts.append(part)
    index = np.concatenate(parts)
    # Stable by (hi, lo): a uid listed twice resolves to its first (file, row).
    index = index[np.lexsort((index["lo"], index["hi"]))]
    buf = io.BytesIO()
    np.save(buf, index, allow_pickle=False)
    atomic_write_bytes(index_path, buf.getvalue())
    info = {
        "fingerprint": fp,
        "folder": storage.absolute(folder),
        "files": [p.name for p in files],
        "rows": int(index.shape[0]),
        "malformed_uids": malformed,  # rows without a 32-hex uid: left out, they match no sample
        "score_column": score_column,
        "seconds": round(time.perf_counter() - started, 3),
    }
    atomic_write_json(marker, info)
    return info


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
