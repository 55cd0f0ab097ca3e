"""uid codec and DataComp subset files (DESIGN §3)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from test_select_helpers import save_memmap_subset

from hype.data.errors import SelectError
from hype.data.uids import (
    UidError,
    array_to_uids,
    from_structured,
    is_sorted,
    load_subset,
    load_uid_file,
    normalize_uid,
    pair_to_uid,
    save_subset,
    to_structured,
    uid_to_pair,
    uids_to_array,
    uids_to_pairs,
)

UIDS = [
    "0000000000000000000000000000000f",
    "ffffffffffffffffffffffffffffffff",
    "00000000000000010000000000000000",
    "8f14e45fceea167a5a36dedd4bea2543",
]


def test_pair_matches_datacomp_divmod():
    for u in UIDS:
        assert uid_to_pair(u) == divmod(int(u, 16), 2**64)
        assert pair_to_uid(*uid_to_pair(u)) == u


def test_every_form_of_the_codec_agrees():
    hi, lo = uids_to_pairs(UIDS)
    assert hi.dtype == lo.dtype == np.uint64
    assert [(int(h), int(x)) for h, x in zip(hi, lo, strict=True)] == [uid_to_pair(u) for u in UIDS]
    arr = to_structured(hi, lo)
    back_hi, back_lo = from_structured(arr)
    assert back_hi.dtype == np.uint64 and np.array_equal(back_hi, hi) and np.array_equal(back_lo, lo)
    assert array_to_uids(arr) == UIDS
    assert [len(a) for a in uids_to_pairs([])] == [0, 0]


FULL_WIDTH = str.maketrans("0123456789", "０１２３４５６７８９")


def test_normalize_uid_canonicalises_two_spellings_and_refuses_the_rest():
    u = UIDS[3]
    # The same 128-bit uid, spelled with surrounding whitespace or in upper case: canonicalised.
    for spelling in (u, u.upper(), f"  {u}\n", f"\t{u.upper()} "):
        assert normalize_uid(spelling) == u
    # What Python's int(uid, 16) (and so DataComp's resharder) also reads, refused: names built from them
    # would not be 32 hex digits.
    digits = "12345678901234567890123456789012"
    for bad in (
        "0" * 80 + u,  # leading zeros: a 112-character member name, too long for ustar
        digits.translate(FULL_WIDTH),  # full-width digits
        "0x" + u,
        "0x" + u[2:],  # 32 characters, but not 32 hex digits
        u[:16] + "_" + u[17:],
        "+" + u[1:],
        "f",
        "",
        "g" * 32,
        None,
        42,
        int(u, 16),
    ):
        assert normalize_uid(bad) is None, bad
    # A final newline is not part of a uid for the strict checks either (`$` matched before it).
    with pytest.raises(UidError):
        uid_to_pair(u + "\n")
    with pytest.raises(UidError):
        uids_to_array([u + "\n"])


def test_array_is_sorted_u8u8_and_round_trips_with_duplicates():
    uids = UIDS + [UIDS[3]]  # a repeated uid means the sample is repeated
    arr = uids_to_array(uids)
    assert arr.dtype == np.dtype("u8,u8")
    assert is_sorted(arr)
    assert array_to_uids(arr) == sorted(uids, key=lambda u: int(u, 16))
    # The order DataComp's resharder relies on: numpy's structured sort, i.e. by (hi, lo).
    expected = np.array([divmod(int(u, 16), 2**64) for u in uids], dtype="u8,u8")
    expected.sort()
    assert np.array_equal(arr, expected)


def test_save_and_load_subset(tmp_path):
    path = save_subset(tmp_path / "sub" / "subset.npy", list(reversed(UIDS)))
    loaded = np.load(path)  # readable by plain numpy, as DataComp reads it
    assert loaded.dtype == np.dtype("u8,u8") and is_sorted(loaded)
    assert array_to_uids(load_subset(path)) == sorted(UIDS, key=lambda u: int(u, 16))


@pytest.mark.parametrize(
    "bad",
    ["8F14E45FCEEA167A5A36DEDD4BEA2543", "8f14e45f", "8f14e45fceea167a5a36dedd4bea2543a", "g" * 32, 42, None],
)
def test_malformed_uids_are_rejected_naming_the_value(bad):
    with pytest.raises(UidError, match="malformed uid"):
        uid_to_pair(bad)
    with pytest.raises(UidError, match=repr(bad).replace("(", r"\(")):
        uids_to_array([UIDS[0], bad])


def test_raw_memmap_subsets_read_like_npy(tmp_path):
    """DataComp's README allows the memory-mapped layout too; its resharder reads any file without the .npy
    magic string as raw 'u8,u8' records. Both ways of writing one give the .npy's array."""
    npy = load_subset(save_subset(tmp_path / "s.npy", UIDS + UIDS[:1]))
    raw = save_memmap_subset(tmp_path / "s.memmap", UIDS + UIDS[:1])
    assert raw.read_bytes()[:6] != b"\x93NUMPY"
    np.testing.assert_array_equal(load_subset(raw), npy)
    npy.tofile(tmp_path / "tofile.npy")  # a raw file may well be named .npy (DataComp copies it as one)
    np.testing.assert_array_equal(load_subset(tmp_path / "tofile.npy"), npy)
    (tmp_path / "empty").write_bytes(b"")
    assert len(load_subset(tmp_path / "empty")) == 0  # zero records: commands refuse it as empty
    with pytest.raises(SelectError, match="--subset: .*empty holds no uids"):
        load_uid_file(tmp_path / "empty", "--subset")


