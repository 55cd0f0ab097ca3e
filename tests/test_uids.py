"""uid codec and DataComp subset files (DESIGN §3)."""

from __future__ import annotations

import numpy as np
import pytest

from hype.data.uids import (
    UidError,
    array_to_uids,
    from_structured,
    is_sorted,
    load_subset,
    pair_to_uid,
    parse_uid,
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


def test_parse_uid_reads_json_uids_as_datacomp_does():
    # DataComp's resharder reads `int(uid, 16)`: case and length are not checked, only the 128-bit range.
    for u in UIDS:
        assert parse_uid(u) == uid_to_pair(u) == parse_uid(u.upper())
    assert parse_uid("f") == (0, 15)
    assert parse_uid("1" + "0" * 32) is None  # 2**128: does not fit
    for bad in ("", "xyz", None, 42, "-1"):
        assert parse_uid(bad) is None


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


def test_bad_subset_files_give_clear_errors(tmp_path):
    with pytest.raises(UidError, match="not found"):
        load_subset(tmp_path / "missing.npy")
    np.save(tmp_path / "ints.npy", np.arange(3))
    with pytest.raises(UidError, match="'u8,u8'"):
        load_subset(tmp_path / "ints.npy")
    unsorted = np.array([(2, 0), (1, 0)], dtype="u8,u8")
    np.save(tmp_path / "unsorted.npy", unsorted)
    with pytest.raises(UidError, match="not sorted"):
        load_subset(tmp_path / "unsorted.npy")
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(UidError, match="not a plain .npy"):
        load_subset(tmp_path / "obj.npy")
    with pytest.raises(UidError, match="must end in .npy"):
        save_subset(tmp_path / "subset.bin", UIDS)
