"""The nominal pool: the uids a pool's DataComp metadata lists, downloaded or not.

DataComp's baselines take their fractions of this count (a sample that failed to download still counts),
while `hype select` counts scored rows by default; `--frac-of nominal` and the summary's `fractions` use
this one. It comes from `--metadata DIR` (the row counts in the parquet footers: nothing else is read),
else from the run's `summary.json` when it was scored with `--metadata` (`metadata.rows`).
"""

from __future__ import annotations

import pyarrow.parquet as pq

from hype.io import open_input, storage
from hype.io.storage import AnyPath
from hype.select.errors import SelectError
from hype.table.reader import ScoresTable


def metadata_dir(table: ScoresTable, given: str | None) -> str | None:
    """The metadata folder: `given`, else the one the run was scored with (`summary.json` models.metadata)."""
    if given:
        return str(given)
    models = (table.run_summary() or {}).get("models") or {}
    return models.get("metadata") if isinstance(models, dict) else None


def nominal_rows(table: ScoresTable, given: str | None) -> int | None:
    """The metadata's uid count (rows), or None when neither `given` nor the run names a metadata folder."""
    if not given:
        meta = (table.run_summary() or {}).get("metadata")
        if isinstance(meta, dict) and isinstance(meta.get("rows"), int):
            return meta["rows"]
    folder = metadata_dir(table, given)
    if folder is None:
        return None
    files = metadata_files(folder)
    rows = 0
    for path in files:
        try:
            with open_input(path) as f:
                rows += pq.ParquetFile(f).metadata.num_rows
        except (OSError, ValueError) as e:
            raise SelectError(f"{path}: not a readable metadata parquet file ({e})") from None
    return rows


def metadata_files(folder: str) -> list[AnyPath]:
    """The `<hash>.parquet` files of a metadata folder (not recursive, as DataComp lays it out)."""
    loc = storage.location(folder)
    if not storage.is_dir(loc):
        raise SelectError(f"--metadata {folder}: no such folder; pass the pool's DataComp metadata folder")
    files = storage.files_with_suffix(loc, ".parquet")
    if not files:
        raise SelectError(f"--metadata {folder}: no <hash>.parquet metadata files in this folder")
    return files