def _write_bad(path, kind: str) -> None:
    good = np.array([divmod(int(u, 16), 2**64) for u in sorted(UIDS)], dtype="u8,u8")
    if kind == "odd_size":
        path.write_bytes(b"\x01" * 1_000_003)
    elif kind == "text":
        path.write_text("".join(u + "\n" for u in UIDS[:2] * 8))  # 16 lines of 33 bytes: a multiple of 16
    elif kind == "one_uid_text":
        path.write_text(UIDS[3])  # 32 bytes: would be two records
    elif kind == "pickle":
        path.write_bytes(pickle.dumps({"uids": UIDS}, protocol=4))  # 166 bytes
    elif kind == "pickle_16":  # a size that fits the memmap layout: named because it is not sorted either
        pad = -len(pickle.dumps({"uids": UIDS, "pad": ""}, protocol=4)) % 16
        path.write_bytes(pickle.dumps({"uids": UIDS, "pad": "x" * pad}, protocol=4))
    elif kind == "npz":
        with open(path, "wb") as f:  # np.savez would append .npz to a name
            np.savez(f, uids=good)
    elif kind == "object":
        np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    elif kind == "int64":
        np.save(path, np.arange(3))
    elif kind == "2d":
        np.save(path, good.reshape(2, 2))
    elif kind == "unsorted_npy":
        np.save(path, good[::-1])
    elif kind == "unsorted_raw":
        good[::-1].tofile(path)
    elif kind == "truncated":
        np.save(path, good)
        path.write_bytes(path.read_bytes()[:-8])


@pytest.mark.parametrize(
    ("kind", "found"),
    [
        (
            "odd_size",
            "a 1000003-byte file that is not an .npy file and whose size is not a multiple of 16 bytes",
        ),
        ("text", "a text file (first line '0000000000000000000000000000000f')"),
        ("one_uid_text", "a text file (first line '8f14e45fceea167a5a36dedd4bea2543')"),
        ("pickle", "a Python pickle"),
        ("pickle_16", "a Python pickle"),
        ("npz", "a ZIP archive"),
        ("object", "a NumPy file holding a 1-D object array of shape (1,)"),
        ("int64", "a NumPy file holding a 1-D int64 array of shape (3,)"),
        ("2d", "a NumPy file holding a 2-D"),
        (
            "truncated",
            "a NumPy file holding a 1-D [('f0', '<u8'), ('f1', '<u8')] array of shape (4,) that cannot",
        ),
        ("unsorted_npy", None),
        ("unsorted_raw", None),
    ],
)
def test_bad_subset_files_say_what_was_found(tmp_path, kind, found):
    path = tmp_path / "bad.npy"
    _write_bad(path, kind)
    with pytest.raises(UidError) as e:
        load_subset(path)
    message = str(e.value)
    assert message.startswith(f"{path}: ")
    if found is None:
        assert "uids are not sorted; rewrite it with hype.data.uids.save_subset" in message
    else:
        assert f"found {found}" in message and "'u8,u8'" in message and "save_subset" in message
    assert "pickled data" not in message  # numpy's message for any non-.npy file, which misled users


