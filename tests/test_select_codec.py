"""The vectorised uid codec, the uid sort and the float keys agree with their plain definitions."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

from hype.data.uids import (
    UidError,
    UidMultiset,
    array_to_uids,
    arrow_to_pairs,
    pairs_to_arrow,
    sort_order,
    sorted_uids,
    to_structured,
    uids_to_array,
    write_subset,
)
from hype.table.keys import KeyHistogram, bins64, key32, key64, unkey32, unkey64


def random_pairs(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2**64, n, dtype=np.uint64), rng.integers(0, 2**64, n, dtype=np.uint64)


def test_codec_agrees_with_hype_data_uids():
    hi, lo = random_pairs(5000)
    hi[:3], lo[:3] = [0, 2**64 - 1, 5], [0, 2**64 - 1, 0]
    strings = pairs_to_arrow(hi, lo).to_pylist()
    ref = uids_to_array(strings, sort=False)
    np.testing.assert_array_equal(ref["f0"], hi)
    np.testing.assert_array_equal(ref["f1"], lo)
    assert array_to_uids(to_structured(hi, lo)) == strings
    back_hi, back_lo = arrow_to_pairs(pa.array(strings).slice(7, 100))  # a slice has an offset
    np.testing.assert_array_equal(back_hi, hi[7:107])
    np.testing.assert_array_equal(back_lo, lo[7:107])
    large = pa.array(strings, type=pa.large_string())
    np.testing.assert_array_equal(arrow_to_pairs(large)[0], hi)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["0" * 31], "malformed uid '0000000000000000000000000000000' at row 0"),
        (["0" * 32, "A" * 32], "malformed uid 'AAAA.*' at row 1"),
        (["0" * 32, None], "null uid"),
        (["g" * 32], "malformed uid"),
    ],
)
def test_codec_names_bad_uids(values, message):
    with pytest.raises(UidError, match=message):
        arrow_to_pairs(pa.array(values, type=pa.string()), "t.parquet")


def test_select_writes_its_subset_through_the_codec(tmp_path):
    """`hype select`'s subset.npy is the codec's `write_subset`: np.save's bytes, read back before the file
    gets its name; an unsorted array is refused, never written."""
    import hype.select.outputs
    import hype.select.run

    hi, lo = random_pairs(3000)
    arr = to_structured(hi, lo)[sort_order(hi, lo)]
    back = write_subset(tmp_path / "subset.npy", arr)
    np.save(tmp_path / "plain.npy", arr, allow_pickle=False)
    assert (tmp_path / "subset.npy").read_bytes() == (tmp_path / "plain.npy").read_bytes()
    np.testing.assert_array_equal(back, arr)
    with pytest.raises(UidError, match="sorted"):
        write_subset(tmp_path / "other.npy", arr[::-1])
    assert not (tmp_path / "other.npy").exists()
    assert hype.select.run.write_subset is write_subset and not hasattr(hype.select.outputs, "write_subset")


@pytest.mark.parametrize("shared", [0, 1, 1000])
def test_sort_order_equals_numpy_structured_sort(shared):
    hi, lo = random_pairs(20000, seed=shared)
    hi[:shared] = 12345  # many uids sharing their high word (made-up sequential uids look like this)
    hi[shared : 2 * shared] = hi[2 * shared : 3 * shared] if shared else hi[:0]
    lo[shared : 2 * shared] = lo[2 * shared : 3 * shared] if shared else lo[:0]  # repeated uids too
    ref = np.sort(to_structured(hi, lo), order=["f0", "f1"])
    order = sort_order(hi, lo)
    np.testing.assert_array_equal(to_structured(hi[order], lo[order]), ref)
    np.testing.assert_array_equal(order, np.lexsort((lo, hi)))  # stable: a repeated uid keeps its row order
    chunks = [hi[:7000], hi[7000:]], [lo[:7000], lo[7000:]]
    np.testing.assert_array_equal(sorted_uids(*chunks), ref)


def test_multiset_counts_repeats_and_absences():
    hi, lo = random_pairs(3000, seed=3)
    hi[10:20] = hi[0]  # distinct uids sharing a high word
    picked = np.concatenate([np.arange(0, 3000, 2), np.arange(0, 3000, 10), [11, 11, 11]])
    subset = np.sort(to_structured(hi[picked], lo[picked]), order=["f0", "f1"])
    ms = UidMultiset(subset)
    expected = Counter(picked.tolist())
    counts = ms.count(hi, lo)
    assert counts.tolist() == [expected.get(i, 0) for i in range(3000)]
    assert len(ms) == len(expected)


def test_float_keys_preserve_order():
    rng = np.random.default_rng(4)
    x = np.concatenate(
        [rng.normal(0, 1, 10000), rng.normal(0, 1e-30, 100), [0.0, -0.0, np.inf, -np.inf, 1e308]]
    )
    x.sort()
    k = key64(x)
    assert np.all(k[1:] >= k[:-1]) and key64(np.array([-0.0]))[0] == key64(np.array([0.0]))[0]
    np.testing.assert_array_equal(unkey64(k), x + 0.0)
    np.testing.assert_array_equal(bins64(x, 20), (k >> np.uint64(44)).astype(np.int64))
    with np.errstate(over="ignore"):  # 1e308 becomes inf in float32: still in order
        x32 = x.astype(np.float32)
    k32 = key32(x32)
    assert np.all(k32[1:] >= k32[:-1])
    np.testing.assert_array_equal(unkey32(k32), x32 + np.float32(0))


def test_histogram_quantiles_are_close():
    rng = np.random.default_rng(5)
    x = rng.gamma(2.0, 1.5, 200_000)
    h = KeyHistogram(20)
    h.add(x[:100_000])
    h.add(x[100_000:])
    for q, got in zip((0.01, 0.5, 0.99), h.quantiles((0.01, 0.5, 0.99)), strict=True):
        assert got == pytest.approx(np.quantile(x, q), rel=2**-10)
