"""The one uid codec: DataComp's 128-bit sample ids and its subset files.

Scalar functions convert one uid at a time (`uid_to_pair`, `pair_to_uid`, `validate_uid`, and
`normalize_uid`, the one reading of a shard sample's `json["uid"]`); the vectorised ones (`arrow_to_pairs`,
`pairs_to_arrow`, `uids_to_pairs`, `sort_order`, `UidMultiset`) do the same on whole Arrow / NumPy
arrays with a lookup table over the raw string bytes, for tables with millions of rows (one Python
`int()` per uid takes minutes at DataComp scale); tests check that both agree exactly.

A uid is a 32-character lowercase hex string. Subset files store it as
`(hi, lo) = divmod(int(uid, 16), 2**64)` in a structured array of dtype `"u8,u8"`, sorted, saved with
`np.save` or, as DataComp's README also allows, as a raw memmap (the 16-byte records, no header; DataComp's
`load_subset` tells the two apart by the `.npy` magic string). Repeated uids mean the sample is repeated;
DataComp's resharder looks each sample's `json["uid"]` up in this array with a binary search, which is why
the order matters. `load_subset` reads both layouts (hype writes `.npy`); `load_uid_file` is the same for a
command-line option, which every command taking a subset file goes through.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterable, Sequence
from os import PathLike
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hype.data.errors import SelectError
from hype.io import NPY_ERRORS, atomic_path, local_file, storage

UID_DTYPE = np.dtype("u8,u8")
_UID_RE = re.compile(r"[0-9a-f]{32}", re.ASCII)  # always with fullmatch: `$` would let a final "\n" in


class UidError(ValueError):
    """A uid or a subset file that does not follow DataComp's format."""


def validate_uid(uid: object) -> str:
    """Return `uid` if it is a 32-char lowercase hex string, else raise `UidError` naming it."""
    if not isinstance(uid, str) or not _UID_RE.fullmatch(uid):
        raise UidError(f"malformed uid {uid!r}: expected 32 lowercase hex characters (a 128-bit hash)")
    return uid


def uid_to_pair(uid: str) -> tuple[int, int]:
    """`"00..ff"` -> `(hi, lo)` as DataComp encodes it."""
    return divmod(int(validate_uid(uid), 16), 2**64)


def normalize_uid(value: object) -> str | None:
    """The canonical form of a shard sample's `json["uid"]`, or None when it has none.

    Canonical is 32 lowercase ASCII hex digits. Two spellings of such a uid are accepted and rewritten:
    surrounding whitespace (stripped) and upper case (lowered). Everything else is refused, not guessed at:
    a non-string, another length (leading zeros, a `0x` prefix, a short uid), non-ASCII digits (Python's
    `int(uid, 16)`, and so DataComp's resharder, reads full-width digits), signs and underscores. Scoring,
    training (`--subset`) and reshard all read uids through here, so a sample is the same uid, or the
    same counted `bad_uid` skip, in each of them, and names built from it are always `<32 hex>-<j>`.
    """
    if not isinstance(value, str):
        return None
    uid = value.strip()
    if len(uid) != 32 or not uid.isascii():  # isascii first: lower() of some non-ASCII letters is ASCII
        return None
    uid = uid.lower()
    return uid if _UID_RE.fullmatch(uid) else None


def pair_to_uid(hi: int, lo: int) -> str:
    """`(hi, lo)` -> 32-char lowercase hex uid."""
    hi, lo = int(hi), int(lo)
    if not (0 <= hi < 2**64 and 0 <= lo < 2**64):
        raise UidError(f"uid halves out of range: hi={hi}, lo={lo}")
    return f"{(hi << 64) | lo:032x}"


def uids_to_array(uids: Iterable[str], *, sort: bool = True) -> np.ndarray:
    """Encode uids into a `"u8,u8"` structured array (sorted by default, duplicates kept)."""
    uids = list(uids)
    bad = [u for u in uids if not isinstance(u, str) or not _UID_RE.fullmatch(u)]
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


