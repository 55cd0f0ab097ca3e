"""`--union FILE`: every uid of an external DataComp subset file (e.g. a DFN subset) is added to the
selection after ranking (HYPE's best DataComp entries combine HYPE with DFN).

A uid in both keeps the file's multiplicity (at least once); uids of the file that were never scored are
added too, since they may be pool samples `hype score` did not see. Its counterpart before ranking is the
`intersect` filter (a mask rule).
"""

from __future__ import annotations

from os import PathLike

import numpy as np

from hype.data.uids import UidMultiset, from_structured, load_uid_file, sort_order


def union(hi: np.ndarray, lo: np.ndarray, path: str | PathLike) -> tuple[np.ndarray, np.ndarray, dict]:
    """The selection `(hi, lo)` (each uid once) united with the file's uids (with their multiplicity).

    Returns the merged `(hi, lo)` sorted, and counts for the summary."""
    other = load_uid_file(path, "--union")  # errors start with the path
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
