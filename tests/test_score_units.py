"""Building blocks of `hype score`: streamed selections, the streaming reference selection against the
in-memory one, preprocessing against open_clip's, executors' retries, config, metadata lookups, AUROC."""

from __future__ import annotations

import copy
import io
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from hype.geometry import lorentz
from hype.models import ConfigError
from hype.scoring import embed_format
from hype.scoring.quality import auroc, average_ranks, noise_auroc_table
from hype.scoring.reference import load_reference, select_references
from hype.scoring.rundir import RunDir, ShardTask, atomic_write_json, make_tasks, shard_id, write_parquet
from hype.scoring.topk import RunningTopK, order_id

# --- AUROC -----------------------------------------------------------------------------------------


def test_auroc_matches_a_hand_computed_case_with_ties():
    # positives 0.9, 0.5, 0.3; negatives 0.5, 0.2, 0.1, 0.3
    scores = np.array([0.9, 0.5, 0.3, 0.5, 0.2, 0.1, 0.3])
    labels = np.array([1, 1, 1, 0, 0, 0, 0], dtype=bool)
    # Pairs (pos, neg) with pos > neg count 1, ties 1/2:
    # 0.9 beats all 4 -> 4; 0.5 ties 0.5, beats 0.2, 0.1, 0.3 -> 3.5; 0.3 beats 0.2, 0.1, ties 0.3 -> 2.5
    assert auroc(scores, labels) == pytest.approx((4 + 3.5 + 2.5) / 12)
    np.testing.assert_array_equal(average_ranks(np.array([3.0, 1.0, 3.0, 2.0])), [3.5, 1.0, 3.5, 2.0])
    assert auroc(np.arange(5.0), np.array([0, 0, 0, 1, 1], bool)) == 1.0
    assert auroc(np.zeros(4), np.array([0, 1, 0, 1], bool)) == 0.5
    with pytest.raises(ValueError, match="both classes"):
        auroc(np.zeros(3), np.zeros(3, bool))


def test_noise_table_reports_every_metric_and_kind():
    import pandas as pd

    df = pd.DataFrame(
        {
            "noise": ["clean", "clean", "misaligned", "misaligned", "underspecified_text"],
            "eps_i": [1.0, 2.0, 0.0, 3.0, 1.5],
            "eps_t": [1.0, 1.0, 1.0, 1.0, 0.0],
            "neg_d_l": [0.0, 0.0, -1.0, -2.0, 0.0],
            "cos_theta": [0.5, 0.4, 0.1, 0.2, 0.4],
            "c_in": [0.0, 10.0, 0.0, 0.0, 0.0],
        }
    )
    table = noise_auroc_table(df)
    assert set(table) == {"eps_i", "eps_t", "neg_d_l", "cos_theta", "c_in", "hype"}
    assert table["neg_d_l"]["misaligned"] == 1.0 and table["eps_t"]["underspecified_text"] == 1.0
    assert table["eps_i"]["misaligned"] == 0.5
    # Normalized sums, as `hype select --normalize` ranks: zscore by hand (population std), and rank.
    both = noise_auroc_table(df, normalizations=("zscore", "rank"))
    assert set(both) == set(table) | {"hype_zscore", "hype_rank"}
    z = sum(
        (df[m] - df[m].mean()) / df[m].std(ddof=0) for m in ["eps_i", "eps_t", "neg_d_l", "cos_theta", "c_in"]
    )
    assert both["hype_zscore"] == noise_auroc_table(df.assign(eps_i=z))["eps_i"]
    assert both["hype_rank"]["underspecified_text"] == 1.0  # lowest eps_t and mid-pack elsewhere


# --- running selections ----------------------------------------------------------------------------


def test_running_top_k_equals_a_stable_sort_of_the_whole_pool():
    rng = np.random.default_rng(0)
    blocks = [np.round(rng.normal(size=n), 1).astype(np.float32) for n in (30, 1, 0, 45, 17)]
    top = RunningTopK(20)
    for i, b in enumerate(blocks):
        top.add(b, order_id(i, np.arange(len(b))))
    whole = np.concatenate(blocks)
    expected = torch.sort(torch.from_numpy(whole), descending=True, stable=True).indices[:20].numpy()
    ids = np.concatenate([order_id(i, np.arange(len(b))) for i, b in enumerate(blocks)])
    np.testing.assert_array_equal(top.ids, ids[expected])
    low = RunningTopK(5, largest=False)
    keys = rng.integers(0, 2**63, size=40, dtype=np.int64).astype(np.uint64)
    for s in range(0, 40, 7):
        low.add(keys[s : s + 7], np.arange(s, min(s + 7, 40)), np.arange(s, min(s + 7, 40))[:, None])
    np.testing.assert_array_equal(low.ids, np.argsort(keys, kind="stable")[:5])
    np.testing.assert_array_equal(low.payload[:, 0], low.ids)


