"""`dbp`: density-based pruning (Abbas et al. 2024, "Effective pruning of web-scale datasets based on
complexity of concept clusters", arXiv 2401.04578): k-means clusters of the pool's CLIP image embeddings,
a share of the kept rows per cluster from its complexity, then another rule's score inside each cluster.

For cluster c with unit centroid μ_c: d_intra(c) = mean over its members of 1 - x·μ_c, d_inter(c) = mean over
its `neighbors` nearest other centroids of 1 - μ_c·μ_c', d(c) = d_intra·d_inter, and its share P(c) =
softmax(d / τ) (defaults τ = 0.5, 20 neighbours, 100 clusters: the authors' code and their DataComp-Medium k).
Cluster c keeps N·P(c) rows, a cluster smaller than its quota keeping all and its excess going to the others
in proportion: that is exactly the global top-N of the score -(r + 1)/P(c) for the row ranked r (from 0)
inside its cluster by the `inner` rule, so `hype select`'s own cut (any --frac/--top-k) applies the quotas.
Ties inside a cluster go to the lower uid. (The authors' prune.py instead solves a quadratic program for N:
quotas nearest N·P(c) under the size caps, the excess spread evenly, and a floor of half the uniform share
N/(2k); its quotas are not one score's top-N for every N, so a cut could not apply them.)

The k-means (`kmeans=own`) is `hype.scoring.clusters.kmeans_centroids` (torch, seeded) and
`nearest_centroid`, exact on any machine. `kmeans=cin` takes each row's cluster from the run's c_IN k-means
instead (`clusters/<shard id>.parquet`, row-aligned with the shard's embed output), `kmeans=neardup` from the
near-duplicate stage's (`neardup_split/<shard id>.parquet`, by uid: c_IN's clusters or its own k-means;
refused when that stage partitioned by pixel descriptors, `neardup.partition=pixel`, its default with the
copy check: those clusters are of pixels, not of meaning);
`clusters` and `seed` then do not apply. The distances are float64 on the exact grid of
`hype.filters.embeddings`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pyarrow as pa

from hype.data.uids import UidError, arrow_to_pairs
from hype.filters.embeddings import PoolEmbeddings, PoolRule, grid_unit, on_grid
from hype.io import read_json, read_parquet, storage
from hype.scoring.clusters import kmeans_centroids, nearest_centroid
from hype.scoring.rundir import RunDir, plan_tasks
from hype.select.errors import SelectError
from hype.select.rules import RULES, make_rule

ROWS = 65536  # pool rows summed or put on the grid at a time (float64): bounds memory at any pool size

# kmeans= of a run's k-means: (the per-shard stage holding each row's cluster, the file that says the run
# has it, the setting that turns it on)
RUN_KMEANS = {
    "cin": ("clusters", "clusters/centroids.npy", "c_IN on (hype score --class-images or --class-features)"),
    "neardup": ("neardup_split", "neardup/groups.json", "neardup.enabled=true"),
}


@RULES.register
class DensityPruning(PoolRule):
    name: ClassVar[str] = "dbp"
    summary: ClassVar[str] = (
        "density-based pruning: per-cluster quotas from cluster complexity, inner rule inside"
    )
    PARAMS: ClassVar = {
        "inner": (
            str,
            "hype",
            "ranking rule inside each cluster (a spec: hype, clip_score, negclip:k=5, ...)",
        ),
        "kmeans": (
            str,
            "own",
            "own | cin | neardup: k-means trained here, or the run's c_IN or near-dup (partition=clip) one",
        ),
        "clusters": (int, 100, "k-means clusters of the pool's CLIP image embeddings (kmeans=own)"),
        "tau": (
            float,
            0.5,
            "softmax temperature over the clusters' d_intra x d_inter (the authors' prune.py default)",
        ),
        "neighbors": (int, 20, "nearest other centroids averaged for d_inter"),
        "seed": (int, 0, "seed of the k-means (kmeans=own)"),
        "max_gb": (float, 16.0, "refuse a pool whose image embeddings (as read and on the grid) exceed this"),
    }

    def __init__(self, **params: Any):
        super().__init__(**params)
        p = self.params
        if p["clusters"] < 1 or p["neighbors"] < 1 or not p["tau"] > 0:
            raise SelectError("rule 'dbp': clusters >= 1, neighbors >= 1 and tau > 0, e.g. dbp:clusters=100")
        if p["kmeans"] not in ("own", *RUN_KMEANS):
            raise SelectError(f"rule 'dbp': kmeans={p['kmeans']!r}; use own, cin or neardup")
        if p["inner"].split(":")[0] == self.name:
            raise SelectError("rule 'dbp': inner=dbp would nest without end; name another rule")
        self.inner = make_rule(p["inner"], "score")

    def pool_values(self, table, pool: PoolEmbeddings) -> np.ndarray:
        x = pool.arrays["clip_img"]
        if self.params["kmeans"] == "own":
            k = min(self.params["clusters"], len(x))
            centroids = kmeans_centroids(x, k, seed=self.params["seed"], backend="torch")
            label = nearest_centroid(x, centroids, backend="torch")
        else:
            label = run_clusters(self.params["kmeans"], table, pool)
            k = int(label.max()) + 1  # clusters no row is in get share 0 whatever k is
        share = cluster_shares(x, label, k, self.params["tau"], self.params["neighbors"])
        inner = self._inner_scores(table, pool)
        order = np.lexsort((np.arange(len(x)), -inner, label))  # per cluster: inner score desc, then uid
        rank = np.empty(len(x), np.int64)
        starts = np.searchsorted(label[order], np.arange(k))
        rank[order] = np.arange(len(x)) - np.repeat(starts, np.bincount(label, minlength=k))
        self.found = {
            "clusters_used": int(k),
            "share_max": float(share.max()),
            "share_min": float(share.min()),
        }
        return -(rank + 1.0) / share[label]

    def _inner_scores(self, table, pool: PoolEmbeddings) -> np.ndarray:
        """The inner rule's score of every embedded row (uid order), from a pass over the scores table."""
        inner = self.inner
        inner.attach(table)
        cols = list(dict.fromkeys(["uid", *inner.columns()]))
        if inner.needs_pool_pass:
            for b in table.iter_batches(cols, progress=None):
                inner.observe(b)
            inner.finish_observe()
        out = np.full(len(pool.uids), -np.inf)
        for b in table.iter_batches(cols, progress=None):
            at = pool.uids.find(*b.uid_pairs())
            out[at[at >= 0]] = np.asarray(inner.score(b), np.float64)[at >= 0]
        return out

    def inputs(self) -> list[dict]:
        return self.inner.inputs()

    def describe(self) -> dict:
        return {"rule": self.name, **self.params, "inner_rule": self.inner.describe(), **self.found}