def uids_to_pairs(uids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Valid uids (a list, e.g. a column's `to_pylist()`) -> `(hi, lo)` uint64 arrays, through one
    `bytes.fromhex` of them all; `arrow_to_pairs` is the validating form for Arrow columns."""
    if len(uids) == 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    raw = np.frombuffer(bytes.fromhex("".join(uids)), dtype=">u8").reshape(-1, 2)
    return raw[:, 0].astype(np.uint64), raw[:, 1].astype(np.uint64)


def array_to_uids(arr: np.ndarray) -> list[str]:
    """Decode a `"u8,u8"` array back into hex uids, in array order."""
    arr = _check_dtype(arr, "array")
    return [pair_to_uid(h, lo) for h, lo in zip(arr["f0"], arr["f1"], strict=True)]


def is_sorted(arr: np.ndarray) -> bool:
    """True when the array is in the (hi, lo) ascending order DataComp's binary search needs."""
    hi, lo = arr["f0"], arr["f1"]
    return bool(np.all((hi[:-1] < hi[1:]) | ((hi[:-1] == hi[1:]) & (lo[:-1] <= lo[1:]))))


def save_subset(path: str | PathLike, uids: Iterable[str] | np.ndarray) -> Path:
    """Write a DataComp subset file (sorted `"u8,u8"` `.npy`), sorting the uids first. Written atomically."""
    arr = uids if isinstance(uids, np.ndarray) else uids_to_array(uids)
    arr = _check_dtype(arr, "subset")
    if not is_sorted(arr):
        arr = arr[sort_order(arr["f0"], arr["f1"])]  # NumPy's structured sort takes ~40 s for 20M uids
    write_subset(path, arr)
    return storage.location(path)


def write_subset(path: str | PathLike, arr: np.ndarray) -> np.ndarray:
    """Write an already sorted `"u8,u8"` array as a DataComp subset file (`np.save`, atomically) and return
    it as `load_subset` reads it back: checked before the file gets its name (for a URL: before the
    upload, not by downloading it back)."""
    if storage.location(path).suffix != ".npy":
        raise UidError(f"{path}: subset files must end in .npy (np.save would append it)")
    if arr.dtype != UID_DTYPE or not is_sorted(arr):
        raise UidError(f"{path}: a subset file is a sorted 'u8,u8' array; write it with save_subset")
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, arr, allow_pickle=False)
        back = load_subset(tmp)
        if len(back) != len(arr):
            raise UidError(f"{path}: wrote {len(arr)} uids, read back {len(back)}")
    return back


def load_subset(path: str | PathLike) -> np.ndarray:
    """Read and validate a DataComp subset file in either layout DataComp's resharder reads: an `.npy` (told
    apart by its magic string, as DataComp does) or a raw memmap of 16-byte `u8,u8` records (anything else).
    Never unpickles; an unusable file gets an error naming what was found. `path` may be a URL."""
    if storage.is_url(path):
        if not storage.is_file(path):
            raise UidError(f"{path}: subset file not found")
        with local_file(path) as local:
            try:
                return load_subset(local)
            except UidError as e:  # name the URL, not the temporary copy
                raise UidError(str(e).replace(str(local), str(path))) from None
    path = Path(path)
    if not path.exists():
        raise UidError(f"{path}: subset file not found")
    if path.is_dir():
        raise UidError(f"{path}: is a folder; pass the subset file itself")
    with open(path, "rb") as f:
        magic = f.read(len(_NPY_MAGIC))
    arr, head = (_load_npy(path), b"") if magic == _NPY_MAGIC else _load_raw(path)
    if not is_sorted(arr):
        # A file of another format whose size happens to fit the memmap layout: name the format, which is
        # only looked at now so that a valid memmap is never refused for its first bytes.
        found = _describe_binary(head)
        if found is not None:
            raise UidError(f"{path}: found {found}; {_EXPECTED}")
        raise UidError(f"{path}: uids are not sorted; rewrite it with hype.data.uids.save_subset")
    return arr


def load_uid_file(path: str | PathLike, option: str) -> np.ndarray:
    """A non-empty subset file given to a command-line `option`; errors name the option (`SelectError`)."""
    try:
        arr = load_subset(path)
    except UidError as e:
        raise SelectError(f"{option}: {e}") from None
    if len(arr) == 0:
        raise SelectError(f"{option}: {path} holds no uids; pass a non-empty DataComp subset file")
    return arr


_NPY_MAGIC = b"\x93NUMPY"
_EXPECTED = (
    "a DataComp subset file is a 1-D array of dtype 'u8,u8' (each uid as two uint64 halves) saved with "
    "np.save (.npy) or as a raw memmap; write one with hype.data.uids.save_subset"
)
# Bytes of a plain text file: printable ASCII and whitespace.
_TEXT_BYTES = bytes(range(0x20, 0x7F)) + b"\t\n\r"


def _load_npy(path: Path) -> np.ndarray:
    try:
        arr = np.load(path, allow_pickle=False)
    except NPY_ERRORS as e:  # object arrays (pickles), a damaged header, truncated data
        raise UidError(f"{path}: found {_describe_npy(path, e)}; {_EXPECTED}") from None
    if not _is_uid_dtype(arr.dtype) or arr.ndim != 1:
        raise UidError(
            f"{path}: found a NumPy file holding {_describe_array(arr.shape, arr.dtype)}; {_EXPECTED}"
        )
    return arr.astype(UID_DTYPE, copy=False)


def _load_raw(path: Path) -> tuple[np.ndarray, bytes]:
    """DataComp's memmap layout: the records themselves, native byte order, no header. Returns the array
    and the file's first bytes."""
    with open(path, "rb") as f:
        head = f.read(4096)
    # Text is refused first: uids written as text can have a size that is a multiple of 16 (one uid without
    # a newline is 32 bytes); a memmap of hashed uids reads as text only if each of its first 256 uids does
    # (odds of about 1 in 5 million each).
    if head and not head.translate(None, _TEXT_BYTES):
        first = head.split(b"\n", 1)[0][:40].decode("ascii")
        raise UidError(f"{path}: found a text file (first line {first!r}); {_EXPECTED}")
    size = path.stat().st_size
    if size % UID_DTYPE.itemsize:
        found = _describe_binary(head) or (
            f"a {size}-byte file that is not an .npy file and whose size is not a multiple of "
            f"{UID_DTYPE.itemsize} bytes (the record size of a raw memmap of 'u8,u8' uids)"
        )
        raise UidError(f"{path}: found {found}; {_EXPECTED}")
    return np.fromfile(path, dtype=UID_DTYPE), head


def _describe_npy(path: Path, error: Exception) -> str:
    """What an `.npy` that `np.load(allow_pickle=False)` refused holds, from its header."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read(f)
    except NPY_ERRORS:
        return f"a NumPy file whose header cannot be read ({error})"
    what = f"a NumPy file holding {_describe_array(shape, dtype)}"
    if dtype.hasobject:
        return f"{what} (Python objects, readable only by unpickling, which hype never does)"
    return f"{what} that cannot be read ({error})"


def _describe_array(shape: tuple, dtype: np.dtype) -> str:
    name = str(dtype) if dtype.names else dtype.name
    return f"a {len(shape)}-D {name} array of shape {tuple(shape)}"


def _describe_binary(head: bytes) -> str | None:
    """A few formats people pass by mistake, recognised by their first bytes; None for anything else."""
    if head.startswith(b"PK\x03\x04"):
        return "a ZIP archive (an .npz or a torch file? pass the .npy array of uids itself)"
    if head.startswith(b"PAR1"):
        return "a Parquet table (select its uids with hype select, or encode them with save_subset)"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a Python pickle (hype never unpickles)"
    return None


def _is_uid_dtype(dtype: np.dtype) -> bool:
    names = dtype.names
    return names is not None and len(names) == 2 and all(dtype[i] == np.dtype("u8") for i in range(2))


def _check_dtype(arr: np.ndarray, what: str) -> np.ndarray:
    if not _is_uid_dtype(arr.dtype):
        raise UidError(f"{what}: dtype {arr.dtype} is not DataComp's 'u8,u8' structured dtype")
    if arr.ndim != 1:
        raise UidError(f"{what}: expected a 1-D array, got shape {arr.shape}")
    return arr.astype(UID_DTYPE, copy=False)


# Vectorised codec ------------------------------------------------------------------------------

_HEX_DIGITS = b"0123456789abcdef"
_NIBBLE = np.full(256, 255, dtype=np.uint8)
_NIBBLE[np.frombuffer(_HEX_DIGITS, dtype=np.uint8)] = np.arange(16, dtype=np.uint8)
_ASCII = np.frombuffer(_HEX_DIGITS, dtype=np.uint8)


def arrow_to_pairs(
    uids: pa.Array | pa.ChunkedArray, where: str = "uid column"
) -> tuple[np.ndarray, np.ndarray]:
    """Decode an Arrow string array of uids into `(hi, lo)` uint64 arrays; raise naming the first bad uid."""
    if isinstance(uids, pa.ChunkedArray):
        uids = uids.combine_chunks() if uids.num_chunks != 1 else uids.chunk(0)
    n = len(uids)
    if n == 0:
        return np.empty(0, np.uint64), np.empty(0, np.uint64)
    if not (pa.types.is_string(uids.type) or pa.types.is_large_string(uids.type)):
        raise UidError(f"{where}: uids must be strings, got Arrow type {uids.type}")
    if uids.null_count:
        i = int(np.flatnonzero(uids.is_null().to_numpy(zero_copy_only=False))[0])
        raise UidError(f"{where}: {uids.null_count} null uid(s), first at row {i}; every row needs a uid")
    offset_type = np.int64 if pa.types.is_large_string(uids.type) else np.int32
    buffers = uids.buffers()
    offsets = np.frombuffer(buffers[1], dtype=offset_type)[uids.offset : uids.offset + n + 1]
    lengths = np.diff(offsets)
    if not np.all(lengths == 32):
        _bad_uid(uids, int(np.flatnonzero(lengths != 32)[0]), where)
    data = np.frombuffer(buffers[2], dtype=np.uint8)[offsets[0] : offsets[-1]].reshape(n, 32)
    nibbles = _NIBBLE[data]
    if (nibbles == 255).any():
        _bad_uid(uids, int(np.flatnonzero((nibbles == 255).any(axis=1))[0]), where)
    octets = (nibbles[:, 0::2] << 4) | nibbles[:, 1::2]  # (n, 16) bytes, most significant first
    hi = octets[:, :8].copy().view(">u8").ravel().astype(np.uint64)
    lo = octets[:, 8:].copy().view(">u8").ravel().astype(np.uint64)
    return hi, lo


_NIBBLE_ANY_CASE = _NIBBLE.copy()
_NIBBLE_ANY_CASE[np.frombuffer(b"ABCDEF", dtype=np.uint8)] = np.arange(10, 16, dtype=np.uint8)


def normalize_arrow_uids(uids: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`normalize_uid` over a whole Arrow array: `(hi, lo, valid)`, the halves of each row's canonical uid
    and whether it has one (rows without: nulls, non-strings, malformed uids, are 0 in `hi` and `lo`)."""
    if isinstance(uids, pa.ChunkedArray):
        uids = uids.combine_chunks() if uids.num_chunks != 1 else uids.chunk(0)
    n = len(uids)
    hi, lo, valid = np.zeros(n, np.uint64), np.zeros(n, np.uint64), np.zeros(n, dtype=bool)
    if n == 0 or not (pa.types.is_string(uids.type) or pa.types.is_large_string(uids.type)):
        return hi, lo, valid
    uids = pc.utf8_trim_whitespace(uids)
    # Rows of exactly 32 bytes (a non-ASCII character makes fewer than 32 characters), gathered into one
    # contiguous array so that they read as an (n, 32) block of bytes.
    ok = pc.fill_null(pc.equal(pc.binary_length(uids), 32), False)
    rows = np.flatnonzero(ok.to_numpy(zero_copy_only=False))
    if len(rows) == 0:
        return hi, lo, valid
    kept = uids.filter(ok) if len(rows) < n else uids
    offset_type = np.int64 if pa.types.is_large_string(kept.type) else np.int32
    buffers = kept.buffers()
    start = int(np.frombuffer(buffers[1], dtype=offset_type)[kept.offset])
    data = np.frombuffer(buffers[2], dtype=np.uint8)[start : start + 32 * len(rows)]
    nibbles = _NIBBLE_ANY_CASE[data.reshape(len(rows), 32)]
    hex_rows = ~(nibbles == 255).any(axis=1)
    rows, nibbles = rows[hex_rows], nibbles[hex_rows]
    octets = (nibbles[:, 0::2] << 4) | nibbles[:, 1::2]
    hi[rows] = octets[:, :8].copy().view(">u8").ravel()
    lo[rows] = octets[:, 8:].copy().view(">u8").ravel()
    valid[rows] = True
    return hi, lo, valid


def _bad_uid(uids: pa.Array, i: int, where: str) -> None:
    raise UidError(
        f"{where}: malformed uid {uids[i].as_py()!r} at row {i}: expected 32 lowercase hex characters "
        "(DataComp's 128-bit uid); fix the table that produced it"
    )


def pairs_to_arrow(hi: np.ndarray, lo: np.ndarray) -> pa.StringArray:
    """`(hi, lo)` uint64 arrays -> Arrow string array of 32-char lowercase hex uids."""
    n = len(hi)
    octets = np.empty((n, 16), dtype=np.uint8)
    octets[:, :8] = np.ascontiguousarray(hi, dtype=">u8").view(np.uint8).reshape(n, 8)
    octets[:, 8:] = np.ascontiguousarray(lo, dtype=">u8").view(np.uint8).reshape(n, 8)
    chars = np.empty((n, 32), dtype=np.uint8)
    chars[:, 0::2] = _ASCII[octets >> 4]
    chars[:, 1::2] = _ASCII[octets & 15]
    offsets = np.arange(0, 32 * n + 1, 32, dtype=np.int64 if 32 * n >= 2**31 else np.int32)
    typ = pa.large_string() if offsets.dtype == np.int64 else pa.string()
    return pa.Array.from_buffers(typ, n, [None, pa.py_buffer(offsets), pa.py_buffer(chars.tobytes())])


def to_structured(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """`(hi, lo)` -> DataComp's `"u8,u8"` structured array (same order)."""
    arr = np.empty(len(hi), dtype=UID_DTYPE)
    arr["f0"] = hi
    arr["f1"] = lo
    return arr


def from_structured(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DataComp's `"u8,u8"` structured array -> `(hi, lo)` uint64 arrays (copies, same order)."""
    return arr["f0"].astype(np.uint64), arr["f1"].astype(np.uint64)


def sort_order(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """Indices that sort `(hi, lo)` ascending, as `np.sort(order=["f0", "f1"])` would, in about a second per
    20M uids.

    Sorts one uint64 array whose top bits are the top bits of `hi` and whose low bits are the row index
    (NumPy's SIMD sort of plain integers is ~50x faster than its structured or arg- sorts); uids sharing
    those top bits (rare for hashes, common for made-up sequential uids) are then put in exact order.
    """
    n = len(hi)
    if n <= 1:
        return np.arange(n, dtype=np.int64)
    hi = np.asarray(hi, dtype=np.uint64)
    lo = np.asarray(lo, dtype=np.uint64)
    index_bits = max(1, int(n - 1).bit_length())
    if index_bits > 40:  # fewer than 24 bits of hi left: not worth it
        return np.lexsort((lo, hi))
    shift = np.uint64(index_bits)
    # One n-sized array in all (the packed keys, then in place the row numbers): the steps that need a
    # temporary take it slice by slice.
    step = 1 << 20
    packed = hi >> shift
    packed <<= shift
    for a in range(0, n, step):
        packed[a : a + step] |= np.arange(a, min(a + step, n), dtype=np.uint64)
    packed.sort()
    same = np.empty(n - 1, dtype=bool)  # neighbours with equal prefixes
    for a in range(0, n - 1, step):
        b = min(a + step, n - 1)
        np.equal(packed[a + 1 : b + 1] >> shift, packed[a:b] >> shift, out=same[a:b])
    packed &= np.uint64((1 << index_bits) - 1)
    order = packed.view(np.int64)
    if same.any():
        # Rows in runs of equal prefix: re-sort them by (run, hi, lo); runs stay where they are.
        in_run = np.zeros(n, dtype=bool)
        in_run[1:] |= same
        in_run[:-1] |= same
        pos = np.flatnonzero(in_run)
        starts = np.ones(len(pos), dtype=bool)  # a run starts where its row's prefix differs from the last
        starts[1:] = ~same[pos[1:] - 1]
        run_id = np.cumsum(starts)
        rows = order[pos]
        order[pos] = rows[np.lexsort((lo[rows], hi[rows], run_id))]
    return order


def sorted_uids(his: list[np.ndarray], los: list[np.ndarray]) -> np.ndarray:
    """Chunks of `(hi, lo)` -> one sorted `"u8,u8"` array. The chunk lists are emptied as they are merged,
    so the peak is about 2.5 times the output (the halves, the order, the result) instead of five."""
    hi = np.concatenate(his) if his else np.empty(0, np.uint64)
    his.clear()
    lo = np.concatenate(los) if los else np.empty(0, np.uint64)
    los.clear()
    order = sort_order(hi, lo)
    arr = np.empty(len(order), dtype=UID_DTYPE)
    step = 1 << 22  # gather in slices: no n-sized temporary for each half
    for half, src in (("f0", hi), ("f1", lo)):
        out = arr[half]
        for i in range(0, len(order), step):
            out[i : i + step] = src[order[i : i + step]]
    return arr


class UidMultiset:
    """Multiplicity lookups in a sorted `"u8,u8"` subset array (duplicates mean repeats, as in DataComp)."""

    def __init__(self, subset: np.ndarray):
        hi, lo = np.asarray(subset["f0"], np.uint64), np.asarray(subset["f1"], np.uint64)
        start = np.ones(len(hi), dtype=bool)
        start[1:] = (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])
        first = np.flatnonzero(start)
        self.hi, self.lo = hi[first], lo[first]  # unique uids, sorted
        self.counts = np.diff(np.append(first, len(hi)))

    @classmethod
    def from_unique(cls, hi: np.ndarray, lo: np.ndarray, counts: np.ndarray) -> UidMultiset:
        """From already unique, sorted uids and their counts (e.g. memory-mapped arrays shared by workers)."""
        ms = cls.__new__(cls)
        ms.hi, ms.lo, ms.counts = hi, lo, counts
        return ms

    def __len__(self) -> int:
        return len(self.hi)

    def find(self, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """Index into the unique uids of each `(hi, lo)`, or -1 when absent."""
        out = np.full(len(hi), -1, dtype=np.int64)
        if len(self.hi) == 0 or len(hi) == 0:
            return out
        # Binary search on the high word (plain-integer search is fast); distinct uids sharing a high
        # word are a once-in-2^64 event per pair, handled one by one.
        left = np.searchsorted(self.hi, hi, "left")
        right = np.searchsorted(self.hi, hi, "right")
        width = right - left
        one = np.flatnonzero(width == 1)
        match = self.lo[left[one]] == lo[one]
        out[one[match]] = left[one[match]]
        for i in np.flatnonzero(width > 1):
            j = left[i] + np.searchsorted(self.lo[left[i] : right[i]], lo[i])
            if j < right[i] and self.lo[j] == lo[i]:
                out[i] = j
        return out

    def count(self, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """How many times each `(hi, lo)` occurs in the subset (0 when absent)."""
        idx = self.find(hi, lo)
        return np.where(idx >= 0, self.counts[np.maximum(idx, 0)] if len(self.counts) else 0, 0)


# Hashing ---------------------------------------------------------------------------------------

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer, vectorised (uint64 arithmetic wraps modulo 2^64, as intended): the uid hash
    of the `random` rule and of the report's samples."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


# Counting repeats in bounded memory ------------------------------------------------------------


class UidRepeats:
    """Counts repeated uids over a stream of `(hi, lo)` chunks (e.g. one per metadata file) in bounded memory.

    Up to `memory_rows` uids are held in memory (16 bytes each: 256 MiB at the default 2^24, about twice
    that while sorting). Past that bound every held uid goes to one of `buckets` files in a temporary folder
    (`tmp_dir`, else the system's; chosen by a hash of the uid, 16 bytes per uid on disk) and each file is
    counted on its own at the end, so memory stays within the same bound up to `buckets * memory_rows` uids
    (17 billion at the defaults, more than DataComp's largest pool).
    """

    def __init__(self, memory_rows: int = 2**24, buckets: int = 1024, tmp_dir: str | None = None):
        if buckets < 1 or buckets & (buckets - 1):
            raise ValueError(f"buckets must be a power of two, got {buckets}")
        self.memory_rows, self.buckets, self.tmp_dir = memory_rows, buckets, tmp_dir
        self._his: list[np.ndarray] = []
        self._los: list[np.ndarray] = []
        self._held = 0
        self._spill_dir: tempfile.TemporaryDirectory | None = None

    @property
    def spilled(self) -> bool:
        return self._spill_dir is not None

    def add(self, hi: np.ndarray, lo: np.ndarray) -> None:
        self._his.append(np.asarray(hi, dtype=np.uint64))
        self._los.append(np.asarray(lo, dtype=np.uint64))
        self._held += len(self._his[-1])
        if self._held > self.memory_rows:
            self._spill()

    def _bucket_file(self, b: int) -> Path:
        return Path(self._spill_dir.name) / f"{b:05d}.u8u8"  # type: ignore[union-attr]

    def _spill(self) -> None:
        if self._spill_dir is None:
            self._spill_dir = tempfile.TemporaryDirectory(prefix="hype-uids-", dir=self.tmp_dir)
        shift = np.uint64(64 - (self.buckets.bit_length() - 1))
        pieces: dict[int, list[np.ndarray]] = {}
        while self._his:  # chunk by chunk: no concatenation of everything held
            hi, lo = self._his.pop(), self._los.pop()
            # A hash, not the uid's own top bits: made-up sequential uids would all share one bucket.
            bucket = np.zeros(len(hi), np.int64)
            if shift < 64:  # (one bucket: a shift by 64 is undefined)
                bucket = (splitmix64(hi ^ splitmix64(lo)) >> shift).astype(np.int64)
            order = np.argsort(bucket, kind="stable")
            records = to_structured(hi[order], lo[order])
            bounds = np.searchsorted(bucket[order], np.arange(self.buckets + 1))
            for b in np.flatnonzero(np.diff(bounds)):
                pieces.setdefault(int(b), []).append(records[bounds[b] : bounds[b + 1]])
        for b, records in pieces.items():
            with open(self._bucket_file(b), "ab") as f:
                for r in records:
                    r.tofile(f)
        self._held = 0

    def count(self, examples: int = 5) -> tuple[int, list[str]]:
        """(rows whose uid appeared in an earlier row, up to `examples` of the repeated uids); ends the
        counter (the spill folder is removed)."""
        if self._spill_dir is None:
            hi = np.concatenate(self._his) if self._his else np.empty(0, np.uint64)
            lo = np.concatenate(self._los) if self._los else np.empty(0, np.uint64)
            self._his, self._los = [], []
            return _repeats(hi, lo, examples)
        self._spill()
        total, shown = 0, []
        try:
            for b in range(self.buckets):
                path = self._bucket_file(b)
                if path.exists():
                    records = np.fromfile(path, dtype=UID_DTYPE)
                    n, ex = _repeats(*from_structured(records), examples - len(shown))
                    total, shown = total + n, shown + ex
        finally:
            self._spill_dir.cleanup()
            self._spill_dir = None
        return total, shown


def _repeats(hi: np.ndarray, lo: np.ndarray, examples: int) -> tuple[int, list[str]]:
    order = sort_order(hi, lo)
    hi, lo = hi[order], lo[order]
    del order
    same = (hi[1:] == hi[:-1]) & (lo[1:] == lo[:-1])
    first = np.flatnonzero(same & ~np.concatenate(([False], same[:-1])))[: max(examples, 0)]
    return int(same.sum()), [pair_to_uid(hi[i], lo[i]) for i in first]
