"""`hype score` end to end with the in-process executor: the scores table, reruns, incremental recompute,
crash and resume, a user-supplied reference set, DataComp metadata input and input errors."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch
from test_score_support import (
    POOL_SIZE,
    alive,
    baseline,
    cli_command,
    descendants,
    digests,
    kill9,
    models,
    run_cli,
    score_args,
    wait_for,
    world,
)

from hype.scoring import embed_format
from hype.table.schema import SCHEMA


def _scores(run):
    return ds.dataset(run / "scores", format="parquet").to_table()


def _summary(run) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_local_run_writes_the_scores_table(tmp_path_factory):
    run = baseline(tmp_path_factory)
    w = world(tmp_path_factory)
    table = _scores(run)
    assert table.schema.equals(SCHEMA)
    truth = pq.read_table(w / "truth.parquet").to_pandas()
    df = table.to_pandas()
    assert len(df) == POOL_SIZE and df.uid.is_unique and set(df.uid) == set(truth.uid)
    assert sorted(p.name for p in (run / "scores").iterdir()) == [f"part-{i:08d}.parquet" for i in range(3)]
    for col in ("eps_i", "eps_t", "neg_d_l", "cos_theta"):
        assert np.isfinite(df[col]).all(), col
    assert (df.neg_d_l <= 0).all() and (df.cos_theta.abs() <= 1 + 1e-6).all()
    assert set(df.c_in) <= {0.0, 10.0} and (df.c_in == 10).any()
    # Pool order: parts by shard, rows in tar order.
    assert list(df.key[:3]) == sorted(df.key[:3]) and df.shard.iloc[0].endswith("00000000.tar")
    merged = df.merge(truth[["uid", "caption", "width", "height"]], on="uid", suffixes=("", "_truth"))
    assert (merged.text == merged.caption.str.strip()).all()
    assert (merged.width == merged.width_truth).all() and (merged.height == merged.height_truth).all()

    s = _summary(run)
    assert s["status"] == "complete" and s["samples"]["scored"] == POOL_SIZE
    assert s["samples"]["skipped"] == 0 and s["samples"]["duplicates"] == 0
    assert s["c_in"]["enabled"] and s["c_in"]["targets"] >= 1
    assert s["reference"]["n_top"] == 100 and s["reference"]["m"] == 80
    assert set(s["stages"]) >= {"embed", "dedup", "reference", "specificity", "classes", "clusters", "merge"}
    assert s["stages"]["embed"]["samples_per_s"] > 0


def test_kmeans_trains_on_the_caption_filtered_rows_as_datacomp_does(tmp_path_factory):
    """DataComp's image_based_clustering.py trains k-means on the rows that pass its caption filter."""
    from hype.data.uids import uids_to_pairs
    from hype.scoring.clusters import kmeans_centroids
    from hype.text.language import datacomp_caption_ok

    run = baseline(tmp_path_factory)
    his, ids, feats = [], [], []
    for index, part in enumerate(sorted((run / "embed").glob("*.parquet"))):  # ids sort in shard order
        t = pq.read_table(part, columns=["uid", "text", "clip_img"])
        rows = np.flatnonzero(datacomp_caption_ok(t.column("text").to_pylist()))
        his.append(uids_to_pairs(t.column("uid").to_pylist())[0][rows])
        ids.append((index << 32) + rows)
        feats.append(embed_format.fixed_list_to_numpy(t.column("clip_img"))[rows])
    his, ids, feats = np.concatenate(his), np.concatenate(ids), np.concatenate(feats)
    n = len(his)
    assert 0 < n < POOL_SIZE  # the synthetic captions include non-English and one-word ones
    c = _summary(run)["c_in"]
    assert c["train_points"] == n and c["kmeans"] == f"trained on {n} caption-filtered rows of {POOL_SIZE}"
    # The training sample is every passing row, in uid-hash order; faiss k-means is deterministic.
    expected = kmeans_centroids(feats[np.lexsort((ids, his))], c["k"])
    np.testing.assert_array_equal(np.load(run / "clusters" / "centroids.npy"), expected)


def test_the_kmeans_sample_is_the_smallest_uid_hashes_read_once_and_refused_when_too_large(
    tmp_path_factory, monkeypatch
):
    """A sample smaller than the eligible rows: exactly the rows with the smallest uid hashes (ties by
    pool order), in that order, whatever the shard order; a sample larger than the machine's memory is
    refused, naming the setting that fixes it, before its array is allocated."""
    import hype.scoring.stage_clusters as sc
    from hype.data.shards import expand_shards
    from hype.data.uids import uids_to_pairs
    from hype.scoring.rundir import RunDir, make_tasks

    run = baseline(tmp_path_factory)
    tasks = make_tasks(expand_shards(str(world(tmp_path_factory) / "pool" / "shards")).paths)
    his, ids, feats = [], [], []
    for task in tasks:
        t = pq.read_table(RunDir(run).shard_output("embed", task), columns=["uid", "clip_img"])
        his.append(uids_to_pairs(t.column("uid").to_pylist())[0])
        ids.append((task.index << 32) + np.arange(t.num_rows))
        feats.append(embed_format.fixed_list_to_numpy(t.column("clip_img")))
    his, ids, feats = np.concatenate(his), np.concatenate(ids), np.concatenate(feats)
    want = feats[np.lexsort((ids, his))[:37]]
    for order in (tasks, tasks[::-1]):
        got, pool, eligible = sc.sample_pool_features(RunDir(run), order, {}, 37, caption_filter=False)
        assert (pool, eligible) == (POOL_SIZE, POOL_SIZE)
        np.testing.assert_array_equal(got, want)

    allocated = []
    monkeypatch.setattr(sc.np, "empty", lambda *a, **k: allocated.append(a) or np.zeros(*a, **k))
    monkeypatch.setattr(sc.os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 1}[name])
    with pytest.raises(sc.ClustersError, match=r"37 rows of \d+ floats .* clusters\.max_train_points=\d+"):
        sc.sample_pool_features(RunDir(run), tasks, {}, 37, caption_filter=False)
    assert allocated == []


