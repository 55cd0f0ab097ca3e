"""The concept of each scored row, for the audits of a cut: its k-means cluster of c_IN (DESIGN §2.4) and
that cluster's reference class, joined at audit time from the run directory's stage outputs.

A run's `clusters/<shard id>.parquet` holds each sample's nearest centroid, row-aligned with the shard's
`embed/<shard id>.parquet` (which holds the uids); `plan.json` names the shard of each scores part
(`scores/part-<index>.parquet`). The audit joins them by uid, one shard at a time (the parts are read in
order), so it holds one shard's uids and clusters, whatever the pool's size.

Why a join rather than a `cluster` column in the scores table: the merge stage's fingerprint includes
the table's schema, so a new column would rewrite every part of every existing run on its next `hype
score` and change the digests its card records; a grown run would mix parts with and without the
column; and a cluster id means nothing without the run's centroids, which stay in the run directory.
The join costs the audit one read of the uid and cluster columns per shard, and only under `--audit`.
A scores table that does carry a `cluster` column (written by other tools) is read as is.

The reference class of a cluster: the class images of `--class-images` (the `classes` stage's outputs,
with their `.cls` labels) are assigned to their nearest centroid by inner product, as c_IN's targets
are; a cluster's class is the most frequent label among its class images (ties: the lowest label), and
a cluster with no class image has none (`(no class)`): its samples never get c_IN. Class names come from
`classnames.txt` beside the class-image tars when there is one. `--class-features` files carry no
labels: the per-class audit then says so.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from hype.data.uids import UidError, UidMultiset, arrow_to_pairs, to_structured
from hype.io import load_npy, read_bytes, read_json, read_parquet, storage
from hype.select.errors import SelectError
from hype.table.reader import Batch, ScoresTable

NO_CLASS = "(no class)"
UNKNOWN = -1  # a row whose cluster is not found (a damaged run): counted as the group "unknown"


class RunClusters:
    """Cluster of each row of a batch, from the run directory's `clusters` and `embed` outputs."""

    def __init__(self, shards: dict[str, tuple[storage.AnyPath, storage.AnyPath]]):
        self.shards = shards  # part path -> (embed output, clusters output)
        self._part: str | None = None
        self._uids: UidMultiset | None = None
        self._clusters = np.zeros(0, np.int64)
        self.unknown = 0

    @classmethod
    def open(cls, table: ScoresTable) -> tuple[RunClusters | None, str]:
        """(the join, "") for a table written by `hype score` with c_IN on; (None, why not) otherwise."""
        shards: dict[str, tuple[storage.AnyPath, storage.AnyPath]] = {}
        for folder in table.folders:
            run = folder.parent
            plan = read_json(storage.join(run, "plan.json"))
            if not isinstance(plan, dict) or not isinstance(plan.get("shards"), list):
                return None, f"{run}: no plan.json (not a `hype score` run directory): no clusters to join"
            if not storage.is_file(storage.join(run, "clusters", "centroids.npy")):
                return None, (
                    f"{run}: c_IN was off when it was scored (no --class-features or --class-images): no "
                    "k-means clusters"
                )
            ids = {int(s["index"]): str(s["id"]) for s in plan["shards"]}
            for path in table.files:
                if storage.location(path).parent != storage.location(folder):
                    continue
                index = _part_index(storage.location(path).name)
                if index is None or index not in ids:
                    return None, f"{path}: not a part plan.json names; rerun `hype score` to rewrite it"
                sid = ids[index]
                shards[str(path)] = (
                    storage.join(run, "embed", f"{sid}.parquet"),
                    storage.join(run, "clusters", f"{sid}.parquet"),
                )
        return cls(shards), ""

    def clusters(self, batch: Batch) -> np.ndarray:
        """The cluster of every row of `batch` (int64; `UNKNOWN` where the run has none for its uid)."""
        if batch.source != self._part:
            self._load(batch.source)
        hi, lo = batch.uid_pairs()
        at = self._uids.find(hi, lo)  # type: ignore[union-attr]
        self.unknown += int((at < 0).sum())
        return np.where(at >= 0, self._clusters[np.maximum(at, 0)], UNKNOWN)

    def _load(self, part: str) -> None:
        embed, clusters = self.shards[part]
        try:
            uids = read_parquet(embed, columns=["uid"]).column("uid")
            cluster = read_parquet(clusters, columns=["cluster"]).column("cluster")
            hi, lo = arrow_to_pairs(uids, f"{embed}: column 'uid'")
        except (OSError, KeyError, pa.ArrowInvalid, UidError) as e:
            raise SelectError(
                f"{part}: cannot read its shard's clusters ({e}); rerun `hype score` on the run to redo them"
            ) from None
        if len(cluster) != len(hi):
            raise SelectError(f"{clusters}: not row-aligned with {embed}; rerun `hype score` to recompute it")
        # Sorted by uid, then row: the first of a repeated uid leads, the row the merge stage kept.
        order = np.lexsort((np.arange(len(hi)), lo, hi))
        self._uids = UidMultiset(to_structured(hi[order], lo[order]))
        first = np.concatenate([[0], np.cumsum(self._uids.counts)[:-1]]).astype(np.int64)
        values = cluster.to_numpy(zero_copy_only=False).astype(np.int64)
        self._clusters = values[order][first]
        self._part = part