def run_clusters(source: str, table, pool: PoolEmbeddings) -> np.ndarray:
    """The cluster of each of `pool`'s uids (uid order) from the run's k-means `source` (`RUN_KMEANS`), read
    one shard at a time; a repeated uid's first row (in shard order) counts, as in the pool."""
    stage, needs, turn_on = RUN_KMEANS[source]
    if len(table.folders) != 1:
        raise SelectError(
            f"rule 'dbp': kmeans={source} reads one run's clusters, and --scores names {len(table.folders)} "
            "runs (each with its own k-means); use kmeans=own"
        )
    run = table.folders[0].parent
    if not storage.exists(run / needs):
        raise SelectError(
            f"rule 'dbp': kmeans={source}: {run} has no {needs}; rescore it with {turn_on}, or use kmeans=own"
        )
    layout = RunDir(run)
    if (
        source == "neardup"
        and ((read_json(layout.summary) or {}).get("neardup") or {}).get("partition") == "pixel"
    ):
        raise SelectError(
            f"rule 'dbp': kmeans=neardup: {run}'s near-duplicate clusters are of pixel descriptors "
            "(neardup.partition=pixel), not the semantic clusters dbp's quotas are about; use kmeans=cin or "
            "own, or rescore with neardup.partition=clip"
        )
    label = np.full(len(pool.uids), -1, np.int64)
    for task in plan_tasks(read_json(run / "plan.json") or {}):
        path = layout.shard_output(stage, task)
        try:
            if source == "cin":  # row-aligned with the shard's embed output, which holds the uids
                uids = read_parquet(layout.shard_output("embed", task), columns=["uid"]).column("uid")
                cluster = read_parquet(path, columns=["cluster"]).column("cluster")
            else:
                t = read_parquet(path, columns=["uid", "cluster"])
                uids, cluster = t.column("uid"), t.column("cluster")
            at = pool.uids.find(*arrow_to_pairs(uids, f"{path}: column 'uid'"))
        except (OSError, KeyError, pa.ArrowInvalid, UidError) as e:
            raise SelectError(f"rule 'dbp': cannot read {path} ({e}); rerun hype score on the run") from None
        if len(cluster) != len(at):
            raise SelectError(f"rule 'dbp': {path} is not row-aligned with its embed output; rescore the run")
        found, first = np.unique(at, return_index=True)  # each uid's first row in the shard
        new = (found >= 0) & (label[found] < 0)
        label[found[new]] = cluster.to_numpy(zero_copy_only=False).astype(np.int64)[first[new]]
    if (label < 0).any():
        raise SelectError(
            f"rule 'dbp': {int((label < 0).sum())} rows have no cluster in {run / stage}; rerun hype score "
            "on the run (with the same settings) to complete it, or use kmeans=own"
        )
    return label


def cluster_shares(x: np.ndarray, label: np.ndarray, k: int, tau: float, neighbors: int) -> np.ndarray:
    """P(c) = softmax(d_intra(c)·d_inter(c) / τ) of each of the k clusters of unit rows `x` (DBP, Abbas et al.
    §3); an empty cluster gets share 0."""
    sums, blocks = np.zeros((k, x.shape[1])), range(0, len(x), ROWS)  # ROWS at a time: no float64 pool
    for s in blocks:
        np.add.at(sums, label[s : s + ROWS], x[s : s + ROWS].astype(np.float64))  # row order everywhere
    size = np.bincount(label, minlength=k)
    mu = sums / np.maximum(np.linalg.norm(sums, axis=1, keepdims=True), 1e-12)
    unit = grid_unit(x.shape[1])
    qmu = on_grid(mu)
    own = (
        np.concatenate(  # x·μ of each row's own cluster, exact
            [np.add.reduce(on_grid(x[s : s + ROWS]) * qmu[label[s : s + ROWS]], axis=1) for s in blocks]
        )
        * unit
    )
    d_intra = np.bincount(label, weights=1.0 - own, minlength=k) / np.maximum(size, 1)
    live = np.flatnonzero(size > 0)
    dist = 1.0 - (qmu[live] @ qmu[live].T) * unit
    np.fill_diagonal(dist, np.inf)
    m = min(neighbors, len(live) - 1)
    d_inter = np.zeros(k)
    if m > 0:
        d_inter[live] = np.sort(dist, axis=1)[:, :m].mean(axis=1)
    d = d_intra * d_inter / tau
    share = np.zeros(k)
    share[live] = np.exp(d[live] - d[live].max())
    return share / share.sum()