def test_scores_match_the_models_run_by_hand(tmp_path_factory):
    """−d_L and cos θ from open_clip's own preprocessing and the models; ε from the stored embeddings."""
    from hype.checkpoint import load_checkpoint
    from hype.data.samples import SkipStats, decode_image, iter_tar_samples
    from hype.geometry import lorentz
    from hype.scoring.reference import load_reference
    from hype.scoring.specificity import image_specificity, text_specificity

    run = baseline(tmp_path_factory)
    w = world(tmp_path_factory)
    meru_path, clip_path = models(tmp_path_factory)
    meru, clip = load_checkpoint(meru_path), load_checkpoint(clip_path)
    shard = w / "pool" / "shards" / "00000001.tar"
    samples = [s for _, s in zip(range(6), iter_tar_samples(str(shard), SkipStats()), strict=False)]
    images = [decode_image(s.image_bytes()) for s in samples]
    texts = [s.caption() for s in samples]
    with torch.no_grad():
        mi = meru.encode_image(torch.stack([meru.preprocess(False)(im) for im in images]))
        mt = meru.encode_text(meru.tokenizer()(texts))
        ci = clip.encode_image(torch.stack([clip.preprocess(False)(im) for im in images]))
        ct = clip.encode_text(clip.tokenizer()(texts))
    part = pq.read_table(run / "scores" / "part-00000001.parquet").to_pandas().iloc[:6]
    np.testing.assert_allclose(part.neg_d_l, -lorentz.distance(mi, mt, meru.curv.item()).numpy(), atol=2e-5)
    np.testing.assert_allclose(
        part.cos_theta, torch.nn.functional.cosine_similarity(ci, ct).numpy(), atol=2e-5
    )

    embed = next((run / "embed").glob("00000001-*.parquet"))
    curv, K = embed_format.model_scalars(embed)
    s_i, s_t = load_reference(run / "reference.safetensors").lifted(curv)
    img = torch.from_numpy(embed_format.read_embeddings(embed, "meru_img"))
    txt = torch.from_numpy(embed_format.read_embeddings(embed, "meru_txt"))
    np.testing.assert_allclose(img[:6].numpy(), mi.numpy(), atol=2e-5)
    full = pq.read_table(run / "scores" / "part-00000001.parquet").to_pandas()
    np.testing.assert_allclose(
        full.eps_i, image_specificity(img.double(), s_t.double(), curv, K=K), atol=1e-4
    )
    np.testing.assert_allclose(full.eps_t, text_specificity(txt.double(), s_i.double(), curv, K=K), atol=1e-4)


def test_rerun_is_a_no_op_and_changed_settings_recompute_only_what_they_affect(tmp_path_factory, tmp_path):
    base = baseline(tmp_path_factory)
    w = world(tmp_path_factory)
    meru, clip = models(tmp_path_factory)
    run = tmp_path / "run"
    shutil.copytree(base, run)
    before = digests(run / "scores")
    result = run_cli(score_args(w, meru, clip, run))
    assert result.exit_code == 0, result.output
    s = _summary(run)
    assert all(m.get("shards_run", 0) == 0 for m in s["stages"].values()), s["stages"]
    assert digests(run / "scores") == before

    # ε settings change ε only: embeddings, references and clusters are reused.
    result = run_cli([*score_args(w, meru, clip, run), "--hinge", "specificity.K=0.3"])
    assert result.exit_code == 0, result.output
    s = _summary(run)
    assert s["stages"]["embed"]["shards_run"] == 0 and s["stages"]["clusters"]["shards_run"] == 0
    assert s["stages"]["specificity"]["shards_run"] == 3 and s["specificity"]["hinge"] is True
    old, new = _scores(base).to_pandas(), _scores(run).to_pandas()
    assert (old.neg_d_l == new.neg_d_l).all() and (old.c_in == new.c_in).all()
    assert not np.allclose(old.eps_t, new.eps_t) and (new.eps_t >= 0).all()