def test_missing_subset_files_and_writing(tmp_path):
    with pytest.raises(UidError, match="not found"):
        load_subset(tmp_path / "missing.npy")
    with pytest.raises(UidError, match="is a folder"):
        load_subset(tmp_path)
    with pytest.raises(UidError, match="must end in .npy"):
        save_subset(tmp_path / "subset.bin", UIDS)


def test_scoring_training_and_reshard_read_uids_alike(tmp_path):
    """One uid reading (`normalize_uid`) behind the three readers of a shard sample's json["uid"]."""
    from test_train_data import _jpeg, write_shard

    from hype.data.samples import SkipStats, iter_tar_samples, sample_uid
    from hype.data.uids import UidMultiset
    from hype.reshard.index import index_tar
    from hype.scoring.decode import Decoded, DecodeSpec

    values = [
        UIDS[3],
        UIDS[3].upper(),
        f" {UIDS[0]}\n",
        "B" * 32,  # kept by reshard, matched by nothing in train --subset, kept in upper case by scoring
        "0" * 80 + UIDS[1],
        "12345678901234567890123456789012".translate(FULL_WIDTH),
        "0x" + UIDS[2],
        7,
    ]
    samples = [{"jpg": _jpeg(), "txt": "c", "json": {"uid": v}} for v in values]
    shard = str(write_shard(tmp_path / "00000000.tar", samples, parquet=False))
    expected = [UIDS[3], UIDS[3], UIDS[0], "b" * 32, None, None, None, None]
    reasons = {"bad_uid": 3, "no_uid": 1}

    train_stats = SkipStats()
    train = [sample_uid(s, train_stats) for s in iter_tar_samples(shard, SkipStats())]
    spec = DecodeSpec(preps=(), draft=False, labelled=False)
    decoded = [spec(s) for s in iter_tar_samples(shard, SkipStats())]
    scoring = [d.uid if isinstance(d, Decoded) else None for d in decoded]
    subset = UidMultiset(uids_to_array(sorted({u for u in expected if u})))
    index = index_tar(shard, subset)
    assert train == scoring == expected
    assert [m[0] for m in index.matched] == [u for u in expected if u]
    assert train_stats.counts == index.skipped["counts"] == reasons
    assert sorted(d.reason for d in decoded if not isinstance(d, Decoded)) == ["bad_uid"] * 3 + ["no_uid"]


def test_normalize_arrow_uids_agrees_with_normalize_uid():
    import pyarrow as pa

    from hype.data.uids import normalize_arrow_uids

    values = [
        UIDS[0],
        UIDS[1].upper(),
        f"\t{UIDS[2]} \n",
        None,
        "0" * 80 + UIDS[3],
        "12345678901234567890123456789012".translate(FULL_WIDTH),
        "0x" + UIDS[3][2:],
        "é" * 16,  # 32 bytes, 16 characters
        "",
        UIDS[3],
    ]
    expected = [normalize_uid(v) for v in values]
    for arr in (
        pa.array(values),
        pa.array(values, pa.large_string()),
        pa.chunked_array([values[:4], values[4:]]),
        pa.array(["pad", *values])[1:],  # an offset into the buffers
    ):
        hi, lo, valid = normalize_arrow_uids(arr)
        got = [pair_to_uid(h, x) if v else None for h, x, v in zip(hi, lo, valid, strict=True)]
        assert got == expected
    assert [len(a) for a in normalize_arrow_uids(pa.array([1, 2]))] == [2, 2, 2]  # not strings: no uid


@pytest.mark.parametrize("memory_rows,buckets", [(10**9, 1024), (50, 8), (50, 1)])
def test_uid_repeats_are_counted_exactly_in_bounded_memory(memory_rows, buckets):
    from collections import Counter

    from hype.data.uids import UidRepeats

    rng = np.random.default_rng(1)
    uids = [f"{int(x):032x}" for x in rng.integers(0, 2**62, 400)] + [f"{i:032x}" for i in range(30)]
    uids += uids[::7] + uids[:3]  # repeats, some three times
    counter = UidRepeats(memory_rows=memory_rows, buckets=buckets)
    for i in range(0, len(uids), 37):  # chunks, as one per metadata file
        counter.add(*uids_to_pairs(uids[i : i + 37]))
    assert counter.spilled == (len(uids) > memory_rows)
    n, examples = counter.count(examples=5)
    ref = Counter(uids)
    assert n == sum(c - 1 for c in ref.values()) and len(examples) == 5
    assert all(ref[u] > 1 for u in examples)
