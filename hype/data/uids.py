"""The one uid codec: DataComp's 128-bit sample ids and its `.npy` subset files.

A uid is a 32-character lowercase hex string. Subset files store it as
`(hi, lo) = divmod(int(uid, 16), 2**64)` in a structured array of dtype `"u8,u8"`, sorted, saved with
`np.save`. Repeated uids mean the sample is repeated; DataComp's resharder looks each sample's
`json["uid"]` up in this array with a binary search, which is why the order matters.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from os import PathLike
from pathlib import Path

import numpy as np

UID_DTYPE = np.dtype("u8,u8")
_UID_RE = re.compile(r"^[0-9a-f]{32}$")


class UidError(ValueError):
    """A uid or a subset file that does not follow DataComp's format."""


def validate_uid(uid: object) -> str:
    """Return `uid` if it is a 32-char lowercase hex string, else raise `UidError` naming it."""
    if not isinstance(uid, str) or not _UID_RE.match(uid):
        raise UidError(f"malformed uid {uid!r}: expected 32 lowercase hex characters (a 128-bit hash)")
    return uid


def uid_to_pair(uid: str) -> tuple[int, int]:
    """`"00..ff"` -> `(hi, lo)` as DataComp encodes it."""
    return divmod(int(validate_uid(uid), 16), 2**64)


def pair_to_uid(hi: int, lo: int) -> str:
    """`(hi, lo)` -> 32-char lowercase hex uid."""
    hi, lo = int(hi), int(lo)
    if not (0 <= hi < 2**64 and 0 <= lo < 2**64):
        raise UidError(f"uid halves out of range: hi={hi}, lo={lo}")
    return f"{(hi << 64) | lo:032x}"


def uids_to_array(uids: Iterable[str], *, sort: bool = True) -> np.ndarray:
    """Encode uids into a `"u8,u8"` structured array (sorted by default, duplicates kept)."""
    uids = list(uids)
    bad = [u for u in uids if not isinstance(u, str) or not _UID_RE.match(u)]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise UidError(f"malformed uid {bad[0]!r}{more}: expected 32 lowercase hex characters")
    # Two vectorised halves: int(u[:16], 16) is the high word, int(u[16:], 16) the low word.
    arr = np.empty(len(uids), dtype=UID_DTYPE)
    arr["f0"] = np.array([int(u[:16], 16) for u in uids], dtype=np.uint64)
    arr["f1"] = np.array([int(u[16:], 16) for u in uids], dtype=np.uint64)
    if sort:
        arr.sort(order=["f0", "f1"])
    return arr


def array_to_uids(arr: np.ndarray) -> list[str]:
    """Decode a `"u8,u8"` array back into hex uids, in array order."""
    arr = _check_dtype(arr, "array")
    return [f"{int(h):016x}{int(lo):016x}" for h, lo in zip(arr["f0"], arr["f1"], strict=True)]


def is_sorted(arr: np.ndarray) -> bool:
    """True when the array is in the (hi, lo) ascending order DataComp's binary search needs."""
    hi, lo = arr["f0"], arr["f1"]
    return bool(np.all((hi[:-1] < hi[1:]) | ((hi[:-1] == hi[1:]) & (lo[:-1] <= lo[1:]))))


def save_subset(path: str | PathLike, uids: Iterable[str] | np.ndarray) -> Path:
    """Write a DataComp subset file (sorted `"u8,u8"` `.npy`). Written atomically."""
    arr = uids if isinstance(uids, np.ndarray) else uids_to_array(uids)
    arr = np.sort(_check_dtype(arr, "subset"), order=["f0", "f1"])
    path = Path(path)
    if path.suffix != ".npy":
        raise UidError(f"{path}: subset files must end in .npy (np.save would append it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, arr, allow_pickle=False)
    tmp.replace(path)
    return path


def load_subset(path: str | PathLike) -> np.ndarray:
    """Read and validate a DataComp subset file; never unpickles."""
    path = Path(path)
    if not path.exists():
        raise UidError(f"{path}: subset file not found")
    try:
        arr = np.load(path, allow_pickle=False)
    except ValueError as e:
        raise UidError(f"{path}: not a plain .npy array ({e}); expected dtype 'u8,u8'") from e
    arr = _check_dtype(arr, str(path))
    if not is_sorted(arr):
        raise UidError(f"{path}: uids are not sorted; rewrite it with hype.data.uids.save_subset")
    return arr


def _check_dtype(arr: np.ndarray, what: str) -> np.ndarray:
    if (
        arr.dtype.names is None
        or len(arr.dtype.names) != 2
        or any(arr.dtype[i] != np.dtype("u8") for i in range(2))
    ):
        raise UidError(f"{what}: dtype {arr.dtype} is not DataComp's 'u8,u8' structured dtype")
    if arr.ndim != 1:
        raise UidError(f"{what}: expected a 1-D array, got shape {arr.shape}")
    return arr.astype(UID_DTYPE, copy=False)