def test_kill_9_mid_run_then_rerun_gives_identical_bytes(tmp_path_factory, tmp_path):
    base = baseline(tmp_path_factory)
    w = world(tmp_path_factory)
    meru, clip = models(tmp_path_factory)
    run, pids = tmp_path / "run", tmp_path / "pids"
    # The hook makes the worker hold each embed shard for a while before processing it, so the kill
    # lands while a shard is in progress; the first shard is let go at once (it is to finish).
    args = score_args(w, meru, clip, run, f"debug.pid_dir={pids}", "debug.hold_s=3")
    proc = subprocess.Popen(cli_command(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: any(pids.glob("*.pid")), 180, proc, "the first shard to start")
        next(pids.glob("*.pid")).with_suffix(".release").touch()
        wait_for(lambda: any((run / "embed").glob("*_stats.json")), 180, proc, "the first shard's stats")
        wait_for(lambda: len(list(pids.glob("*.pid"))) >= 2, 30, proc, "the second shard to start")
        children = descendants(proc.pid)  # its decode processes
        assert children
        kill9(proc.pid)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -9
    wait_for(lambda: not alive(children), 15, what="the killed run's decode processes to exit")
    assert len(list((run / "embed").glob("*_stats.json"))) == 1
    assert len(list((run / "embed").glob("*.parquet"))) == 1  # no partial output under a final name
    assert not (run / "scores").exists() or not any((run / "scores").iterdir())

    result = run_cli(score_args(w, meru, clip, run))
    assert result.exit_code == 0, result.output
    s = _summary(run)
    assert s["stages"]["embed"]["shards_reused"] == 1 and s["stages"]["embed"]["shards_run"] == 2
    assert not list(run.rglob(".*.tmp-*"))
    assert digests(run / "scores") == digests(base / "scores")
    assert digests(run / "embed") == digests(base / "embed")
    assert (run / "reference.safetensors").read_bytes() == (base / "reference.safetensors").read_bytes()


def test_user_reference_file_replaces_the_selection(tmp_path_factory, tmp_path):
    from hype.scoring.reference import load_reference

    base = baseline(tmp_path_factory)
    w = world(tmp_path_factory)
    meru, clip = models(tmp_path_factory)
    run = tmp_path / "run"
    shutil.copytree(base, run)
    g = torch.Generator().manual_seed(3)
    released = {"img": torch.randn(7, 64, generator=g) * 0.3, "txt": torch.randn(5, 64, generator=g) * 0.2}
    torch.save(released, tmp_path / "reference.pt")  # HYPE's released format: tangent vectors
    result = run_cli([*score_args(w, meru, clip, run), "--reference", str(tmp_path / "reference.pt")])
    assert result.exit_code == 0, result.output
    s = _summary(run)
    assert s["reference"]["source"].endswith("reference.pt") and s["stages"]["embed"]["shards_run"] == 0
    refs = load_reference(run / "reference.safetensors")
    assert torch.equal(refs.img, released["img"]) and torch.equal(refs.txt, released["txt"])
    assert not np.allclose(_scores(run).to_pandas().eps_i, _scores(base).to_pandas().eps_i)

    torch.save({"img": torch.zeros(3, 8), "txt": torch.zeros(3, 8)}, tmp_path / "wrong.pt")
    result = run_cli([*score_args(w, meru, clip, run), "--reference", str(tmp_path / "wrong.pt")])
    assert result.exit_code != 0 and "does not match" in result.output


def _npz_metadata(w, meta, missing: set) -> tuple[dict, dict]:
    """DataComp metadata for the world's pool: <hash>.parquet + row-aligned <hash>.npz, random cos θ and
    L2-normalized float16 l14_img features, in another order than the shards; (cos θ, features) by uid."""
    import pyarrow as pa

    rng = np.random.default_rng(0)
    uids = list(pq.read_table(w / "truth.parquet", columns=["uid"]).column("uid").to_pylist())
    listed = [u for u in uids if u not in missing][::-1]
    meta.mkdir()
    expected_cos, expected_feat = {}, {}
    for name, chunk in (("a1b2", listed[:60]), ("c3d4", listed[60:])):
        cos = rng.uniform(0.1, 0.4, len(chunk)).astype(np.float32)
        feats = rng.normal(size=(len(chunk), 32)).astype(np.float32)
        feats /= np.linalg.norm(feats, axis=1, keepdims=True)
        pq.write_table(
            pa.table({"uid": chunk, "text": ["x"] * len(chunk), "clip_l14_similarity_score": cos}),
            meta / f"{name}.parquet",
        )
        np.savez(meta / f"{name}.npz", l14_img=feats.astype(np.float16), b32_img=feats[:, :8])
        expected_cos.update(zip(chunk, cos, strict=True))
        expected_feat.update(zip(chunk, feats.astype(np.float16).astype(np.float32), strict=True))
    return expected_cos, expected_feat


def _metadata_args(w, meru, meta, run, *extra: str) -> list[str]:
    return [
        "--pool",
        str(w / "pool" / "shards"),
        "--meru",
        str(meru),
        "--metadata",
        str(meta),
        "--out",
        str(run),
        "batch_size=32",
        "progress=false",
        "reference.n_top=100",
        "reference.m=80",
        *extra,
    ]


def test_datacomp_metadata_supplies_cos_theta_and_clip_features(tmp_path_factory, tmp_path):
    """--metadata without --clip: cos θ and the c_IN features come from <hash>.parquet + <hash>.npz."""
    w = world(tmp_path_factory)
    meru, _ = models(tmp_path_factory)
    uids = list(pq.read_table(w / "truth.parquet", columns=["uid"]).column("uid").to_pylist())
    missing = set(uids[10:15])  # not in the metadata: skipped with a reason
    meta = tmp_path / "metadata"
    expected_cos, expected_feat = _npz_metadata(w, meta, missing)
    np.save(tmp_path / "classes.npy", np.random.default_rng(1).normal(size=(20, 32)).astype(np.float32))
    run = tmp_path / "run"
    classes = ("--class-features", str(tmp_path / "classes.npy"), "--num-clusters", "4")
    result = run_cli(_metadata_args(w, meru, meta, run, *classes))
    assert result.exit_code == 0, result.output
    df = _scores(run).to_pandas()
    assert len(df) == POOL_SIZE - len(missing) and not (set(df.uid) & missing)
    np.testing.assert_array_equal(df.cos_theta.to_numpy(), np.array([expected_cos[u] for u in df.uid]))
    embed = next((run / "embed").glob("00000000-*.parquet"))
    t = pq.read_table(embed, columns=["uid", "clip_img"])
    feats = embed_format.fixed_list_to_numpy(t.column("clip_img"))
    np.testing.assert_array_equal(feats, np.stack([expected_feat[u] for u in t.column("uid").to_pylist()]))
    s = _summary(run)
    assert s["samples"]["skipped_by_reason"] == {"not_in_metadata": len(missing)}
    assert s["c_in"]["enabled"] and s["c_in"]["k"] == 4


def test_released_centroids_give_datacomp_image_based_baseline_exactly(tmp_path_factory, tmp_path):
    """--centroids replaces k-means; c_IN then equals DataComp's image-based filter (its
    baselines/apply_filter.py, computed here) on the same .npz features, centroids and class features."""
    import faiss

    from hype.text.language import datacomp_caption_ok

    w = world(tmp_path_factory)
    meru, _ = models(tmp_path_factory)
    meta = tmp_path / "metadata"
    _, feature_of = _npz_metadata(w, meta, missing=set())
    rng = np.random.default_rng(5)
    cents = rng.normal(size=(8, 32)).astype(np.float32)
    classes = (cents[[1, 4]].repeat(10, 0) + 0.1 * rng.normal(size=(20, 32))).astype(np.float32)
    np.save(tmp_path / "classes.npy", classes)
    released = tmp_path / "small_centroids_l14.pt"
    torch.save(cents, released, pickle_protocol=4)  # as DataComp's image_based_clustering.py saves them

    def datacomp_image_based(df, centroids: np.ndarray) -> np.ndarray:
        # Targets: the pool centroids ImageNet images are nearest to (argmax of the inner product); a
        # sample is kept when its caption passes and its own nearest centroid is a target.
        c = torch.from_numpy(centroids)
        targets = torch.unique(
            torch.argmax(torch.einsum("ik, jk -> ij", torch.from_numpy(classes), c), dim=1)
        )
        feats = torch.from_numpy(np.stack([feature_of[u] for u in df.uid]))
        labels = torch.argmax(torch.einsum("ik, jk -> ij", feats, c), dim=1)
        keep = datacomp_caption_ok(list(df.text)) & np.isin(labels.numpy(), targets.numpy())
        return np.where(keep, 10.0, 0.0).astype(np.float32)

    run = tmp_path / "run"

    def score(centroids_file, *more):
        extra = ("--class-features", str(tmp_path / "classes.npy"), "--centroids", str(centroids_file), *more)
        result = run_cli(_metadata_args(w, meru, meta, run, *extra))
        assert result.exit_code == 0, result.output
        return _scores(run).to_pandas(), _summary(run)

    df, s = score(released)
    expected = datacomp_image_based(df, cents)
    assert 0 < (expected > 0).sum() < len(df) == POOL_SIZE
    np.testing.assert_array_equal(df.c_in.to_numpy(), expected)
    assert s["c_in"]["k"] == 8 and s["c_in"]["targets"] == 2 and s["c_in"]["centroids"] == str(released)
    assert s["c_in"]["kmeans"] == f"not run: 8 centroids from {released}"

    # The same centroids as a .npy and as a flat faiss index give the same c_IN.
    np.save(tmp_path / "centroids.npy", cents)
    index = faiss.IndexFlatL2(32)
    index.add(cents)
    faiss.write_index(index, str(tmp_path / "centroids.faiss"))
    for name in ("centroids.faiss", "centroids.npy"):
        np.testing.assert_array_equal(score(tmp_path / name)[0].c_in.to_numpy(), expected)

    # Another file under the same name: the rerun notices (its digest keys the clusters) and recomputes.
    other = rng.normal(size=(8, 32)).astype(np.float32)
    np.save(tmp_path / "centroids.npy", other)
    df, s = score(tmp_path / "centroids.npy")
    assert s["stages"]["embed"]["shards_run"] == 0 and s["stages"]["clusters"]["shards_run"] == 3
    np.testing.assert_array_equal(df.c_in.to_numpy(), datacomp_image_based(df, other))
    assert not np.array_equal(df.c_in.to_numpy(), expected)

    # The torch backend (on the run's device: the CPU here) assigns as DataComp does too; the backend keys
    # the clusters stage, so switching to it recomputes that stage and nothing before it.
    df, s = score(tmp_path / "centroids.npy", "clusters.backend=torch")
    assert s["stages"]["embed"]["shards_run"] == 0 and s["stages"]["clusters"]["shards_run"] == 3
    np.testing.assert_array_equal(df.c_in.to_numpy(), datacomp_image_based(df, other))


def test_torch_kmeans_backend_trains_the_clusters_the_flags_follow_and_a_rerun_reuses_them(
    tmp_path_factory, tmp_path
):
    from hype.scoring.clusters import c_in, nearest_centroid

    w = world(tmp_path_factory)
    meru, _ = models(tmp_path_factory)
    meta = tmp_path / "metadata"
    _npz_metadata(w, meta, missing=set())
    np.save(tmp_path / "classes.npy", np.random.default_rng(1).normal(size=(20, 32)).astype(np.float32))
    run = tmp_path / "run"
    args = _metadata_args(w, meru, meta, run, "--class-features", str(tmp_path / "classes.npy"))
    args += ["--num-clusters", "4", "clusters.backend=torch"]
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    model = json.loads((run / "clusters" / "model.json").read_text())
    assert (model["backend"], model["device"], model["k"]) == ("torch", "cpu", 4)
    centroids = np.load(run / "clusters" / "centroids.npy")
    assert centroids.shape == (4, 32) and np.isfinite(centroids).all()

    # Every sample's flag is its nearest centroid's (a target or not) and its caption's.
    targets = np.load(run / "clusters" / "targets.npy")
    parts = sorted((run / "clusters").glob("0*.parquet"))
    assert len(parts) == 3
    for part in parts:
        t = pq.read_table(part).to_pandas()
        embed = pq.read_table(run / "embed" / part.name, columns=["clip_img"])
        nearest = nearest_centroid(embed_format.fixed_list_to_numpy(embed.column("clip_img")), centroids)
        np.testing.assert_array_equal(t.cluster.to_numpy(), nearest)
        np.testing.assert_array_equal(t.c_in.to_numpy(), c_in(nearest, targets, t.caption_ok.to_numpy()))

    again = run_cli(args)
    assert again.exit_code == 0, again.output
    assert _summary(run)["stages"]["clusters"]["shards_run"] == 0
    assert np.load(run / "clusters" / "centroids.npy").tobytes() == centroids.tobytes()


def test_parquet_only_metadata_with_clip_scores_like_no_metadata(tmp_path_factory, tmp_path):
    """DataComp's default metadata download (parquet only, no .npz; the synthetic world's is such):
    --clip computes the CLIP features and cos θ, so every output equals the run without metadata."""
    base = baseline(tmp_path_factory)
    w = world(tmp_path_factory)
    meru, clip = models(tmp_path_factory)
    meta = w / "pool" / "metadata"
    assert not list(meta.glob("*.npz"))
    run = tmp_path / "run"
    result = run_cli([*score_args(w, meru, clip, run), "--metadata", str(meta)])
    assert result.exit_code == 0, result.output
    assert digests(run / "embed") == digests(base / "embed")
    assert digests(run / "scores") == digests(base / "scores")
    s = _summary(run)
    assert s["metadata"] == {
        "dir": str(meta),
        "files": 1,
        "rows": POOL_SIZE,
        "features": "--clip",
        "cos_theta": "--clip",
    }
    assert "CLIP features from --clip" in result.output

    pool = str(w / "pool" / "shards")
    r = run_cli(["--pool", pool, "--meru", str(meru), "--metadata", str(meta), "--out", str(tmp_path / "r2")])
    assert r.exit_code != 0 and ".npz" in r.output and "--download_npz" in r.output and "--clip" in r.output


def test_bad_inputs_are_clear_errors(tmp_path_factory, tmp_path):
    w = world(tmp_path_factory)
    meru, clip = models(tmp_path_factory)
    pool = str(w / "pool" / "shards")
    r = run_cli(["--pool", pool, "--clip", str(clip), "--out", str(tmp_path / "r")])
    assert r.exit_code != 0 and "--meru" in r.output
    r = run_cli(["--pool", pool, "--meru", str(clip), "--clip", str(clip), "--out", str(tmp_path / "r")])
    assert r.exit_code != 0 and "hyperbolic (MERU)" in r.output
    r = run_cli(
        ["--pool", str(tmp_path / "nope"), "--meru", str(meru), "--clip", str(clip), "--out", str(tmp_path)]
    )
    assert r.exit_code != 0 and "no such file or folder" in r.output
    r = run_cli(
        ["--pool", pool, "--meru", str(meru), "--clip", str(clip), "--out", str(tmp_path), "reference.nn=3"]
    )
    assert r.exit_code != 0 and "valid keys in reference: file, n_top, m, hinge" in r.output
    np.save(tmp_path / "pickled.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    r = run_cli(
        [
            "--pool",
            pool,
            "--meru",
            str(meru),
            "--clip",
            str(clip),
            "--out",
            str(tmp_path / "r2"),
            "--class-features",
            str(tmp_path / "pickled.npy"),
            "progress=false",
            "batch_size=64",
        ]
    )
    assert r.exit_code != 0 and "not a plain .npy" in r.output


def test_a_shard_that_keeps_failing_is_reported_and_retried_on_rerun(tmp_path_factory, tmp_path):
    from hype.scoring.rundir import shard_id

    base = baseline(tmp_path_factory)
    w = world(tmp_path_factory)
    meru, clip = models(tmp_path_factory)
    run = tmp_path / "run"
    bad = run / "embed" / f"{shard_id(w / 'pool' / 'shards' / '00000001.tar')}.parquet"
    bad.mkdir(parents=True)  # the shard's output cannot be written: every attempt fails
    result = run_cli([*score_args(w, meru, clip, run), "executor.retries=1"])
    assert result.exit_code == 2
    s = _summary(run)
    assert s["status"] == "failed" and len(s["shards"]["failed"]) == 1
    failed = s["shards"]["failed"][0]
    assert failed["shard"].endswith("00000001.tar") and failed["attempts"] == 2 and failed["stage"] == "embed"
    assert "FAILED" in result.output and "rerun the same command" in result.output
    assert not (run / "scores").exists() or not any((run / "scores").iterdir())

    bad.rmdir()
    result = run_cli(score_args(w, meru, clip, run))
    assert result.exit_code == 0, result.output
    s = _summary(run)
    assert s["status"] == "complete" and s["stages"]["embed"]["shards_reused"] == 2
    assert digests(run / "scores") == digests(base / "scores")


def test_a_rerun_in_another_precision_recomputes_the_embeddings(tmp_path_factory, tmp_path):
    """The embed fingerprint holds the precision the towers ran in (resolved: auto is fp32 on a CPU), so a
    run resumed with precision=bf16 never mixes fp32 and bf16 shards, and going back reuses nothing stale."""
    base = baseline(tmp_path_factory)  # precision auto on a CPU: fp32
    w = world(tmp_path_factory)
    meru, clip = models(tmp_path_factory)
    run = tmp_path / "run"
    shutil.copytree(base, run)
    result = run_cli([*score_args(w, meru, clip, run), "precision=bf16"])
    assert result.exit_code == 0, result.output
    s = _summary(run)
    assert s["stages"]["embed"]["shards_run"] == 3 and s["stages"]["classes"]["shards_run"] > 0
    markers = [json.loads(p.read_text()) for p in (run / "embed").glob("*_stats.json")]
    assert {m["numerics"]["precision"] for m in markers} == {"bf16"}
    assert not np.array_equal(_scores(run).to_pandas().neg_d_l, _scores(base).to_pandas().neg_d_l)

    result = run_cli([*score_args(w, meru, clip, run), "precision=fp32"])  # what auto resolved to
    assert result.exit_code == 0, result.output
    assert _summary(run)["stages"]["embed"]["shards_run"] == 3
    assert digests(run / "scores") == digests(base / "scores")
    result = run_cli(score_args(w, meru, clip, run))  # auto: fp32 here, the same numerics
    assert result.exit_code == 0, result.output
    assert _summary(run)["stages"]["embed"]["shards_run"] == 0


def test_a_failed_rerun_with_another_model_hides_the_old_scores_from_select(tmp_path_factory, tmp_path):
    """The old parts stay on disk while a rerun with another MERU fails at a later stage: select refuses
    the run and names the command that finishes it; that command then gives a selectable table."""
    from click.testing import CliRunner

    from hype.checkpoint import save_checkpoint
    from hype.cli import main
    from hype.models import create_model
    from hype.scoring.rundir import shard_id

    base = baseline(tmp_path_factory)
    w = world(tmp_path_factory)
    _, clip = models(tmp_path_factory)
    torch.manual_seed(1)
    other = tmp_path / "other-meru.safetensors"
    save_checkpoint(other, create_model("tiny-hyperbolic"))
    run = tmp_path / "run"
    shutil.copytree(base, run)
    blocked = run / "specificity" / f"{shard_id(w / 'pool' / 'shards' / '00000001.tar')}.parquet"
    blocked.unlink()
    blocked.mkdir()  # the specificity output of one shard cannot be written
    result = run_cli([*score_args(w, other, clip, run), "executor.retries=0"])
    assert result.exit_code == 2 and _summary(run)["status"] == "failed"
    assert digests(run / "scores") == digests(base / "scores")  # the old model's parts are still there

    select = ["select", "--scores", str(run), "--frac", "0.5", "--out", str(tmp_path / "s.npy")]
    r = CliRunner().invoke(main, select)
    assert r.exit_code != 0 and "failed" in r.output and f"hype score --config {run}/config.yaml" in r.output
    assert not (tmp_path / "s.npy").exists()

    blocked.rmdir()
    r = CliRunner().invoke(main, ["score", "--config", str(run / "config.yaml")])  # the command named
    assert r.exit_code == 0, r.output
    assert digests(run / "scores") != digests(base / "scores")
    r = CliRunner().invoke(main, select)
    assert r.exit_code == 0, r.output


def test_a_runs_config_rescores_that_run_from_any_folder_and_refused_inputs_leave_it_complete(
    tmp_path_factory, tmp_path, monkeypatch
):
    """config.yaml records absolute locations, so `hype score --config RUN/config.yaml` (the command select
    names) works from another folder; a copied run's config.yaml scores the copy, not the run it was copied
    from; and inputs refused before any work (a missing pool or model) leave a complete run as it was."""
    import yaml
    from click.testing import CliRunner

    from hype.cli import main
    from hype.scoring.config import load_score_config

    base = baseline(tmp_path_factory)
    w = world(tmp_path_factory)
    meru, clip = models(tmp_path_factory)
    run = tmp_path / "run"
    shutil.copytree(base, run)
    monkeypatch.chdir(w)  # scored with relative paths
    args = score_args(w, meru, clip, run)
    args[args.index("--pool") + 1] = "pool/shards"
    args[args.index("--class-images") + 1] = "eval/reference/train"
    assert run_cli(args).exit_code == 0
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    assert recorded["pool"] == str(w / "pool" / "shards") and recorded["out"] == str(run)
    assert recorded["clusters"]["class_images"] == str(w / "eval" / "reference" / "train")

    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    rescore = ["score", "--config", str(run / "config.yaml")]
    r = CliRunner().invoke(main, rescore)
    assert r.exit_code == 0, r.output
    assert _summary(run)["status"] == "complete"

    kept = {name: (run / name).read_bytes() for name in ("summary.json", "config.yaml", "plan.json")}
    for option, value in (("--pool", tmp_path / "nope"), ("--meru", tmp_path / "nope.safetensors")):
        r = CliRunner().invoke(main, [*rescore, option, str(value)])
        assert r.exit_code != 0 and "nope" in r.output and "Traceback" not in r.output, r.output
        assert {name: (run / name).read_bytes() for name in kept} == kept, option

    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    r = CliRunner().invoke(main, ["score", "--config", str(copy / "config.yaml")])
    assert r.exit_code == 0, r.output
    assert {name: (run / name).read_bytes() for name in kept} == kept  # the original is untouched
    assert yaml.safe_load((copy / "config.yaml").read_text())["out"] == str(copy)
    assert _summary(copy)["status"] == "complete"
    other = str(tmp_path / "other")  # --out on the command line still chooses
    assert load_score_config(str(copy / "config.yaml"), [f"out={other}"]).out == other


def test_select_refuses_a_run_whose_summary_is_missing_or_not_an_object(tmp_path_factory, tmp_path):
    """The stale-run guard fails closed: a run directory whose summary.json is gone, cut short or not a
    JSON object (its status unknown: it may be a failed run's) is refused, naming the file and the rerun."""
    from click.testing import CliRunner

    from hype.cli import main

    run = tmp_path / "run"
    shutil.copytree(baseline(tmp_path_factory), run)
    good = (run / "summary.json").read_bytes()
    select = ["select", "--scores", str(run), "--frac", "0.5", "--out", str(tmp_path / "s.npy")]
    for damaged in (None, b"[]", b'"complete"', good[: len(good) // 2]):
        (run / "summary.json").unlink(missing_ok=True)
        if damaged is not None:
            (run / "summary.json").write_bytes(damaged)
        r = CliRunner().invoke(main, select)
        assert r.exit_code != 0 and "Traceback" not in r.output, r.output
        assert f"{run}/summary.json: missing, unreadable or not a JSON object" in r.output
        assert f"hype score --config {run}/config.yaml" in r.output
        assert not (tmp_path / "s.npy").exists()
    (run / "summary.json").write_bytes(good)
    r = CliRunner().invoke(main, select)
    assert r.exit_code == 0, r.output


def test_a_part_corrupted_in_place_is_rewritten_by_the_rerun(tmp_path_factory, tmp_path):
    """A scores part damaged on disk with its size unchanged: select names the fix, and the rerun it names
    finds the part's digest wrong and rewrites it (only it)."""
    from click.testing import CliRunner

    from hype.cli import main

    base = baseline(tmp_path_factory)
    w = world(tmp_path_factory)
    meru, clip = models(tmp_path_factory)
    run = tmp_path / "run"
    shutil.copytree(base, run)
    part = run / "scores" / "part-00000001.parquet"
    chunk = pq.ParquetFile(part).metadata.row_group(0).column(SCHEMA.names.index("eps_i"))
    middle = chunk.data_page_offset + chunk.total_compressed_size // 2  # in a column select reads
    data = bytearray(part.read_bytes())
    data[middle : middle + 16] = bytes(255 - b for b in data[middle : middle + 16])
    part.write_bytes(bytes(data))
    select = ["select", "--scores", str(run), "--frac", "0.5", "--out", str(tmp_path / "s.npy")]
    r = CliRunner().invoke(main, select)
    assert r.exit_code != 0 and str(part) in r.output and "hype score" in r.output

    result = run_cli(score_args(w, meru, clip, run))
    assert result.exit_code == 0, result.output
    s = _summary(run)
    assert s["stages"]["merge"]["shards_run"] == 1 and s["stages"]["embed"]["shards_run"] == 0
    assert digests(run / "scores") == digests(base / "scores")
    r = CliRunner().invoke(main, select)
    assert r.exit_code == 0, r.output


def test_a_shard_that_vanishes_while_read_is_read_again_when_it_is_back(tmp_path_factory, tmp_path):
    """An input that cannot be read for a while (a store restarting, a disk remounted) and then is back
    unchanged: the rows it lost are not committed as the shard's output for good: the rerun reads it again
    and the scores equal an uninterrupted run's."""
    base = baseline(tmp_path_factory)
    w = world(tmp_path_factory)
    meru, clip = models(tmp_path_factory)
    pool = tmp_path / "pool"
    shutil.copytree(w / "pool" / "shards", pool)
    args = score_args(w, meru, clip, tmp_path / "run", f"debug.pid_dir={tmp_path / 'pids'}", "debug.hold_s=2")
    args[args.index("--pool") + 1] = str(pool)
    run, tar, away = tmp_path / "run", pool / "00000000.tar", tmp_path / "away.tar"
    proc = subprocess.Popen(cli_command(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: any((tmp_path / "pids").glob("embed-00000000-*.pid")), 180, proc, "shard 0")
        tar.rename(away)  # gone while the worker holds the shard (its identity was taken before)
        (tmp_path / "pids" / "release").touch()  # the worker reads it now; the other shards are not held
        wait_for(lambda: any((run / "embed").glob("00000000-*_stats.json")), 180, proc, "shard 0's marker")
        away.rename(tar)  # back, the same file: same size and modification time
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    result = run_cli(args[: args.index(f"debug.pid_dir={tmp_path / 'pids'}")])
    assert result.exit_code == 0, result.output
    assert _summary(run)["samples"]["scored"] == POOL_SIZE
    assert _scores(run).drop_columns(["shard"]).equals(_scores(base).drop_columns(["shard"]))


def test_the_concept_and_class_audits_join_the_runs_clusters(tmp_path_factory, tmp_path):
    """`hype select --audit` on a real run: kept fraction per k-means cluster of c_IN (joined by uid from
    clusters/ and embed/) and per reference class (the majority label of the class images in the cluster),
    against the same join done by hand with pandas and a brute-force nearest centroid."""
    import pandas as pd
    from click.testing import CliRunner

    from hype.cli import main

    run = tmp_path / "run"
    shutil.copytree(baseline(tmp_path_factory), run)  # select writes its cache beside the scores
    out = tmp_path / "s.npy"
    args = ["select", "--scores", str(run), "--frac", "0.3", "--out", str(out), "--audit", "--no-progress"]
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    audit = json.loads(out.with_suffix(".json").read_text())["audit"]

    plan = json.loads((run / "plan.json").read_text())["shards"]
    parts = []
    for s in plan:
        uids = pq.read_table(run / "embed" / f"{s['id']}.parquet", columns=["uid"]).column(0).to_pylist()
        cluster = pq.read_table(run / "clusters" / f"{s['id']}.parquet").column("cluster").to_pylist()
        parts.append(pd.DataFrame({"uid": uids, "cluster": cluster}))
    joined = _scores(run).to_pandas()[["uid"]].merge(pd.concat(parts).drop_duplicates("uid"), on="uid")
    assert len(joined) == POOL_SIZE
    joined["kept"] = joined["uid"].isin(
        set(pq.read_table(out.with_suffix(".parquet")).column("uid").to_pylist())
    )
    want = joined.groupby("cluster")["kept"].agg(["size", "sum"])
    got = audit["concept"]["groups"]
    assert set(got) == {str(c) for c in want.index} and len(got) >= 2
    for c, r in want.iterrows():
        assert got[str(c)]["rows"] == r["size"] and got[str(c)]["kept"] == r["sum"]

    centroids = np.load(run / "clusters" / "centroids.npy")
    classes = pd.concat(pq.read_table(p).to_pandas() for p in sorted((run / "classes").glob("*.parquet")))
    feats = np.stack(classes["clip_img"].to_numpy()).astype(np.float32)
    classes["near"] = (feats @ centroids.T).argmax(axis=1)
    votes = classes.groupby(["near", "cls"]).size().reset_index(name="n")
    top = votes.sort_values(["near", "n", "cls"], ascending=[True, False, True]).drop_duplicates("near")
    names = (world(tmp_path_factory) / "eval" / "reference" / "classnames.txt").read_text().splitlines()
    label = {int(r.near): f"{int(r.cls)}: {names[int(r.cls)]}" for r in top.itertuples()}
    joined["cls"] = joined["cluster"].map(lambda c: label.get(int(c), "(no class)"))
    want = joined.groupby("cls")["kept"].agg(["size", "sum"])
    got = audit["class"]["groups"]
    assert set(got) == set(want.index)
    for c, r in want.iterrows():
        assert got[c]["rows"] == r["size"] and got[c]["kept"] == r["sum"]
    assert (
        "\n  concept (k-means clusters of c_IN" in res.output
        and "\n  class (the majority class" in res.output
    )