def _write_embed_shards(run: RunDir, tasks, img, txt, cos, sizes, curv):
    start = 0
    for task, n in zip(tasks, sizes, strict=True):
        sl = slice(start, start + n)
        start += n
        pairs = {
            "uid": [f"{start - n + i:032x}" for i in range(n)],
            "key": [str(i) for i in range(n)],
            "text": ["t"] * n,
            "width": [1] * n,
            "height": [1] * n,
            "neg_d_l": np.zeros(n, np.float32),
            "cos_theta": cos[sl],
        }
        arrays = {"meru_img": img[sl], "meru_txt": txt[sl], "clip_img": np.zeros((n, 4), np.float32)}
        schema = embed_format.embed_schema(img.shape[1], 4, curv, 0.1)
        out = write_parquet(run.shard_output("embed", task), embed_format.build_table(pairs, arrays, schema))
        atomic_write_json(run.shard_stats("embed", task), {"shard_id": task.shard_id, "output": out})


def test_streaming_reference_selection_selects_exactly_what_select_references_selects(tmp_path):
    from hype.pipelines.local import LocalExecutor
    from hype.scoring.dedup import find_duplicates, load_duplicates
    from hype.scoring.stage_reference import CandidateStage, select_top_m, select_top_pairs

    g = torch.Generator().manual_seed(0)
    n, dim, curv = 230, 8, 0.7
    img = lorentz.exp_map0(torch.randn(n, dim, generator=g) * 0.8, curv).numpy()
    txt = lorentz.exp_map0(torch.randn(n, dim, generator=g) * 0.5, curv).numpy()
    cos = np.round(torch.rand(n, generator=g).numpy(), 2).astype(np.float32)  # ties on purpose
    run = RunDir(tmp_path / "run")
    run.create()
    tasks = make_tasks([str(tmp_path / f"{i:08d}.tar") for i in range(4)])
    _write_embed_shards(run, tasks, img, txt, cos, [70, 0, 100, 60], curv)

    warnings: list[str] = []
    find_duplicates(run, tasks, "fp", n)
    drops = load_duplicates(run)
    top = select_top_pairs(run, tasks, drops, 50, "fp1", warnings.append)
    stage = CandidateStage(run, curv=curv, K=0.1, hinge=True, top_n_digest=top["digest"], budget_elems=4096)
    assert LocalExecutor().map(stage, tasks, lambda t, s: None).failures == []
    meta = {"n_top": 50, "K": 0.1, "hinge": True, "curv": curv}
    select_top_m(run, tasks, drops, 40, meta, "fp2", warnings.append)
    streamed = load_reference(run.reference)

    expected = select_references(
        torch.from_numpy(img), torch.from_numpy(txt), torch.from_numpy(cos), curv, n_top=50, m=40, hinge=True
    )
    assert torch.equal(streamed.img, expected.img) and torch.equal(streamed.txt, expected.txt)
    assert not warnings


def test_fast_preprocessing_is_bit_identical_to_open_clip(tmp_path):
    from hype.data.imageprep import Preprocess, decode_rgb
    from hype.models import create_model

    rng = np.random.default_rng(0)
    for name in ("tiny-hyperbolic", "tiny-clip"):
        model = create_model(name)
        prep = Preprocess.of(model)
        for size in ((1, 1), (97, 41), (64, 64), (300, 500)):
            img = Image.fromarray(rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8))
            ours = prep.batch([prep.pixels(img)], "cpu")[0]
            theirs = model.preprocess(train=False)(img)
            assert torch.equal(ours, theirs), (name, size)
    # JPEG draft: a big JPEG decodes at a reduced scale that still leaves >= 2x the model input.
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, size=(1200, 1600, 3), dtype=np.uint8)).save(buf, "JPEG")
    img, size = decode_rgb(buf.getvalue(), draft_size=64)
    assert size == (1600, 1200) and min(img.size) >= 128 and img.size[0] < 1600


