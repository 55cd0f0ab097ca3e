"""What `hype select` writes next to each other:

- `subset.npy`: the DataComp subset file (sorted `"u8,u8"`), written by the uid codec
  (`hype.data.uids.write_subset`);
- `subset.parquet`: the selected rows of the scores table with their combined `score` and metrics (rows
  in table order, then the rows chosen at the cut, best first; uids added by `--union` are not in it:
  they have no row in the scores table);
- `subset.json`: the machine-readable summary (counts, target, rules, cut, pool vs subset statistics), the
  selection's completion marker (`hype.io.runs.Marker`), written last.

Every file is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hype.data.uids import pair_to_uid, pairs_to_arrow, sorted_uids
from hype.io import atomic_sink, json_text, storage
from hype.io import write_json as _write_json
from hype.io.runs import Marker
from hype.io.storage import AnyPath
from hype.select.errors import SelectError
from hype.table.stats import RunningStats


def output_paths(out: str | os.PathLike) -> tuple[AnyPath, AnyPath, AnyPath]:
    """`subset.npy` -> (`subset.npy`, `subset.parquet`, `subset.json`), local paths or URLs."""
    npy = storage.location(out)
    if npy.suffix != ".npy":
        raise SelectError(
            f"--out {out}: the subset file must end in .npy (DataComp's format), e.g. subset.npy"
        )
    return npy, npy.with_suffix(".parquet"), npy.with_suffix(".json")


class SubsetWriter:
    """The reducer's sink: streams kept rows to the Parquet file, keeps their uids and statistics."""

    def __init__(self, parquet: Path, metrics: list[str]):
        self.parquet = parquet
        self.metrics = metrics
        self.stats = {m: RunningStats() for m in [*metrics, "score"]}
        self.hi: list[np.ndarray] = []
        self.lo: list[np.ndarray] = []
        self.rows = 0
        self.schema = pa.schema(
            [("uid", pa.string()), ("score", pa.float64()), *[(m, pa.float32()) for m in metrics]]
        )
        # Streamed to a temporary name that close() fsyncs and renames into place and abort() removes; to a
        # bucket, uploaded while it is written and completed by close() (abort() cancels the upload).
        self._target = atomic_sink(parquet)
        self._tmp = self._target.__enter__()
        self._writer: pq.ParquetWriter | None = pq.ParquetWriter(
            self._tmp,
            self.schema,
            compression="zstd",
            use_dictionary=False,  # uids are unique: no dictionary
            use_byte_stream_split=["score", *metrics],  # floats: ~15% smaller under zstd
        )

    def __call__(
        self,
        hi: np.ndarray,
        lo: np.ndarray,
        score: np.ndarray,
        columns: dict[str, np.ndarray],
        uids: pa.Array | None = None,
    ) -> None:
        if len(hi) == 0:
            return
        self.hi.append(hi)
        self.lo.append(lo)
        self.rows += len(hi)
        self.stats["score"].add(score)
        if uids is None:
            uids = pairs_to_arrow(hi, lo)
        arrays = [uids.cast(pa.string()), pa.array(score, pa.float64())]
        for m in self.metrics:
            self.stats[m].add(columns[m])
            arrays.append(pa.array(np.asarray(columns[m], dtype=np.float32)))
        assert self._writer is not None
        self._writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=self.schema))

    def uid_array(self) -> np.ndarray:
        """The kept uids as a sorted `"u8,u8"` array (the chunks are released); raises when the scores table
        listed one of them twice."""
        arr = sorted_uids(self.hi, self.lo)
        hi, lo = arr["f0"], arr["f1"]
        dup = np.flatnonzero((hi[1:] == hi[:-1]) & (lo[1:] == lo[:-1]))
        if len(dup):
            uid = pair_to_uid(hi[dup[0]], lo[dup[0]])
            raise SelectError(
                f"uid {uid} (and {len(dup) - 1} more) appears more than once in the scores table, so the "
                "subset would repeat it; a shard was probably scored twice: remove the duplicate part files "
                "from the run's scores/ folder or rescore"
            )
        return arr

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            self._target.__exit__(None, None, None)

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            aborted = RuntimeError("aborted")
            self._target.__exit__(RuntimeError, aborted, None)  # removes the temporary, keeps no file


def write_json(path: Path, obj: dict) -> None:
    _write_json(path, obj, sort_keys=False, allow_nan=False, default=_json_default)


def write_summary(path: AnyPath, fp: str, summary: dict) -> dict:
    """Mark the selection done: `summary` (numpy numbers and paths as JSON values, NaN refused) as the run
    contract's marker with fingerprint `fp`. Returns the marker."""
    fields = json.loads(json_text(summary, sort_keys=False, allow_nan=False, default=_json_default))
    return Marker(path).write(fp, **fields)


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, Path) or hasattr(o, "protocol"):  # a local path or a URL (UPath)
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
