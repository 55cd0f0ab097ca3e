"""hype.data: shard discovery, robust tar reading, subset lookup and the training stream."""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from test_select_helpers import save_memmap_subset

from hype.data.pipeline import DataError, TrainStream
from hype.data.samples import (
    CORRUPT_IMAGE,
    NO_CAPTION,
    NO_IMAGE,
    UNREADABLE_SHARD,
    SkipStats,
    decode_pair,
    iter_tar_samples,
)
from hype.data.shards import ShardError, expand_shards
from hype.data.subset_index import SubsetError, SubsetIndex, check_subset_matches, resolve_subset
from hype.data.uids import save_subset, uids_to_array
from hype.io.tar import split_member_name
from hype.train.captions import TemplateCaption


def _jpeg(color=(200, 30, 30), size=(20, 16)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="JPEG")
    return buf.getvalue()


def _uid(i: int) -> str:
    return f"{i:032x}"


def write_shard(path: Path, samples: list[dict], parquet: bool = True) -> Path:
    """samples: dicts with optional 'jpg'/'png' bytes, 'txt' str, 'json' dict; key = index."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for i, s in enumerate(samples):
            for ext, value in s.items():
                text = json.dumps(value) if ext == "json" else value
                data = value if isinstance(value, bytes) else text.encode()
                info = tarfile.TarInfo(f"{i:09d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    if parquet:
        uids = [s.get("json", {}).get("uid") for s in samples]
        table = pa.table({"uid": uids, "status": ["success"] * len(uids)})
        pq.write_table(table, path.with_suffix(".parquet"))
    return path


def good(i: int, caption: str | None = None, **meta) -> dict:
    meta = {"uid": _uid(i), **meta}
    return {"jpg": _jpeg((i * 37 % 255, 80, 120)), "txt": caption or f"caption {i}", "json": meta}


def tokenize(captions: list[str]) -> torch.Tensor:
    # A test tokenizer that keeps the caption's number, so tests can tell samples apart.
    return torch.tensor([[int(c.split()[-1])] for c in captions])


def transform(img: Image.Image) -> torch.Tensor:
    return torch.zeros(3, 4, 4)


def stream(shards, **kw) -> TrainStream:
    kw.setdefault("batch_size", 4)
    kw.setdefault("shuffle_buffer", 1)
    return TrainStream([str(s) for s in shards], image_transform=transform, tokenize=tokenize, **kw)


def take(ts: TrainStream, n: int) -> list[dict]:
    it = iter(ts)
    return [next(it) for _ in range(n)]


# --- shard discovery -------------------------------------------------------------------------------


def test_expand_folder_brace_glob_and_sources(tmp_path):
    for i in range(3):
        write_shard(tmp_path / "a" / f"{i:08d}.tar", [good(i)])
    write_shard(tmp_path / "b" / "00000000.tar", [good(9)])
    a = sorted(str(p) for p in (tmp_path / "a").glob("*.tar"))
    assert expand_shards(tmp_path / "a").paths == a
    assert expand_shards(f"{tmp_path}/a/{{00000000..00000002}}.tar").paths == a
    assert expand_shards(f"{tmp_path}/a/*.tar").paths == a
    both = expand_shards(f"{tmp_path}/a::{tmp_path}/b/00000000.tar")
    assert both.paths == a + [str(tmp_path / "b" / "00000000.tar")]


def test_expand_errors_name_the_pattern(tmp_path):
    write_shard(tmp_path / "a" / "00000000.tar", [good(0)])
    with pytest.raises(ShardError, match=r"3 of the 4 shards it names do not exist: .*00000001.tar"):
        expand_shards(f"{tmp_path}/a/{{00000000..00000003}}.tar")
    with pytest.raises(ShardError, match="matches no .tar"):
        expand_shards(f"{tmp_path}/a/*.tgz")
    with pytest.raises(ShardError, match="no such file"):
        expand_shards(tmp_path / "nope")
    with pytest.raises(ShardError, match="no training data"):
        expand_shards("")
    (tmp_path / "world" / "clean" / "shards").mkdir(parents=True)
    write_shard(tmp_path / "world" / "clean" / "shards" / "00000000.tar", [good(0)])
    with pytest.raises(ShardError, match=r"holds no .tar shards.*clean"):
        expand_shards(tmp_path / "world")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ShardError, match="not a .tar"):
        expand_shards(tmp_path / "x.txt")


def test_empty_shards_are_set_aside_and_all_empty_is_an_error(tmp_path):
    write_shard(tmp_path / "00000000.tar", [good(0)])
    (tmp_path / "00000001.tar").write_bytes(b"")
    found = expand_shards(tmp_path)
    assert found.paths == [str(tmp_path / "00000000.tar")] and found.empty == [str(tmp_path / "00000001.tar")]
    (tmp_path / "00000000.tar").write_bytes(b"")
    with pytest.raises(ShardError, match="all 2 shard"):
        expand_shards(tmp_path)


# --- reading samples -------------------------------------------------------------------------------


def test_member_names_split_like_webdataset():
    assert split_member_name("000001.jpg") == ("000001", "jpg")
    assert split_member_name("dir/000001.seg.JSON") == ("dir/000001", "seg.json")
    assert split_member_name(".hidden.txt") is None and split_member_name("README") is None


def test_bad_samples_are_skipped_and_counted(tmp_path):
    samples = [
        good(0),
        {"txt": "no image", "json": {"uid": _uid(1)}},
        {"jpg": _jpeg(), "json": {"uid": _uid(2)}},
        {"jpg": b"\xff\xd8 not a jpeg", "txt": "corrupt 3", "json": {"uid": _uid(3)}},
        {"jpg": _jpeg()[:60], "txt": "truncated 4", "json": {"uid": _uid(4)}},
        {"png": _png(), "txt": "png 5", "json": {"uid": _uid(5)}},
    ]
    shard = write_shard(tmp_path / "00000000.tar", samples)
    stats = SkipStats()
    pairs = [decode_pair(s, stats) for s in iter_tar_samples(str(shard), stats)]
    kept = [p[1] for p in pairs if p is not None]
    assert kept == ["caption 0", "png 5"]
    assert stats.counts == {NO_IMAGE: 1, NO_CAPTION: 1, CORRUPT_IMAGE: 2}
    assert all(str(shard) in m for msgs in stats.examples.values() for m in msgs)


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (0, 0, 255)).save(buf, format="PNG")
    return buf.getvalue()


def test_truncated_tar_keeps_samples_before_the_damage(tmp_path):
    shard = write_shard(tmp_path / "00000000.tar", [good(i) for i in range(6)])
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    stats = SkipStats()
    keys = [s.key for s in iter_tar_samples(str(shard), stats)]
    assert 1 <= len(keys) < 6
    assert stats.counts.get(UNREADABLE_SHARD) == 1


# --- subset lookup ---------------------------------------------------------------------------------


def test_subset_counts_match_a_python_reference():
    rng = np.random.default_rng(0)
    halves = rng.integers(0, 2**63, size=(200, 2))
    uids = [f"{int(hi) * 2 + 1:016x}{int(lo):016x}" for hi, lo in halves]
    uids += uids[:20] + uids[:5]  # repeats: 3x, 2x
    uids.append("f" * 32)
    index = SubsetIndex(uids_to_array(uids))
    ref = Counter(uids)
    queries = list(ref) + [f"{i:032x}" for i in range(30)] + ["F" * 32, "short"]
    assert [index.count(q) for q in queries] == [ref.get(q, 0) for q in queries]
    assert list(index.count_many(list(ref))) == [ref[q] for q in ref]
    assert index.num_unique == len(ref)


def test_subset_check_uses_parquets(tmp_path):
    write_shard(tmp_path / "00000000.tar", [good(i) for i in range(5)])
    index = SubsetIndex(uids_to_array([_uid(1), _uid(1), _uid(4)]), "s.npy")
    info = check_subset_matches([str(tmp_path / "00000000.tar")], index, "data", 100)
    assert info["matched_samples"] == 3 and info["checked_samples"] == 5 and info["complete"]
    other = SubsetIndex(uids_to_array([_uid(99)]), "other.npy")
    with pytest.raises(SubsetError, match=r"other.npy.*matches none of the 5 samples of data"):
        check_subset_matches([str(tmp_path / "00000000.tar")], other, "data", 100)


# --- the training stream ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["npy", "memmap"])
def test_subset_restricts_and_repeats_samples(tmp_path, layout):
    shard = write_shard(tmp_path / "00000000.tar", [good(i) for i in range(6)])
    save = save_subset if layout == "npy" else save_memmap_subset  # DataComp's two subset layouts
    path = save(tmp_path / "subset.npy", [_uid(1), _uid(4), _uid(4)])
    ts = stream([shard], subset=resolve_subset(path), resampled=False, batch_size=3)  # as `train --subset`
    seen = Counter(int(t) for b in take(ts, 10) for t in b["tokens"][:, 0])
    assert set(seen) == {1, 4}
    assert seen[4] == 2 * seen[1] == 20  # in order (no shuffle buffer): every pass yields 1, 4, 4


def test_stream_counts_skips_and_batches_only_good_samples(tmp_path):
    samples = [good(0), {"txt": "x 1", "json": {"uid": _uid(1)}}, good(2), {"jpg": b"bad", "txt": "y 3"}]
    shard = write_shard(tmp_path / "00000000.tar", samples)
    batches = take(stream([shard], batch_size=2, resampled=False), 3)
    assert all(sorted(b["tokens"][:, 0].tolist()) == [0, 2] for b in batches)
    total = SkipStats()
    for b in batches:
        total.merge(b["skips"])
    # Three passes, each: 0 ok, 1 no image, 2 ok (batch out), 3 corrupt: the last corrupt one comes after.
    assert total.counts == {NO_IMAGE: 3, CORRUPT_IMAGE: 2}
    assert batches[0]["images"].shape == (2, 3, 4, 4)


def test_subset_matching_nothing_stops_the_stream(tmp_path):
    shard = write_shard(tmp_path / "00000000.tar", [good(i) for i in range(4)], parquet=False)
    index = SubsetIndex(uids_to_array([_uid(77)]), "mine.npy")
    with pytest.raises(DataError, match=r"subset mine.npy matched none.*check that --subset"):
        take(stream([shard], subset=index, data_spec="pool/shards"), 1)


def test_all_corrupt_data_stops_the_stream(tmp_path):
    shard = write_shard(tmp_path / "00000000.tar", [{"jpg": b"junk", "txt": f"t {i}"} for i in range(3)])
    with pytest.raises(DataError, match=r"no usable sample.*corrupt_image"):
        take(stream([shard]), 1)


def test_ranks_get_disjoint_shards_or_different_resampled_streams(tmp_path):
    shards = [write_shard(tmp_path / f"{k:08d}.tar", [good(10 * k + i) for i in range(4)]) for k in range(4)]

    def keys(rank, **kw):
        batches = take(stream(shards, rank=rank, world_size=2, **kw), 6)
        return {int(t) for b in batches for t in b["tokens"][:, 0]}

    r0, r1 = keys(0, resampled=False), keys(1, resampled=False)
    assert r0 and r1 and not (r0 & r1)

    def order(rank, **kw):
        batches = take(stream(shards, rank=rank, world_size=2, shuffle_buffer=8, **kw), 4)
        return [b["tokens"][:, 0].tolist() for b in batches]

    first = order(0)
    assert first == order(0) and first != order(1)
    assert order(0, generation=5) != first


def test_caption_template_uses_json_fields_and_counts_missing_ones(tmp_path):
    samples = [good(0, "a cat 0", subreddit="cats"), good(1, "a dog 1")]
    shard = write_shard(tmp_path / "00000000.tar", samples)
    seen = []
    ts = TrainStream(
        [str(shard)],
        batch_size=2,
        image_transform=transform,
        tokenize=lambda caps: seen.extend(caps) or torch.zeros(len(caps), 1),
        caption_transform=TemplateCaption("{subreddit} : {caption}"),
        needs_meta=True,
        shuffle_buffer=1,
        resampled=False,
    )
    batch = take(ts, 1)[0]
    assert seen == ["cats : a cat 0", "cats : a cat 0"]
    assert batch["skips"]["counts"] == {"caption_transform_failed": 1}
    assert "subreddit" in batch["skips"]["examples"]["caption_transform_failed"][0]


def test_subset_matches_a_uid_in_any_accepted_spelling_and_counts_the_rest(tmp_path):
    samples = [
        good(0xAB, uid=_uid(0xAB).upper()),
        good(2, uid=f" {_uid(2)}\n"),
        good(3, uid="0x" + _uid(3)[2:]),
    ]
    shard = write_shard(tmp_path / "00000000.tar", [*samples, good(4)], parquet=False)
    index = SubsetIndex(uids_to_array([_uid(0xAB), _uid(2), _uid(3), _uid(4)]), "s.npy")
    batches = take(stream([shard], subset=index, batch_size=3, resampled=False), 4)
    assert {int(t) for b in batches for t in b["tokens"][:, 0]} == {0xAB, 2, 4}
    total = SkipStats()
    for b in batches:
        total.merge(b["skips"])
    assert set(total.counts) == {"bad_uid"} and "0x" in total.examples["bad_uid"][0]


def test_one_small_shard_trains_with_the_default_shuffle_buffer(tmp_path):
    """18 samples, fewer than the 100 the shuffle buffer takes in before it gives any out: no sample is
    decoded in the first 5 shard reads, which is no reason to declare the data unusable."""
    shard = write_shard(tmp_path / "00000000.tar", [good(i) for i in range(18)])
    ts = TrainStream([str(shard)], batch_size=4, image_transform=transform, tokenize=tokenize)
    assert [b["images"].shape[0] for b in take(ts, 3)] == [4, 4, 4]
    # Data with no usable sample still stops: once the 5 reads' 90 samples were all decoded.
    junk = write_shard(
        tmp_path / "junk" / "00000000.tar", [{"jpg": b"junk", "txt": f"t {i}"} for i in range(18)]
    )
    ts = TrainStream([str(junk)], batch_size=4, image_transform=transform, tokenize=tokenize)
    with pytest.raises(
        DataError, match=r"no usable sample in 90 samples of \d+ shard reads.*corrupt_image: 90"
    ):
        take(ts, 1)