class _Flaky:
    """A stage that fails on one shard always and on another once (to exercise the executor)."""

    name = "flaky"

    def __init__(self, tmp):
        self.tmp = tmp

    def setup(self):
        self.seen = {}

    def run(self, task):
        self.seen[task.shard_id] = self.seen.get(task.shard_id, 0) + 1
        if task.index == 1 or (task.index == 2 and self.seen[task.shard_id] == 1):
            raise OSError(f"disk trouble on {task.shard_id}")
        return {"shard_id": task.shard_id, "counts": {"samples": 1}}


def test_local_executor_retries_and_reports_failing_shards(tmp_path):
    from hype.pipelines.local import LocalExecutor

    tasks = make_tasks([str(tmp_path / f"{i}.tar") for i in range(4)])
    done = []
    result = LocalExecutor(retries=2).map(_Flaky(tmp_path), tasks, lambda t, s: done.append((t.index, s)))
    failures = result.failures
    assert [i for i, _ in done] == [0, 2, 3] and dict(done)[2]["attempts"] == 2
    assert len(failures) == 1 and failures[0].attempts == 3 and "disk trouble" in failures[0].error


# --- run directory, config, metadata --------------------------------------------------------------


def test_shard_ids_and_tasks_are_keyed_on_the_absolute_tar_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = shard_id("pool/00000007.tar")
    assert a.startswith("00000007-") and len(a) == len("00000007-") + 8
    assert a == shard_id(tmp_path / "pool" / "00000007.tar") != shard_id("other/00000007.tar")
    t = ShardTask(3, "pool/00000007.tar", a)
    assert t.source == str(tmp_path / "pool" / "00000007.tar")
    assert copy.deepcopy(RunDir(tmp_path)).root == tmp_path  # workers get copies (Ray: by pickling)


def test_config_overrides_and_errors():
    from hype.scoring.config import load_score_config

    cfg = load_score_config(
        "default", ["reference.n_top=5000", "specificity.hinge=true", "executor.kind=ray"]
    )
    assert cfg.reference.n_top == 5000 and cfg.specificity.hinge and cfg.executor.kind == "ray"
    assert load_score_config("tiny").reference.m == 2000
    with pytest.raises(ConfigError, match="valid keys in clusters"):
        load_score_config("default", ["clusters.k=3"])
    with pytest.raises(ConfigError, match="must be one of local, ray"):
        load_score_config("default", ["executor.kind=spark"])
    with pytest.raises(ConfigError, match="not both"):
        load_score_config("default", ["clusters.class_features=a.npy", "clusters.class_images=b"])
    with pytest.raises(ConfigError, match="--clip"):
        load_score_config("default", ["pool=p", "meru=m", "out=o"]).check_inputs()
    with pytest.raises(ConfigError, match="--centroids needs the reference-class features"):
        load_score_config(
            "default", ["pool=p", "meru=m", "clip=c", "out=o", "clusters.centroids=c.pt"]
        ).check_inputs()
    # A run directory in a bucket is a valid --out (tests/test_storage_pipeline.py runs one).
    load_score_config("default", ["pool=p", "meru=m", "clip=c", "out=s3://bucket/run"]).check_inputs()


def test_metadata_index_finds_uids_across_files(tmp_path):
    from hype.scoring.metadata import MetadataLookup, build_index, feature_source, metadata_files

    rng = np.random.default_rng(0)
    uids = [f"{int(x):032x}" for x in rng.integers(0, 2**62, size=50)]
    uids[7] = "00000000000000010000000000000002"  # same high half as the next one
    uids[8] = "00000000000000010000000000000001"
    feats = rng.normal(size=(50, 6)).astype(np.float32)
    for name, sl in (("b", slice(0, 30)), ("a", slice(30, 50))):
        pq.write_table(
            pa.table({"uid": uids[sl], "clip_l14_similarity_score": np.arange(50, dtype=np.float32)[sl]}),
            tmp_path / f"{name}.parquet",
        )
        np.savez(tmp_path / f"{name}.npz", l14_img=feats[sl])
    index = tmp_path / "run" / "index.npy"
    info = build_index(tmp_path, index, "clip_l14_similarity_score")
    assert info["rows"] == 50 and build_index(tmp_path, index, "clip_l14_similarity_score") == info
    look = MetadataLookup(tmp_path, index, "l14_img")
    query = [uids[8], "f" * 32, uids[40], uids[7], uids[0]]
    found, scores, got = look.lookup(query)
    np.testing.assert_array_equal(found, [True, False, True, True, True])
    np.testing.assert_array_equal(scores[found], [8, 40, 7, 0])
    np.testing.assert_array_equal(got, feats[[8, 40, 7, 0]])
    assert look.feature_dim() == 6
    assert feature_source(metadata_files(tmp_path), have_clip=False) == ("npz", [])


