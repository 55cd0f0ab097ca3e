"""`dbp:kmeans=cin|neardup`: density-based pruning on the run's own k-means (c_IN's, or the near-duplicate
stage's) instead of one trained at selection: the paper's quotas, computed here in float64 from the same
assignments read back from the run, and the inner rule's best rows inside each cluster."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest
from test_negclip import D, _run, _scores, _unit
from test_score_support import NEARDUP_OVERRIDES, baseline, models, neardup_run, run_cli, score_args, world

import hype.filters  # noqa: F401
from hype.select import SelectError
from hype.select.rules import make_rule
from hype.table.reader import ScoresTable

TAU, NEIGHBORS = 0.05, 3
# The authors' code (github.com/amro-kamal/effective_pruning): prune.py's softmax temperature, the number of
# nearest centroids compute_centroid_distances.py averages for d_inter.
PAPER_TAU, PAPER_NEIGHBORS = 0.5, 20


def _assignments(run, stage: str) -> pd.DataFrame:
    """uid -> (CLIP image embedding, cluster) of the run's shards, from `stage`'s outputs (a repeated uid:
    its first row in shard order)."""
    parts = []
    for s in json.loads((run / "plan.json").read_text())["shards"]:
        emb = pd.read_parquet(run / "embed" / f"{s['id']}.parquet", columns=["uid", "clip_img"])
        if stage == "clusters":  # row-aligned with the embed output
            emb["cluster"] = pd.read_parquet(run / "clusters" / f"{s['id']}.parquet")["cluster"].to_numpy()
        else:
            split = pd.read_parquet(run / stage / f"{s['id']}.parquet", columns=["uid", "cluster"])
            emb = emb.merge(split, on="uid", how="left")
        parts.append(emb)
    return pd.concat(parts).drop_duplicates("uid").set_index("uid").sort_index()


def _paper_quotas(x: np.ndarray, label: np.ndarray, n: int, tau: float, neighbors: int) -> np.ndarray:
    """DBP's quotas (Abbas et al. 2024) in float64: shares softmax(d_intra·d_inter/τ) over the clusters that
    have rows, N·P(c) capped at a cluster's size with the excess handed on in proportion (hype's rule; the
    authors' QP spreads it evenly, filters/dbp.py says why)."""
    live = np.unique(label)
    mu = np.stack([x[label == c].sum(0) for c in live])
    mu /= np.linalg.norm(mu, axis=1, keepdims=True)
    d_intra = np.array([(1 - x[label == c] @ mu[i]).mean() for i, c in enumerate(live)])
    cd = 1 - mu @ mu.T
    m = min(neighbors, len(live) - 1)
    d_inter = np.array([np.sort(np.delete(cd[i], i))[:m].mean() for i in range(len(live))])
    share = np.exp(d_intra * d_inter / tau)
    share /= share.sum()
    size = np.array([(label == c).sum() for c in live])
    quota, left, rest = np.zeros(len(live)), np.ones(len(live), bool), float(n)
    while True:
        q = rest * share * left / (share * left).sum()
        over = left & (q >= size - quota)
        if not over.any():
            quota[left] += q[left]
            return quota
        quota[over] = size[over]
        left &= ~over
        rest = n - quota[~left].sum()


def _check(run, kmeans: str, stage: str, tau: float | None = TAU, neighbors: int | None = NEIGHBORS) -> None:
    """dbp's kept rows on `run` against the paper's quotas at `tau` and `neighbors` (None: not passed to the
    rule, the reference takes the authors' values)."""
    params = {k: v for k, v in {"tau": tau, "neighbors": neighbors}.items() if v is not None}
    got = _scores(ScoresTable(run), "dbp", inner="clip_score", kmeans=kmeans, **params)
    a = _assignments(run, stage)
    x = np.stack(a["clip_img"].to_numpy()).astype(np.float64)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    label, uids = a["cluster"].to_numpy(), a.index.to_numpy()
    assert sorted(got) == list(uids)
    n = len(uids) // 3
    keep = set(sorted(uids, key=lambda u: -got[u])[:n])
    live = np.unique(label)
    counts = np.array([sum(u in keep for u in uids[label == c]) for c in live])
    tau, neighbors = tau or PAPER_TAU, neighbors or PAPER_NEIGHBORS
    quotas = _paper_quotas(x, label, n, tau, neighbors)
    assert np.abs(counts - quotas).max() <= 1
    cos = pd.read_parquet(run / "scores", columns=["uid", "cos_theta"]).set_index("uid")["cos_theta"]
    for c, k in zip(live, counts, strict=True):  # inside each cluster: its best rows by cos θ
        members = uids[label == c]
        assert set(sorted(members, key=lambda u: (-cos[u], u))[:k]) == keep & set(members)


def test_dbp_on_the_runs_cin_and_neardup_kmeans_keeps_the_papers_quotas(tmp_path_factory, tmp_path):
    run = neardup_run(tmp_path_factory)  # c_IN's k-means, reused by the near-duplicate stage
    _check(run, "cin", "clusters")
    _check(run, "neardup", "neardup_split")
    own = tmp_path / "own"  # the near-duplicate stage's own k-means, other clusters than c_IN's
    shutil.copytree(run, own)
    meru, clip = models(tmp_path_factory)
    extra = [*NEARDUP_OVERRIDES, "neardup.reuse_clusters=false", "neardup.num_clusters=4"]
    result = run_cli(score_args(world(tmp_path_factory), meru, clip, own, *extra))
    assert result.exit_code == 0, result.output
    assert not _assignments(own, "neardup_split")["cluster"].equals(_assignments(run, "clusters")["cluster"])
    _check(own, "neardup", "neardup_split")


def test_dbp_defaults_are_the_authors(tmp_path_factory):
    """No tau or neighbors given: the quotas of the authors' code's temperature and 20 nearest centroids
    (failed before: tau defaulted to 0.1)."""
    _check(neardup_run(tmp_path_factory), "cin", "clusters", tau=None, neighbors=None)


def test_dbp_on_a_kmeans_the_run_lacks_names_the_setting(tmp_path_factory, tmp_path):
    with pytest.raises(SelectError, match=r"kmeans=neardup: .* no neardup/groups.json; .*neardup.enabled"):
        make_rule("dbp", kmeans="neardup").attach(ScoresTable(baseline(tmp_path_factory)))
    rng = np.random.default_rng(0)
    table = _run(tmp_path / "r", _unit(rng, 20, D), _unit(rng, 20, D), [f"{i:032x}" for i in range(20)])
    with pytest.raises(SelectError, match=r"kmeans=cin: .* has no clusters/centroids.npy; .*--class-images"):
        make_rule("dbp", kmeans="cin").attach(table)
    with pytest.raises(SelectError, match="kmeans='nope'; use own, cin or neardup"):
        make_rule("dbp", kmeans="nope")
