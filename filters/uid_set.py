"""Set operations with an external DataComp subset file (e.g. a DFN subset; HYPE's best DataComp entries
combine HYPE with DFN).

- `intersect` (a mask, applied before ranking): only rows whose uid is in the file are eligible, e.g. rank
  a DFN subset by HYPE and keep its top part.
- `union` (applied after ranking): every uid of the file is added to the selection. A uid in both keeps
  the file's multiplicity (at least once); uids of the file that were never scored are added too, since
  they may be pool samples `hype score` did not see.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np

from filters.base import Rule
from hype.data.uids import UidError, UidMultiset, from_structured, load_subset, sort_order
from hype.select.errors import SelectError
from hype.select.table import Batch


def load_uid_file(path: str | Path, option: str) -> np.ndarray:
    try:
        arr = load_subset(path)
    except UidError as e:
        raise SelectError(f"{option}: {e}") from None
    if len(arr) == 0:
        raise SelectError(f"{option}: {path} holds no uids; pass a non-empty DataComp subset file")
    return arr


class Intersect(Rule):
    name: ClassVar[str] = "intersect"
    kind: ClassVar[str] = "mask"
    summary: ClassVar[str] = "keep rows whose uid is in a DataComp subset file (path=FILE.npy)"
    PARAMS: ClassVar = {"path": (str, "", "DataComp subset file (.npy, u8,u8)")}

    def __init__(self, **params):
        super().__init__(**params)
        if not self.params["path"]:
            raise SelectError(
                "filter 'intersect' needs a file: --intersect FILE.npy or intersect:path=FILE.npy"
            )
        self.uids = UidMultiset(load_uid_file(self.params["path"], f"--intersect {self.params['path']}"))

    def columns(self) -> list[str]:
        return ["uid"]

    def mask(self, batch: Batch) -> np.ndarray:
        hi, lo = batch.uid_pairs()
        return self.uids.find(hi, lo) >= 0

    def describe(self) -> dict:
        return {"rule": self.name, "path": self.params["path"], "uids": len(self.uids)}


def union(hi: np.ndarray, lo: np.ndarray, path: str | Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """The selection `(hi, lo)` (each uid once) united with the file's uids (with their multiplicity).

    Returns the merged `(hi, lo)` sorted, and counts for the summary."""
    other = load_uid_file(path, f"--union {path}")
    ms = UidMultiset(other)
    in_other = ms.find(hi, lo) >= 0
    keep_hi, keep_lo = hi[~in_other], lo[~in_other]
    other_hi, other_lo = from_structured(other)
    merged_hi = np.concatenate([keep_hi, other_hi])
    merged_lo = np.concatenate([keep_lo, other_lo])
    order = sort_order(merged_hi, merged_lo)
    info = {
        "path": str(path),
        "file_rows": int(len(other)),
        "file_unique": len(ms),
        "already_selected": int(in_other.sum()),  # selected uids that the file also holds
        "added_rows": int(len(merged_hi) - len(hi)),
    }
    return merged_hi[order], merged_lo[order], info