def test_metadata_uids_are_read_as_shard_uids_are(tmp_path):
    """The metadata index reads uids with `normalize_uid`, as scoring reads a shard's: an upper-case or
    padded uid is the same uid (its scores and .npz row kept), a malformed one is left out and counted
    (it used to fail the whole run, and a padded uid was refused)."""
    from hype.scoring.metadata import MetadataLookup, build_index

    a, b = "ab" * 16, "cd" * 16
    listed = [f"  {a.upper()}\n", "0x" + b[2:], b, None]
    feats = np.arange(8, dtype=np.float32).reshape(4, 2)
    pq.write_table(
        pa.table({"uid": listed, "clip_l14_similarity_score": np.float32([0.1, 0.2, 0.3, 0.4])}),
        tmp_path / "m.parquet",
    )
    np.savez(tmp_path / "m.npz", l14_img=feats)
    info = build_index(tmp_path, tmp_path / "run" / "index.npy", "clip_l14_similarity_score")
    assert info["rows"] == 2 and info["malformed_uids"] == 2
    found, scores, got = MetadataLookup(tmp_path, tmp_path / "run" / "index.npy", "l14_img").lookup([b, a])
    assert found.all()
    np.testing.assert_array_equal(scores, np.float32([0.3, 0.1]))
    np.testing.assert_array_equal(got, feats[[2, 0]])


def test_parquet_only_metadata_needs_clip_and_still_lists_the_pool(tmp_path):
    """DataComp's default download has no .npz: the uids still come from the parquet, the features from
    --clip; without --clip the error says what to download or pass."""
    from hype.scoring.metadata import (
        MetadataError,
        MetadataLookup,
        build_index,
        feature_source,
        metadata_files,
    )

    uids = [f"{i:032x}" for i in range(1, 11)]
    pq.write_table(pa.table({"uid": uids[:6], "text": ["t"] * 6}), tmp_path / "b.parquet")
    pq.write_table(pa.table({"uid": uids[6:], "text": ["t"] * 4}), tmp_path / "a.parquet")
    np.savez(tmp_path / "b.npz", l14_img=np.zeros((6, 4), np.float32))  # a.npz missing
    files = metadata_files(tmp_path)
    with pytest.raises(MetadataError, match=r"a\.npz.*1 of 2 .*--download_npz.*--clip"):
        feature_source(files, have_clip=False)
    assert feature_source(files, have_clip=True) == ("clip", [tmp_path / "a.npz"])
    index = tmp_path / "run" / "index.npy"
    info = build_index(tmp_path, index, None)  # no score column needed: the parquet has none
    assert info["rows"] == 10 and info["score_column"] is None
    found, scores, feats = MetadataLookup(tmp_path, index, None).lookup([uids[7], "f" * 32, uids[0]])
    assert found.tolist() == [True, False, True] and np.isnan(scores).all() and feats is None


def test_a_metadata_file_declaring_more_rows_than_fit_is_refused_before_reading(tmp_path):
    """A 360 KB Parquet can declare 40M rows (one uid, run-length encoded): the index build checks the
    footers against the memory left before it allocates anything (it used to read the file whole, and
    ran out of memory). Run in a child process whose address space is capped."""
    from memory_support import run_bounded

    schema = pa.schema(
        [("uid", pa.dictionary(pa.int32(), pa.string())), ("clip_l14_similarity_score", pa.float32())]
    )
    chunk = 1 << 22
    idx, score = pa.array(np.zeros(chunk, np.int32)), pa.array(np.zeros(chunk, np.float32))
    with pq.ParquetWriter(tmp_path / "m.parquet", schema, store_schema=False) as w:  # read back as strings
        for _ in range(10):
            uid = pa.DictionaryArray.from_arrays(idx, pa.array(["ab" * 16]))
            w.write_table(pa.table([uid, score], schema=schema))
    assert (tmp_path / "m.parquet").stat().st_size < 2**20
    got = run_bounded(
        "from pathlib import Path\nfrom hype.scoring.metadata import build_index",
        f"build_index({str(tmp_path)!r}, Path({str(tmp_path / 'run' / 'index.npy')!r}), "
        "'clip_l14_similarity_score')",
        headroom_mb=768,
    )
    assert got["error"].startswith(
        f"MetadataError: {tmp_path / 'm.parquet'}: the metadata's footers declare 41,943,040 rows"
    ), got
    assert "run on a machine with more memory" in got["error"] and got["growth_mb"] < 64
    assert not (tmp_path / "run" / "index.npy").exists()