def _part_index(name: str) -> int | None:
    stem = name.removesuffix(".parquet")
    if not stem.startswith("part-") or not stem[5:].isdigit():
        return None
    return int(stem[5:])


def cluster_classes(table: ScoresTable) -> tuple[dict[int, str] | None, str]:
    """(cluster -> the class name of its class images, "") for a run scored with `--class-images`; (None,
    why not) otherwise. Clusters without class images are absent (their samples: `NO_CLASS`)."""
    from hype.scoring.clusters import nearest_centroid
    from hype.scoring.embed_format import fixed_list_to_numpy

    run = table.folder.parent
    if len(table.folders) > 1:
        return None, "several runs read as one table: their clusters differ, no common classes"
    centroids_path = storage.join(run, "clusters", "centroids.npy")
    files = (
        storage.files_with_suffix(storage.join(run, "classes"), ".parquet")
        if storage.is_dir(storage.join(run, "classes"))
        else []
    )
    if not files or not storage.is_file(centroids_path):
        return None, (
            "the run has no labelled class images (scored with --class-features, which carry no "
            "labels, or without c_IN); score with --class-images for the per-class audit"
        )
    centroids = load_npy(centroids_path)
    votes: dict[tuple[int, int], int] = {}
    for path in files:  # a class shard at a time: features of one shard in memory
        t = read_parquet(path, columns=["cls", "clip_img"])
        if not t.num_rows:
            continue
        near = nearest_centroid(fixed_list_to_numpy(t.column("clip_img")), centroids)
        labels = t.column("cls").to_numpy(zero_copy_only=False).astype(np.int64)
        pairs, counts = np.unique(np.stack([near, labels], axis=1), axis=0, return_counts=True)
        for (c, lab), n in zip(pairs.tolist(), counts.tolist(), strict=True):
            votes[(c, lab)] = votes.get((c, lab), 0) + n
    names = _class_names(run)
    best: dict[int, tuple[int, int]] = {}
    for (c, lab), n in sorted(votes.items()):
        if c not in best or n > best[c][1]:
            best[c] = (lab, n)
    return {c: _class_name(lab, names) for c, (lab, _) in best.items()}, ""


def _class_names(run: storage.AnyPath) -> list[str] | None:
    """`classnames.txt` beside the class-image tars the run was scored with (its config.yaml), if any."""
    from hype.config import parse_yaml

    try:
        cfg = parse_yaml(read_bytes(storage.join(run, "config.yaml")), "config.yaml")
        given = cfg["clusters"]["class_images"]
    except (OSError, ValueError, KeyError, TypeError):  # ValueError: also bad YAML (a ConfigError)
        return None
    if not isinstance(given, str):
        return None
    place = storage.location(given.split("::")[0])
    for folder in (place, place.parent, place.parent.parent):
        path = storage.join(folder, "classnames.txt")
        if storage.is_file(path):
            try:
                return [line.strip() for line in read_bytes(path).decode("utf-8").splitlines()]
            except (OSError, UnicodeDecodeError):
                return None
    return None


def _class_name(label: int, names: list[str] | None) -> str:
    if names is not None and 0 <= label < len(names) and names[label]:
        return f"{label}: {names[label]}"
    return f"class {label}"
