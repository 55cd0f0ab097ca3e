"""`hype select` on a scores table in a bucket (a real S3 server on 127.0.0.1): each column leaves the bucket
once per selection (the later passes read a local spool), the parts' footers come from one cached object,
and the result equals the local table's, byte for byte."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_select_helpers import write_scores

import hype.table.reader as table_mod
from hype.io import read_bytes, storage
from hype.select.run import SelectRequest, select_subset
from hype.table.reader import ScoresTable
from hype.table.schema import METRICS


def _df(n: int = 3000, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "uid": [f"{int(x):032x}" for x in rng.choice(2**62, n, replace=False)],
            **{m: rng.normal(0, 1, n).astype(np.float32) for m in METRICS},
            "shard": ["s.tar"] * n,
            "key": [str(i) for i in range(n)],
            "text": ["a red circle on a white background"] * n,
            "width": np.full(n, 256, np.int32),
            "height": np.full(n, 256, np.int32),
        }
    )


def _upload(local: Path, url: str) -> None:
    for p in sorted(local.rglob("*")):
        if p.is_file():
            storage.upload(p, storage.location(f"{url}/{p.relative_to(local).as_posix()}"))


@pytest.fixture
def tables(s3, tmp_path):
    """The same scores table on local disk and in the bucket."""
    local = write_scores(_df(), tmp_path / "run", parts=3, row_group_size=400)
    url = f"s3://{s3.bucket()}/run"
    _upload(local, url)
    return local, url


@pytest.fixture
def fetched(monkeypatch):
    """Every (part, row group, columns) read from the table's files, as the readers ask for them."""
    calls: list[tuple[str, int, tuple[str, ...]]] = []
    read = table_mod._read_unit

    def spy(unit, columns, *rest):
        if columns:
            calls.append((unit.path, unit.row_group, tuple(columns)))
        return read(unit, columns, *rest)

    monkeypatch.setattr(table_mod, "_read_unit", spy)
    return calls


def _per_column(calls) -> dict[str, int]:
    """column -> how many times each of its column chunks was read (the same for every chunk here)."""
    counts: dict[str, dict] = {}
    for path, group, columns in calls:
        for c in columns:
            counts.setdefault(c, {}).setdefault((path, group), 0)
            counts[c][(path, group)] += 1
    return {c: max(v.values()) for c, v in counts.items()}


@pytest.mark.parametrize("normalize", [None, "zscore"])
def test_each_column_leaves_the_bucket_once(tables, fetched, tmp_path, monkeypatch, normalize):
    local, url = tables
    temp = tmp_path / "temp"  # TMPDIR, where the spool goes
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))

    def select(scores, out):
        return select_subset(
            SelectRequest(scores=scores, out=out, frac=0.2, normalize=normalize, progress=False)
        )

    select(str(local), str(tmp_path / "local.npy"))
    local_reads = _per_column(fetched)
    fetched.clear()
    opened: list[str] = []  # parts opened by Arrow's S3 client (each open is a HEAD request)
    arrow_fs = storage.arrow_filesystem

    class Counting:
        def __init__(self, fs):
            self.fs = fs

        def open_input_file(self, key):
            opened.append(key)
            return self.fs.open_input_file(key)

    def counting(path):
        native = arrow_fs(path)
        return None if native is None else (Counting(native[0]), native[1])

    monkeypatch.setattr(storage, "arrow_filesystem", counting)
    summary = select(url, f"{url}/subset.npy")
    bucket_reads = _per_column(fetched)
    parts = {p for p, _, _ in fetched}
    assert len(opened) == len(set(opened)) == len(parts)  # each part opened once: footer and every pass

    # Locally every pass reads its columns from the file; from the bucket a metric column is downloaded
    # by the first pass only (3 or 4 passes), the uids by the select pass; the last pass (explain: the
    # decisive term of every dropped row) reads what the spool kept. Without --audit no caption or size
    # column leaves the bucket.
    passes = summary["passes"]
    assert len(passes) == (4 if normalize else 3) and passes[-1] == "explain"
    assert local_reads["eps_i"] == len(passes)
    assert bucket_reads == {"uid": 1, **{m: 1 for m in METRICS}}
    for suffix in (".npy", ".parquet"):
        assert read_bytes(f"{url}/subset{suffix}") == (tmp_path / f"local{suffix}").read_bytes()
    assert os.listdir(temp) == []  # the spool is gone once the selection is done


@pytest.mark.parametrize("reader", ["arrow", "fsspec"])
def test_an_interrupted_pass_leaves_no_spool(tables, fetched, monkeypatch, reader):
    _, url = tables
    if reader == "fsspec":  # options Arrow's S3 client cannot take keep the reads on fsspec
        monkeypatch.setattr(storage, "arrow_filesystem", lambda path: None)
    table = ScoresTable(url)
    passes = table.iter_batches(["eps_i"], spool=True, progress=None)
    next(passes)
    passes.close()  # stopped after its first unit: what it saw must not stand in for the rest
    rows = sum(len(b) for b in table.iter_batches(["eps_i"], progress=None))
    assert rows == table.num_rows
    assert _per_column(fetched)["eps_i"] == 2  # the second pass read every unit from the bucket again
    table.release_spool()

    # A complete spooling pass serves the next one, which then sends no request for that column...
    fetched.clear()
    first = [b.numeric("eps_i").copy() for b in table.iter_batches(["eps_i"], spool=True, progress=None)]
    again = [b.numeric("eps_i") for b in table.iter_batches(["eps_i", "uid"], progress=None)]
    assert fetched and all(cols == ("eps_i",) for _, _, cols in fetched[: len(first)])
    assert all(cols == ("uid",) for _, _, cols in fetched[len(first) :])
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    # ...until it is released.
    table.release_spool()
    fetched.clear()
    list(table.iter_batches(["eps_i"], progress=None))
    assert _per_column(fetched) == {"eps_i": 1}


def test_footers_come_from_one_cached_object(tables, monkeypatch):
    local, url = tables
    read_parts = []
    footers = table_mod._footers
    monkeypatch.setattr(
        table_mod, "_footers", lambda files, *rest: read_parts.append(files) or footers(files, *rest)
    )

    first = ScoresTable(url)  # reads the parts' footers and caches them
    cache = first.cache_path("footers", ".parquet")
    assert str(cache).startswith(f"{url}/select_cache/footers-") and storage.exists(cache)
    assert len(read_parts) == 1
    second = ScoresTable(url)
    assert len(read_parts) == 1  # from the cache: no request to the parts
    assert second.units == first.units and second.schemas == first.schemas
    assert all(second.footers[p].equals(first.footers[p]) for p in first.footers)

    # A damaged cache is ignored (and rewritten); a rewritten part changes the key, so the cache of the
    # old table is never read for the new one.
    storage.upload(local / "scores" / "part-00000.parquet", cache)
    third = ScoresTable(url)
    assert len(read_parts) == 2 and third.units == first.units
    write_scores(_df(seed=1), local, parts=3, row_group_size=500)
    _upload(local, url)
    fourth = ScoresTable(url)
    assert len(read_parts) == 3 and fourth.cache_path("footers", ".parquet") != cache
    assert [u.num_rows for u in fourth.units] != [u.num_rows for u in first.units]


def test_no_cache_without_versions(tables):
    """A store that gives a part no version (no ETag) could rewrite it unseen: then nothing is cached."""
    _, url = tables
    table = ScoresTable(url)
    assert table.cache_path("footers", ".parquet") is not None
    next(iter(table.listing.values()))["version"] = None
    assert table.cache_path("footers", ".parquet") is None
    assert table.cache_path("pool-stats", ".json") is None