def test_share_cores_with_decoders_sets_passive_openmp_unless_the_user_chose(monkeypatch):
    from hype.scoring.decode import share_cores_with_decoders

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert share_cores_with_decoders() == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert share_cores_with_decoders() == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_run_directory_parquet_settings_are_applied_and_round_trip(tmp_path):
    """Every run-directory table: zstd, a dictionary only for `shard`, float leaves (embeddings
    included) byte-stream-split; values unchanged, and the same table gives the same bytes."""
    from hype.scoring.rundir import parquet_bytes

    rng = np.random.default_rng(0)
    n = 500
    emb = rng.normal(size=(n, 8)).astype(np.float32)
    table = pa.table(
        {
            "uid": pa.array([f"{i:032x}" for i in rng.integers(0, 2**62, n)]),
            "eps_i": pa.array(rng.normal(size=n).astype(np.float32)),
            "shard": pa.array(["pool/00000000.tar"] * n),
            "width": pa.array(np.arange(n, dtype=np.int32)),
            "meru_img": pa.FixedSizeListArray.from_arrays(pa.array(emb.ravel()), 8),
        }
    )
    data = parquet_bytes(table)
    assert parquet_bytes(table) == data
    meta = pq.ParquetFile(io.BytesIO(data)).metadata
    cols = {meta.row_group(0).column(i).path_in_schema: meta.row_group(0).column(i) for i in range(5)}
    assert {c.compression for c in cols.values()} == {"ZSTD"}
    assert "BYTE_STREAM_SPLIT" in cols["eps_i"].encodings
    assert "BYTE_STREAM_SPLIT" in cols["meru_img.list.element"].encodings
    assert "RLE_DICTIONARY" in cols["shard"].encodings
    assert not any("DICTIONARY" in e for c in ("uid", "eps_i", "width") for e in cols[c].encodings)
    assert pq.read_table(io.BytesIO(data)).equals(table)
    write_parquet(tmp_path / "t.parquet", table)
    assert (tmp_path / "t.parquet").read_bytes() == data


def test_the_debug_hold_ends_once_the_test_writes_release(tmp_path):
    """`debug.hold_s` holds each shard of the stage so that a test can act mid-shard (kill the worker, take
    its input away). `<pid_dir>/<stage>-<shard id>.release` lets that shard go on (the others stay held);
    `<pid_dir>/release` ends the hold at hand and skips the later ones: a test no longer waits out the
    holds it does not need."""
    import threading
    import time
    from types import SimpleNamespace

    from hype.scoring.config import DebugConfig
    from hype.scoring.stagebase import ShardStage

    stage = SimpleNamespace(name="embed", debug=DebugConfig(pid_dir=str(tmp_path), hold_s=120.0))

    def held(shard: str) -> threading.Thread:
        hold = threading.Thread(
            target=ShardStage._debug_hook, args=(stage, SimpleNamespace(shard_id=shard)), daemon=True
        )
        hold.start()
        deadline = time.monotonic() + 60
        while not (tmp_path / f"embed-{shard}.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (tmp_path / f"embed-{shard}.pid").read_text() == str(os.getpid())
        hold.join(0.3)
        assert hold.is_alive()
        return hold

    first, second = held("s0"), held("s1")
    (tmp_path / "embed-s0.release").touch()
    first.join(30)
    assert not first.is_alive()
    second.join(0.3)
    assert second.is_alive()  # another shard's release does not end this hold
    (tmp_path / "release").touch()
    second.join(30)
    assert not second.is_alive()
    later = threading.Thread(  # a later shard: not held (its 120 s hold would outlast the bounded join)
        target=ShardStage._debug_hook, args=(stage, SimpleNamespace(shard_id="s2")), daemon=True
    )
    later.start()
    later.join(60)
    assert not later.is_alive() and (tmp_path / "embed-s2.pid").exists()
