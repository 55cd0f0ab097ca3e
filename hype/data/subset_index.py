"""Look samples up in a DataComp subset file without resharding.

DataComp's resharder keeps a sample when its `json["uid"]` is in the sorted `"u8,u8"` subset array and
writes it once per occurrence; `SubsetIndex.count` gives that multiplicity with the same binary search,
so training on shards + subset sees exactly the samples the resharded subset would hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from os import PathLike

import numpy as np

from hype.data.uids import UID_DTYPE, UidError, load_uid_file, uids_to_array
from hype.io import read_parquet, read_parquet_schema, storage


class SubsetError(ValueError):
    """A subset that cannot be used with the given data (e.g. it matches none of its samples)."""


class SubsetIndex:
    """Multiplicity of each uid in a sorted subset array (0 when absent)."""

    def __init__(self, uids: np.ndarray, source: str = "<array>"):
        self.uids = np.ascontiguousarray(uids, dtype=UID_DTYPE)
        self.source = source

    @classmethod
    def load(cls, path: str | PathLike) -> SubsetIndex:
        """A non-empty subset file, `.npy` or raw memmap (`SelectError` naming `--subset` otherwise)."""
        return cls(load_uid_file(path, "--subset"), str(path))  # a local path or a URL

    def __len__(self) -> int:
        return len(self.uids)

    @property
    def num_unique(self) -> int:
        u = self.uids
        return int(
            len(u) and 1 + np.count_nonzero((u["f0"][1:] != u["f0"][:-1]) | (u["f1"][1:] != u["f1"][:-1]))
        )

    def count(self, uid: str) -> int:
        """How many times `uid` appears in the subset; a malformed uid counts as absent."""
        try:
            q = uids_to_array([uid], sort=False)
        except UidError:
            return 0
        return int(np.searchsorted(self.uids, q, "right")[0] - np.searchsorted(self.uids, q, "left")[0])

    def count_many(self, uids: Sequence[str]) -> np.ndarray:
        """Vectorised `count` (uids must be well formed)."""
        q = uids_to_array(list(uids), sort=False)
        return np.searchsorted(self.uids, q, "right") - np.searchsorted(self.uids, q, "left")


def count_matches_from_parquet(
    shards: Sequence[str], index: SubsetIndex, max_shards: int
) -> tuple[int, int, int]:
    """Count subset samples using the `.parquet` written next to each tar (img2dataset layout).

    Reads only the `uid` column of up to `max_shards` parquet files (evenly spread over the list), so
    it is fast. Returns (matched samples incl. repeats, samples checked, shards checked); shards without
    a readable parquet are not checked.
    """
    unique = list(dict.fromkeys(shards))
    if len(unique) > max_shards:
        step = len(unique) / max_shards
        unique = [unique[int(i * step)] for i in range(max_shards)]
    matched = checked = shards_checked = 0
    for shard in unique:
        pq_path = storage.location(shard).with_suffix(".parquet")
        try:
            names = read_parquet_schema(pq_path).names
            cols = ["uid", "status"] if "status" in names else ["uid"]
            table = read_parquet(pq_path, cols)
        except Exception:  # a missing column or an unreadable file: this shard simply stays unchecked
            continue
        col = table.column("uid").to_pylist()
        if "status" in cols:
            status = table.column("status").to_pylist()
            col = [u for u, s in zip(col, status, strict=True) if s == "success"]
        col = [u for u in col if isinstance(u, str) and len(u) == 32]
        try:
            matched += int(index.count_many(col).sum()) if col else 0
        except UidError:
            continue
        checked += len(col)
        shards_checked += 1
    return matched, checked, shards_checked


def check_subset_matches(shards: Sequence[str], index: SubsetIndex, data_spec: str, max_shards: int) -> dict:
    """Fail early, with a clear message, when a subset matches no sample of the data.

    Exact when every shard has its parquet and `max_shards` covers them; otherwise a zero count is only
    a warning sign and the streaming check in the training pipeline has the last word.
    Returns a dict for the run summary.
    """
    matched, checked, shards_checked = count_matches_from_parquet(shards, index, max_shards)
    n_unique = len(set(shards))
    complete = shards_checked == n_unique
    if matched == 0 and complete:
        raise SubsetError(
            f"subset {index.source} ({len(index)} uids) matches none of the {checked} samples of "
            f"{data_spec}; it was probably made for another pool (check --data and --subset)"
        )
    return {
        "subset_uids": len(index),
        "subset_unique_uids": index.num_unique,
        "matched_samples": matched,
        "checked_samples": checked,
        "checked_shards": shards_checked,
        "complete": complete,
    }


def resolve_subset(path: str | PathLike | None) -> SubsetIndex | None:
    return None if path is None else SubsetIndex.load(path)
