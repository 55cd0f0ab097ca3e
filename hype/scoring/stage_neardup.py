"""Near-duplicate stage of `hype score` (`neardup.enabled=true`): duplicate groups of CLIP image features
within k-means clusters (of the images' pixel descriptors by default), a keeper per group. The algorithms
are in `hype.scoring.neardup`.

It runs after merge, because the `hype` keeper is the member with the highest HYPE score (paper Eq. 1 of
the scores table the run just wrote; the fingerprints hold the scores parts' digests, so a rescored pool
recomputes it), on rows of the scores table only (repeated uids are already dropped).

0. `PixelStage` (per shard, executor; only with `neardup.partition=pixel`, the default with the copy
   check): each scored row's 128 x 128 work image (`hype.scoring.copydetect`, 48 KiB),
   decoded from the shard's tar (the stage's only read of the pool's tars), and its pixel descriptor
   (`pixel_descriptors`, 192 bytes) -> `neardup_pixels/<id>.parquet` (`work`, `pixel`, zstd). Memory: one
   shard's work images.
1. clusters (driver): with the pixel partition, k-means (`kmeans_centroids`, the clusters module's backend
   and placement) of the unit pixel descriptors (`pixel_units`) of a deterministic sample of the pool (the
   CLIP k-means' sample, `sample_pool_rows`: `clusters.points_per_centroid` x K rows), read from step 0's
   `pixel` column one shard at a time (no image decoded here; memory: the sample's unit descriptors, 768
   bytes a row, twice with faiss' copy, checked against the free memory first) into
   `neardup.num_clusters` (default: `default_num_clusters`): a copy and its source share one of their 2
   nearest for 0.991 of bench/neardup.py's world-0 true pairs, against 0.83 for the tiny CLIP's. With
   `partition=clip`: c_IN's k-means and each sample's cluster when the clusters stage ran
   (`neardup.reuse_clusters`), else the same k-means of the CLIP image features. Own k-means ->
   `neardup/centroids.npy` (+ `model.json`).
2. `SplitStage` (per shard, executor): each row's cluster (pixel partition: nearest by its unit pixel
   descriptor, `nearest_centroid`, exact on any machine; the cosine to its centroid is the descriptor's,
   which the `semdedup` keeper reads), HYPE score, cosine to its centroid, uid and
   feature, once per cluster it is searched in (`within`: its own and, with `neardup.assign=2`, the
   default, its second-nearest, `second_nearest`: SemDeDup's soft assignment, since a copy and its source
   often fall on two sides of a k-means boundary; with 3 its third-nearest too), with that cluster's group
   of clusters (`within % groups`, `groups` = ceil(rows · assign / `neardup.rows_per_group`)), sorted by
   group with one Parquet row group per group -> `neardup_split/<id>.parquet`; the marker lists the
   groups present. With the copy check (`neardup.copy_check`, the default) each row's work image too, and
   with `neardup.pixel_candidates` (the default) its pixel descriptor: step 0's (the pixel partition), or
   decoded from the shard's tar here (`partition=clip`). Either way each tar is read once.
   Memory: one shard.
3. `GroupStage` (per group of clusters, executor): reads its row group from every shard (the shuffle),
   then per cluster the maximum spanning forest of the pairs >= `neardup.threshold` (faiss range search
   in blocks; with the copy check, of each row's `neardup.candidates` nearest rows at cosine >= the
   threshold and its `neardup.pixel_candidates` nearest of those by pixel descriptor (a small CLIP ranks a
   copy among other renders of its kind; the descriptor ranks it first), the pairs whose copy similarity
   is >= `neardup.copy_threshold`: a small CLIP puts unrelated pictures of one kind at cosine > 0.95, the
   pixels tell copies apart), and the forest of its clusters' forests over its rows by uid (a row in two
   of its clusters is one node, a pair found in both counted once) -> `neardup/group-<g>.parquet`
   (members: uid, cluster, hype, centroid_sim, unit feature) and `group-<g>.edges.parquet` (the forest).
   Memory: one group of clusters (~`rows_per_group` rows' features and pixel descriptors) plus one block
   of pairs (with the copy check, plus the candidates' work images, a row in two clusters counted twice,
   checked against the free memory before they are read); a cluster above `neardup.max_cluster` rows is
   an error naming the fix.
4. driver: the groups of clusters' members united by uid and their forests merged (the forest of forests
   is the forest of all their pairs), the groups (connected components), keepers and each member's cosine
   to its keeper (two passes over the members' features: the keepers' held, checked against the free
   memory first) -> `neardup/groups.parquet` (uid, group, keeper, sim_to_keeper, cluster, hype,
   centroid_sim: one row per member of a group of >= 2) and `neardup/edges.parquet` (a, b: rows of
   groups.parquet, sim), marker `neardup/groups.json` last.

`hype select --filter dedup[:threshold=T,keeper=RULE]` (filters/dedup.py) regroups the members at any
T >= the stored threshold from the forest (`regroup`) and masks every member but the keeper.
"""

from __future__ import annotations

import dataclasses
import io
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import hype.io as hype_io
from hype.executor import Resources, available_memory
from hype.geometry.exact import pair_dots
from hype.io import blake2b128_bytes, load_npy, read_json, read_parquet
from hype.io.storage import AnyPath
from hype.scoring import embed_format
from hype.scoring.clusters import ASSIGN, default_num_clusters, kmeans_centroids, nearest_centroid
from hype.scoring.context import StageSpec, SummaryView
from hype.scoring.copydetect import (
    WORK_FORMAT,
    WORK_SIDE,
    CopyCheck,
    occurrences,
    pair_similarities,
    tar_work_images,
)
from hype.scoring.dedup import keep_mask
from hype.scoring.errors import ScoreError
from hype.scoring.neardup import (
    PAIRS_PER_BLOCK,
    PIXEL_BYTES,
    PIXEL_SIDE,
    NeardupError,
    cluster_forest,
    components,
    keepers,
    merged_forest,
    nearest_pairs,
    normalize_rows,
    pixel_descriptors,
    pixel_units,
    second_nearest,
    spanning_forest,
    uid_nodes,
)
from hype.scoring.pricing import (
    JSON_GET,
    MISSING,
    ShardReads,
    add,
    lists,
    parquet_get,
    stage_requests,
    stream_get,
)
from hype.scoring.rundir import (
    RunDir,
    ShardTask,
    atomic_write_bytes,
    atomic_write_json,
    completed,
    fingerprint,
    parquet_options,
    write_parquet,
)
from hype.scoring.stagebase import ShardStage
from hype.table.schema import METRICS

WORK_BYTES = WORK_SIDE * WORK_SIDE * 3  # one work image (RGB uint8) in the pixel stage's and split's `work`
SPLIT_FORMAT = "neardup-split-2"  # enters the split fingerprint: change it when the split's columns change
# enters the groups' fingerprint: a group of clusters writes its members (each uid once, with its feature)
# and their forest; the driver unites them (a row searched in two clusters may join groups of both)
GROUPS_FORMAT = "neardup-groups-2"
GROUP_COLUMNS = ("uid", "group", "keeper", "sim_to_keeper", "cluster", "hype", "centroid_sim")


def folder(run: RunDir) -> AnyPath:
    return run.root / "neardup"


def groups_path(run: RunDir) -> AnyPath:
    return folder(run) / "groups.parquet"


def edges_path(run: RunDir) -> AnyPath:
    return folder(run) / "edges.parquet"


def groups_marker(run: RunDir) -> AnyPath:
    return folder(run) / "groups.json"


def group_task(g: int) -> ShardTask:
    """The unit of work of `GroupStage`: one group of clusters (named like a shard for the executor)."""
    return ShardTask(g, f"cluster group {g}", f"group-{g:05d}", source=f"cluster group {g}")


class _CpuStage(ShardStage):
    def resources(self) -> Resources:
        # CPU work (tar decoding, Parquet, faiss' CPU assignment): no GPU share held on a GPU cluster
        return dataclasses.replace(super().resources(), gpus=0.0)


class PixelStage(_CpuStage):
    """Per shard, with `neardup.partition=pixel`: each scored row's work image, decoded from the shard's tar
    (the only read of the pool's tars in the stage), and its pixel descriptor, row-aligned with the scored
    rows -> `neardup_pixels/<id>.parquet` (`work`, `pixel`): the driver's k-means sample reads the `pixel`
    column, the split both. Memory: one shard's work images."""

    name = "neardup_pixels"

    def __init__(self, run: RunDir, *, drops: dict | None = None, **kw):
        super().__init__(run, **kw)
        self.drops = drops or {}

    def fingerprint(self, task: ShardTask) -> str:
        drops = np.asarray(self.drops.get(task.index, ()), np.int64)
        return fingerprint(
            {
                "stage": self.name,
                "embed": self.upstream_digest("embed", task),
                "drops": blake2b128_bytes(drops.tobytes()),
                "work_images": WORK_FORMAT,
                "pixels": PIXEL_FORMAT,
            }
        )

    def run(self, task: ShardTask) -> dict:
        started = time.perf_counter()
        fp = self.fingerprint(task)
        self._debug_hook(task)
        keys = read_parquet(self.run_dir.shard_output("embed", task), columns=["key"]).column(0).to_pylist()
        rows = np.flatnonzero(keep_mask(len(keys), self.drops.get(task.index)))  # SplitStage's rows
        work = _work_images(task.source, keys, rows)
        table = pa.table({"work": _binary_column(work), "pixel": _binary_column(pixel_descriptors(work))})
        return self._finish(task, fp, table, started, rate=len(rows), counts={"samples": len(rows)})


def read_pixels(run: RunDir, task: ShardTask, columns: list[str]) -> dict[str, np.ndarray]:
    """`PixelStage`'s `columns` of a shard: `work` as (rows, WORK_SIDE, WORK_SIDE, 3) uint8, `pixel` as
    (rows, PIXEL_BYTES) int8 (`pixel_descriptors`), row-aligned with the shard's scored rows."""
    t = read_parquet(run.shard_output(PixelStage.name, task), columns=columns)
    out = {}
    if "work" in columns:
        out["work"] = _binary_rows(t.column("work"), WORK_BYTES).reshape(-1, WORK_SIDE, WORK_SIDE, 3)
    if "pixel" in columns:
        out["pixel"] = _binary_rows(t.column("pixel"), PIXEL_BYTES, np.int8)
    return out


class SplitStage(_CpuStage):
    """Per shard: cluster, group of clusters, HYPE score, cosine to the centroid and feature of every scored
    row, one Parquet row group per group of clusters (read by `GroupStage` without the others)."""

    name = "neardup_split"

    def __init__(
        self,
        run: RunDir,
        *,
        groups: int,
        model_digest: str,
        reuse_clusters: bool,
        drops: dict | None = None,
        work_images: bool = False,
        pixels: bool = False,
        assign: int = 1,
        pixel_partition: bool = False,
        **kw,
    ):
        super().__init__(run, **kw)
        self.groups = groups
        # the clusters: neardup's k-means of the rows' `pixel_units` (needs the work images), else CLIP's
        self.pixel_partition = work_images and pixel_partition
        self.pixels = work_images and pixels  # each row's `pixel_descriptors` in a `pixel` column
        self.assign = assign  # 2 (3): each row also in its second- (third-) nearest cluster, as SemDeDup
        self.work_images = work_images  # the copy check's: each row's work image in a `work` column
        self.model_digest = model_digest
        self.reuse_clusters = reuse_clusters  # the clusters stage's `cluster` column, else neardup's model
        self.drops = drops or {}

    def fingerprint(self, task: ShardTask) -> str:
        return fingerprint(
            {
                "stage": self.name,
                "embed": self.upstream_digest("embed", task),
                "merge": self.upstream_digest("merge", task),
                "clusters": self.upstream_digest("clusters", task) if self.reuse_clusters else None,
                "model": self.model_digest,
                "groups": self.groups,
                "format": SPLIT_FORMAT,
                "clusters_per_row": self.assign,  # not "assign": ASSIGN's key (the assignment rule)
                **ASSIGN,  # the rows' clusters
                **({"work_images": WORK_FORMAT} if self.work_images else {}),  # without: as before the check
                **({"pixels": PIXEL_FORMAT} if self.pixels else {}),  # without: as before pixel candidates
                **self._partition(task),
            }
        )

    def _partition(self, task: ShardTask) -> dict:
        """The pixel partition in the fingerprint, with `PixelStage`'s output (the rows' work images and
        descriptors come from it, not the tar); without: CLIP's clusters, as before."""
        if not self.pixel_partition:
            return {}
        return {"partition": "pixel", "pixel_images": self.upstream_digest(PixelStage.name, task)}

    def setup(self) -> None:
        super().setup()
        path = self.run_dir.centroids if self.reuse_clusters else centroids_path(self.run_dir)
        self._centroids = normalize_rows(load_npy(path))

    def run(self, task: ShardTask) -> dict:
        from hype.table.combine import hype_score

        started = time.perf_counter()
        fp = self.fingerprint(task)
        self._debug_hook(task)
        r = self.run_dir
        emb = read_parquet(r.shard_output("embed", task), columns=["uid", "key", "clip_img"])
        keep = keep_mask(emb.num_rows, self.drops.get(task.index))
        scores = read_parquet(r.shard_output("merge", task), columns=["uid", *METRICS])
        uids = emb.column("uid").filter(pa.array(keep))
        if not uids.equals(scores.column("uid")):
            raise RuntimeError(
                f"{task.shard_id}: embed output and scores part differ; rerun to recompute them"
            )
        feats = embed_format.fixed_list_to_numpy(emb.column("clip_img"))[keep]
        rows = np.flatnonzero(keep)  # the scored rows among the embed output's
        work = pixels = None
        if self.pixel_partition:  # decoded once, by `PixelStage`
            got = read_pixels(r, task, ["work", "pixel"])
            work, pixels = got["work"], got["pixel"]
        elif self.work_images:
            work = _work_images(task.source, emb.column("key").to_pylist(), rows)
            pixels = pixel_descriptors(work)
        # the rows as the centroids see them: unit pixel descriptors, or CLIP features (as before: unscaled)
        space = pixel_units(pixels) if self.pixel_partition else feats
        if self.reuse_clusters:
            cluster = read_parquet(r.shard_output("clusters", task), columns=["cluster"]).column(0)
            cluster = cluster.to_numpy().astype(np.int64)[keep]
        else:
            cluster = nearest_centroid(space, self._centroids) if len(feats) else np.zeros(0, np.int64)
        unit = space if self.pixel_partition else normalize_rows(feats)
        centroid_sim = np.einsum("ij,ij->i", unit, self._centroids[cluster]) if len(unit) else unit[:, 0]
        hype = hype_score({m: scores.column(m).to_numpy() for m in METRICS})
        src, within = np.arange(len(feats)), cluster  # each row in its own cluster ...
        taken = cluster[:, None]
        for _ in range(self.assign - 1):  # ... and a copy of it in its second- (third-) nearest one
            nxt = second_nearest(space, self._centroids, taken)
            also = np.flatnonzero(nxt >= 0)
            src, within = np.concatenate([src, also]), np.concatenate([within, nxt[also]])
            taken = np.column_stack([taken, nxt])
        group = within % self.groups
        order = np.lexsort((within, group))  # by group, then cluster searched; stable within
        src = src[order]
        table = pa.table(
            {
                "group": pa.array(group[order], pa.int32()),
                "cluster": pa.array(cluster[src], pa.int32()),  # its own (dbp's kmeans=neardup reads it)
                "within": pa.array(within[order], pa.int32()),  # the cluster it is searched in
                "uid": uids.take(pa.array(src)),
                "hype": pa.array(hype[src], pa.float64()),
                "centroid_sim": pa.array(centroid_sim[src], pa.float32()),
                "clip_img": embed_format.fixed_list(feats[src]),
            }
        )
        if work is not None:
            table = table.append_column("work", _binary_column(work[src]))
            if self.pixels:
                table = table.append_column("pixel", _binary_column(pixels[src]))
        present, counts = np.unique(group, return_counts=True)
        return self._finish(
            task,
            fp,
            table,
            started,
            rate=len(feats),
            counts={"samples": len(feats), "rows": table.num_rows},  # rows: with the second clusters'
            groups=[[int(g), int(n)] for g, n in zip(present, counts, strict=True)],
        )

    def _write_output(self, task: ShardTask, table: pa.Table) -> dict:
        """One row group per group of clusters, in group order (the marker's `groups` list)."""
        buf = io.BytesIO()
        opts = {k: v for k, v in parquet_options(table.schema).items() if k != "row_group_size"}
        group = table.column("group").to_numpy()
        bounds = np.flatnonzero(np.diff(group)) + 1
        with pq.ParquetWriter(buf, table.schema, **opts) as writer:
            for start, stop in zip([0, *bounds], [*bounds, len(group)], strict=True):
                if stop > start:
                    writer.write_table(table.slice(start, stop - start), row_group_size=stop - start)
        data = buf.getvalue()
        written = atomic_write_bytes(self.run_dir.shard_output(self.name, task), data)
        return {
            "file": written.name,
            "rows": table.num_rows,
            "bytes": len(data),
            "digest": blake2b128_bytes(data),
        }


PIXEL_FORMAT = f"rgb-{PIXEL_SIDE}x{PIXEL_SIDE}-int8"  # `pixel_descriptors`: change it when they change


def _work_images(tar: str, keys: list[str], rows: np.ndarray) -> np.ndarray:
    """(len(rows), WORK_SIDE, WORK_SIDE, 3) uint8: the work images of the shard's `rows` (indices into its
    embed output's `keys`, a repeated key told apart by `occurrences`), read from its tar once; an image
    that cannot be decoded is flat (it matches nothing)."""
    every = occurrences(keys)
    names = [every[i] for i in rows]
    images, _ = tar_work_images(tar, set(names))
    out = np.zeros((len(names), WORK_SIDE, WORK_SIDE, 3), np.uint8)
    for i, name in enumerate(names):
        if name in images:
            out[i] = images[name]
    return out


def _binary_column(rows: np.ndarray) -> pa.Array:
    """Each row of `rows` (uint8 or int8) as one fixed-size binary value."""
    width = math.prod(rows.shape[1:])
    return pa.array([r.tobytes() for r in rows], pa.binary(width))


def _binary_rows(col: pa.ChunkedArray, width: int, dtype: type = np.uint8) -> np.ndarray:
    """A fixed-size binary column (`_binary_column`) as (rows, width) of `dtype` (no copy when one chunk)."""
    col = col.combine_chunks()
    return np.frombuffer(col.buffers()[1], dtype, len(col) * width, col.offset * width).reshape(-1, width)


def _check_memory(images: int) -> None:
    """Refuse, before allocating, a group whose candidates' work images do not fit (twice: the copy check's
    thumbnails of them are about as large). A row searched in two clusters counts in each."""
    _refuse_above_free(
        2 * images * WORK_BYTES,
        f"the copy check of a group of clusters holds {images:,} work images",
        "lower neardup.rows_per_group or neardup.candidates",
    )


def _refuse_above_free(need: int, what: str, fix: str) -> None:
    """NeardupError naming `what` and the `fix` when `need` bytes are more than the free memory."""
    free = available_memory()
    if free is not None and need > free:
        raise NeardupError(f"{what} (~{need / 2**30:.1f} GiB), {free / 2**30:.1f} GiB free: {fix}")


def read_split_group(
    run: RunDir, shard: ShardTask, g: int, columns: list[str] | None = None
) -> pa.Table | None:
    """Shard's rows of group of clusters `g` (its row group; `columns` of it), or None when it has none."""
    stats = read_json(run.shard_stats(SplitStage.name, shard)) or {}
    present = [grp for grp, _ in stats.get("groups", [])]
    if g not in present:
        return None
    with hype_io.open_input(run.shard_output(SplitStage.name, shard)) as f:
        return pq.ParquetFile(f).read_row_group(present.index(g), columns=columns)


class GroupStage(ShardStage):
    """Per group of clusters: the duplicate groups of each of its clusters, their keepers and forests."""

    name = "neardup"

    def __init__(
        self,
        run: RunDir,
        *,
        shards: list[ShardTask],
        splits_digest: str,
        threshold: float,
        keeper: str,
        seed: int,
        max_cluster: int,
        pairs_per_block: int = PAIRS_PER_BLOCK,
        check: CopyCheck | None = None,
        candidates: int = 10,
        pixel_candidates: int = 0,
        **kw,
    ):
        super().__init__(run, **kw)
        self.check = check  # None: every pair >= threshold is an edge (before the copy check)
        self.candidates = candidates
        self.pixel_candidates = pixel_candidates if check else 0  # the split's `pixel` column ranks them
        self.shards = shards
        self.splits_digest = splits_digest
        self.threshold = threshold
        self.keeper = keeper
        self.seed = seed
        self.max_cluster = max_cluster
        self.pairs_per_block = pairs_per_block

    def fingerprint(self, task: ShardTask) -> str:
        return fingerprint(
            {
                "stage": self.name,
                "group": task.index,
                "splits": self.splits_digest,
                "threshold": self.threshold,
                "keeper": self.keeper,
                "seed": self.seed,
                "max_cluster": self.max_cluster,
                "cosines": "pair_cosines",  # fixed-order float64 (earlier runs: the search's own, redone)
                "format": GROUPS_FORMAT,
                **(
                    {"copy_check": self.check.settings(), "candidates": self.candidates} if self.check else {}
                ),
                # without: as before pixel candidates (the same groups)
                **({"pixel_candidates": self.pixel_candidates} if self.pixel_candidates else {}),
            }
        )

    def label(self, task: ShardTask) -> str:
        return task.path

    def copy_check_settings(self) -> dict | None:
        """The candidates and the copy check's settings (None: every pair >= threshold joins)."""
        if self.check is None:
            return None
        return {
            "candidates": self.candidates,
            "pixel_candidates": self.pixel_candidates,
        } | self.check.settings()

    def run(self, task: ShardTask) -> dict:
        from hype.data.uids import arrow_to_pairs

        started = time.perf_counter()
        fp = self.fingerprint(task)
        self._debug_hook(task)
        columns = ["group", "cluster", "within", "uid", "hype", "centroid_sim", "clip_img"]  # work: later
        columns += ["pixel"] if self.pixel_candidates else []
        parts = [(s, read_split_group(self.run_dir, s, task.index, columns)) for s in self.shards]
        parts = [(s, p) for s, p in parts if p is not None and p.num_rows]
        shards, parts = [s for s, _ in parts], [p for _, p in parts]
        rows = sum(p.num_rows for p in parts)
        members, edges = _empty_members(), (np.zeros(0, np.int64),) * 2 + (np.zeros(0, np.float32),)
        clusters = 0
        if rows:
            t = pa.concat_tables(parts).combine_chunks()
            order = np.argsort(t.column("within").to_numpy(), kind="stable")
            t = t.take(pa.array(order))
            cluster = t.column("within").to_numpy()
            feats = normalize_rows(embed_format.fixed_list_to_numpy(t.column("clip_img")))
            pixels = _binary_rows(t.column("pixel"), PIXEL_BYTES, np.int8) if self.pixel_candidates else None
            hi, lo = arrow_to_pairs(t.column("uid"), f"{task.shard_id}: uid")
            bounds = np.flatnonzero(np.diff(cluster)) + 1
            spans = []
            for start, stop in zip([0, *bounds], [*bounds, rows], strict=True):
                clusters += 1
                if stop - start < 2:
                    continue
                if stop - start > self.max_cluster:
                    raise NeardupError(
                        f"cluster {int(cluster[start])} has {stop - start:,} rows, more than "
                        f"neardup.max_cluster={self.max_cluster:,}: set more clusters "
                        "(neardup.num_clusters=K, with partition=clip and neardup.reuse_clusters=false) or "
                        "raise neardup.max_cluster (memory: its features)"
                    )
                spans.append((start, stop))
            forests = [self._edges(feats[a:b], None if pixels is None else pixels[a:b]) for a, b in spans]
            if self.check is not None:
                forests = self._confirm(spans, forests, shards, task.index, order)
            members, edges = _members(t, feats, hi, lo, spans, forests)
        # edges first, then members, then the marker (`_finish`): the marker means both are there
        edge_out = write_parquet(
            self.edges_output(task),
            pa.table({"a": edges[0], "b": edges[1], "sim": pa.array(edges[2], pa.float32())}),
        )
        return self._finish(
            task,
            fp,
            pa.table(members),
            started,
            rate=rows,
            counts={"samples": rows, "clusters": clusters, "members": len(members["uid"])},
            edges=edge_out,
        )

    def edges_output(self, task: ShardTask) -> AnyPath:
        return self.run_dir.root / self.name / f"{task.shard_id}.edges.parquet"

    def _edges(self, x: np.ndarray, pixels: np.ndarray | None) -> tuple[np.ndarray, ...]:
        """One cluster's forest (without the copy check) or its copy-check candidates: (a, b, cosine)."""
        kw = {"pairs_per_block": self.pairs_per_block, "device": self.device}
        if self.check is None:
            return cluster_forest(x, self.threshold, **kw)
        return nearest_pairs(
            x, self.threshold, self.candidates, pixels=pixels, pixel_k=self.pixel_candidates, **kw
        )

    def _confirm(self, spans: list, cands: list, shards: list[ShardTask], g: int, order: np.ndarray) -> list:
        """Each cluster's forest of its candidate pairs that the copy check confirms (`spans`: the clusters'
        rows of the group, sorted by cluster; `order`: their places in the shards' parts, concatenated).
        Only the candidates' work images are held, read one shard's work column at a time."""
        ends = [np.concatenate([a, b]) + start for (start, _), (a, b, _) in zip(spans, cands, strict=True)]
        needed = np.unique(np.concatenate([np.zeros(0, np.int64), *ends]))
        _check_memory(len(needed))
        works = np.zeros((len(needed), WORK_SIDE, WORK_SIDE, 3), np.uint8)
        source, start = order[needed], 0
        for shard in shards:
            part = _binary_rows(read_split_group(self.run_dir, shard, g, ["work"]).column("work"), WORK_BYTES)
            inside = np.flatnonzero((source >= start) & (source < start + len(part)))
            works[inside] = part.reshape(-1, *works.shape[1:])[source[inside] - start]
            start += len(part)
        out = []
        for (first, stop), (a, b, sim) in zip(spans, cands, strict=True):
            at = np.stack([np.searchsorted(needed, a + first), np.searchsorted(needed, b + first)], axis=1)
            # only whether a pair reaches the threshold: one that does is not searched further
            sims = pair_similarities(works, works, at, self.check, enough=self.check.threshold)
            ok = sims >= self.check.threshold
            out.append(spanning_forest(stop - first, a[ok], b[ok], sim[ok]))
        return out


def _members(t: pa.Table, feats: np.ndarray, hi, lo, spans: list, forests: list) -> tuple[dict, tuple]:
    """The group of clusters' members (each uid once: a row searched in two of its clusters is one node)
    and the maximum spanning forest of its clusters' forests (member indices): what the driver unites
    across groups of clusters. The members' unit features go along for their cosine to the keeper."""
    starts = [start for start, _ in spans]
    a = np.concatenate([np.zeros(0, np.int64), *[f[0] + at for at, f in zip(starts, forests, strict=True)]])
    b = np.concatenate([np.zeros(0, np.int64), *[f[1] + at for at, f in zip(starts, forests, strict=True)]])
    sim = np.concatenate([np.zeros(0, np.float32), *[f[2] for f in forests]])
    node, first = uid_nodes(hi, lo)
    a, b, sim = merged_forest(len(first), node[a], node[b], sim)
    nodes = np.unique(np.concatenate([a, b]))  # members: every node a forest edge touches
    rows = first[nodes]
    members = {
        "uid": t.column("uid").take(pa.array(rows)).combine_chunks(),
        "cluster": t.column("cluster").to_numpy()[rows],
        "hype": t.column("hype").to_numpy()[rows],
        "centroid_sim": t.column("centroid_sim").to_numpy()[rows],
        "clip_img": embed_format.fixed_list(feats[rows]),
    }
    return members, (np.searchsorted(nodes, a), np.searchsorted(nodes, b), sim)


def _empty_members() -> dict:
    return {
        "uid": pa.array([], pa.string()),
        "cluster": np.zeros(0, np.int32),
        "hype": np.zeros(0, np.float64),
        "centroid_sim": np.zeros(0, np.float32),
    }


def centroids_path(run: RunDir) -> AnyPath:
    return folder(run) / "centroids.npy"


@dataclass(frozen=True)
class Model:
    """Where each row's cluster comes from: c_IN's (reuse) or neardup's own k-means (of the pixel
    descriptors with `pixel`)."""

    digest: str
    reuse: bool
    k: int
    pixel: bool = False


def _model(state: Any, pool: Any, clusters_info: dict | None) -> Model:
    """With `neardup.partition=pixel`, k-means of the pixel descriptors (`_pixel_sample`); else c_IN's
    k-means when it ran and `reuse_clusters`, or the same k-means trained for this stage."""
    from hype.scoring.clusters import backend_key, placement
    from hype.scoring.stage_clusters import sample_pool_features

    nc, cc, run = state.cfg.neardup, state.cfg.clusters, state.run
    pixel = nc.pixel_partition
    if clusters_info is not None and nc.reuse_clusters and not pixel:
        return Model(clusters_info["digest"], True, int(clusters_info["k"]))
    k = nc.num_clusters or default_num_clusters(pool.unique)
    max_points = cc.points_per_centroid * k
    fp = fingerprint(
        {
            "pool": pool.fingerprint,
            "dups": pool.dups["digest"],
            "k": k,
            "niter": cc.niter,
            "seed": cc.seed,
            "max_points": max_points,
            "gpu": cc.gpu,
            **backend_key(cc.backend),
            **({"partition": "pixel", "pixels": PIXEL_FORMAT, "work": WORK_FORMAT} if pixel else {}),
        }  # fmt: skip
    )
    marker = folder(run) / "model.json"
    done = completed(marker, fp, centroids_path(run))
    if done is None:
        if pixel:
            sample = _pixel_sample(run, pool.tasks, pool.drops, max_points)
        else:
            sample, _, _ = sample_pool_features(run, pool.tasks, pool.drops, max_points, caption_filter=False)
        if k > len(sample):
            state.warn(f"{len(sample)} points for the near-duplicate k-means: clusters reduced from {k}")
            k = len(sample)
        where = placement(cc.backend, state.cfg.device)
        centroids = kmeans_centroids(sample, k, niter=cc.niter, seed=cc.seed, gpu=cc.gpu, **where)
        buf = io.BytesIO()
        np.save(buf, centroids, allow_pickle=False)
        data = buf.getvalue()
        atomic_write_bytes(centroids_path(run), data)
        digest = blake2b128_bytes(data)
        done = {"fingerprint": fp, "k": k, "digest": digest, "output": {"bytes": len(data), "digest": digest}}
        if pixel:
            done |= {"partition": "pixel", "pixels": PIXEL_FORMAT, "sample": len(sample)}
        atomic_write_json(marker, done)
    return Model(done["digest"], False, int(done["k"]), pixel)


def _check_pixel_sample(rows: int) -> None:
    """Refuse, before reading, a pixel k-means sample of `rows` unit descriptors (twice: faiss' copy) that
    does not fit (one shard's `pixel` column is read at a time: 192 bytes a row)."""
    _refuse_above_free(
        2 * rows * PIXEL_BYTES * 4,
        f"the pixel k-means sample of {rows:,} images",
        "set fewer neardup.num_clusters or a lower clusters.points_per_centroid",
    )


def _pixel_sample(run: RunDir, tasks: list[ShardTask], drops: dict, max_points: int) -> np.ndarray:
    """(rows, PIXEL_BYTES) float32: the `pixel_units` of the CLIP k-means' deterministic sample of the pool
    (`sample_pool_rows`), from `PixelStage`'s `pixel` column (no tar read here), one shard at a time; the
    sample checked against the free memory before it is read."""
    from hype.scoring.stage_clusters import sample_pool_rows
    from hype.scoring.topk import split_order_id

    chosen, _, _ = sample_pool_rows(run, tasks, drops, max_points, caption_filter=False)
    _check_pixel_sample(len(chosen))
    by_id = np.argsort(chosen, kind="stable")  # its rows grouped by shard, in row order
    shard_of, row_of = split_order_id(chosen[by_id])
    out = np.zeros((len(chosen), PIXEL_BYTES), np.float32)
    for task in tasks:
        lo, hi = np.searchsorted(shard_of, [task.index, task.index + 1])
        if hi > lo:
            rows = row_of[lo:hi]  # embed rows, kept: each one's place among the kept rows is PixelStage's
            kept = rows - np.searchsorted(np.unique(drops.get(task.index, ())), rows)
            out[by_id[lo:hi]] = pixel_units(read_pixels(run, task, ["pixel"])["pixel"][kept])
    return out


def cluster_groups(rows: int, nc: Any) -> int:
    """Groups of clusters (units of work) of ~`rows_per_group` rows each, a row counted in each cluster it
    is searched in (`assign`)."""
    return max(1, math.ceil(rows * nc.assign / nc.rows_per_group))


def copy_check(nc: Any) -> CopyCheck | None:
    """The stage's copy check (`neardup.copy_check`, a `NeardupConfig`), or None without it: `CopyCheck`'s
    own (128-px work images, 40-px edges, the second and third searches) at `neardup.copy_threshold`."""
    return CopyCheck(threshold=nc.copy_threshold) if nc.copy_check else None


def find_near_duplicates(state: Any, pool: Any, clusters_info: dict | None) -> dict:
    """Run steps 1-4 for a `hype score` run (`state`: its `RunContext`, `pool`: the deduplicated pool)."""
    nc, run = state.cfg.neardup, state.run
    started = time.perf_counter()
    if nc.pixel_partition:  # the pool's tars decoded once, in the executor: for the k-means and the split
        state.map(PixelStage(run, drops=pool.drops, **pool.kw), pool.tasks)
        state.check_failures("neardup", state.plan)
    model = state.timed("neardup", lambda: _model(state, pool, clusters_info))
    groups = cluster_groups(pool.unique, nc)
    check = copy_check(nc)
    split = SplitStage(
        run,
        groups=groups,
        model_digest=model.digest,
        reuse_clusters=model.reuse,
        drops=pool.drops,
        work_images=check is not None,
        pixels=nc.pixel_candidates > 0,
        assign=nc.assign,
        pixel_partition=model.pixel,
        **pool.kw,
    )
    split_stats = state.map(split, pool.tasks)
    state.check_failures("neardup", state.plan)
    stage = GroupStage(
        run,
        shards=pool.tasks,
        splits_digest=fingerprint([s["output"]["digest"] for s in split_stats]),
        threshold=nc.threshold,
        keeper=nc.keeper,
        seed=nc.seed,
        max_cluster=nc.max_cluster,
        pairs_per_block=nc.pairs_per_block,
        check=check,
        candidates=nc.candidates,
        pixel_candidates=nc.pixel_candidates,
        **pool.kw,
    )
    tasks = [group_task(g) for g in range(groups)]
    group_stats = state.map(stage, tasks)
    state.check_failures("neardup", state.plan)
    info = state.timed("neardup", lambda: _gather(run, stage, tasks, group_stats))
    source = "pixel k-means" if model.pixel else "c_IN k-means" if model.reuse else "own k-means"
    info |= {"k": model.k, "partition": "pixel" if model.pixel else "clip", "clusters_from": source,
             "cluster_groups": groups, "seconds": round(time.perf_counter() - started, 3)}  # fmt: skip
    return info


def _gather(run: RunDir, stage: GroupStage, tasks: list[ShardTask], stats: list[dict]) -> dict:
    """groups.parquet and edges.parquet from the groups of clusters, marker last: their members united by
    uid (a row searched in two clusters may be in two groups of clusters) and their forests merged, then
    the groups, keepers and each member's cosine to its keeper."""
    from hype.data.uids import arrow_to_pairs

    fp = fingerprint(
        {"groups": [s["output"]["digest"] for s in stats], "edges": [s["edges"]["digest"] for s in stats]}
    )
    done = completed(groups_marker(run), fp, groups_path(run))
    if done is not None:
        return done
    parts, ea, eb, es, sizes = [], [], [], [], []
    rows = 0
    for task in tasks:
        m = read_parquet(run.shard_output(stage.name, task), columns=list(_empty_members()))
        e = read_parquet(stage.edges_output(task))
        sizes.append(m.num_rows)
        if not m.num_rows:
            continue
        parts.append(m)
        ea.append(e.column("a").to_numpy() + rows)
        eb.append(e.column("b").to_numpy() + rows)
        es.append(e.column("sim").to_numpy())
        rows += m.num_rows
    table = pa.concat_tables(parts).combine_chunks() if parts else pa.table(_empty_members())
    hi, lo = arrow_to_pairs(table.column("uid"), f"{folder(run)}: uid")
    node, first = uid_nodes(hi, lo)
    a, b = (node[np.concatenate([np.zeros(0, np.int64), *e])] for e in (ea, eb))
    a, b, sim = merged_forest(len(first), a, b, np.concatenate([np.zeros(0, np.float32), *es]))
    table = table.take(pa.array(first))
    group = components(len(first), a, b) if len(first) else np.zeros(0, np.int64)
    hype, csim = table.column("hype").to_numpy(), table.column("centroid_sim").to_numpy()
    keep = keepers(group, stage.keeper, hi=hi[first], lo=lo[first], hype=hype, centroid_sim=csim,
                   seed=stage.seed)  # fmt: skip
    keeper_of = np.zeros(int(group.max(initial=-1)) + 1, np.int64)
    keeper_of[group[keep]] = np.flatnonzero(keep)
    sims = _keeper_sims(run, stage, tasks, np.cumsum([0, *sizes]), first, keeper_of[group])
    table = table.append_column("group", pa.array(group, pa.int64()))
    table = table.append_column("keeper", pa.array(keep)).append_column("sim_to_keeper", pa.array(sims))
    edges = pa.table({"a": pa.array(a, pa.int64()), "b": pa.array(b, pa.int64()), "sim": pa.array(sim)})
    edge_out = write_parquet(edges_path(run), edges)
    output = write_parquet(groups_path(run), table.select(list(GROUP_COLUMNS)))
    info = {
        "fingerprint": fp,
        "output": output,
        "edges": edge_out,
        "digest": fingerprint([output["digest"], edge_out["digest"]]),
        "threshold": stage.threshold,
        # None: every pair >= threshold joined (runs before the copy check, or neardup.copy_check=false)
        "copy_check": stage.copy_check_settings(),
        "keeper": stage.keeper,
        "seed": stage.seed,
        "groups": int(group.max(initial=-1)) + 1,
        "members": int(table.num_rows),
        "removed": int((~keep).sum()),
    }
    atomic_write_json(groups_marker(run), info)
    return info


def _keeper_sims(
    run: RunDir, stage: GroupStage, tasks: list, bounds: np.ndarray, rows: np.ndarray, keeper: np.ndarray
) -> np.ndarray:
    """Each member's cosine to its keeper (`pair_dots` of the unit features, as a cluster's forest): member
    i is row `rows[i]` of the groups of clusters' members files concatenated (`bounds`: where each begins),
    its keeper member `keeper[i]`. Two passes over the files: the keepers' features, then each member's
    against its keeper's; memory: the keepers' features (checked before they are allocated) and one file's."""
    heads = np.unique(keeper)
    task_of = np.searchsorted(bounds, rows, side="right") - 1

    def files(wanted: np.ndarray):  # (members among `wanted` in each file, their features)
        for t, task in enumerate(tasks):
            mine = wanted[task_of[wanted] == t]
            if len(mine):
                col = read_parquet(run.shard_output(stage.name, task), columns=["clip_img"]).column(0)
                yield mine, embed_format.fixed_list_to_numpy(col)[rows[mine] - bounds[t]]

    head_feats = np.zeros((0, 0), np.float32)
    for mine, f in files(heads):
        if not head_feats.size:
            _refuse_above_free(
                len(heads) * f.shape[1] * 4,
                f"the keepers' features of {len(heads):,} near-duplicate groups",
                "raise neardup.threshold or keep neardup.copy_check on (fewer, truer groups)",
            )
            head_feats = np.zeros((len(heads), f.shape[1]), np.float32)
        head_feats[np.searchsorted(heads, mine)] = f
    out = np.zeros(len(rows), np.float32)
    for mine, f in files(np.arange(len(rows))):
        out[mine] = pair_dots(f, head_feats, np.arange(len(mine)), np.searchsorted(heads, keeper[mine]))
    return out


@dataclass(frozen=True)
class StoredGroups:
    """What `hype select --filter dedup` reads back: members, the forest, the stage's settings."""

    hi: np.ndarray
    lo: np.ndarray
    hype: np.ndarray
    centroid_sim: np.ndarray
    a: np.ndarray
    b: np.ndarray
    sim: np.ndarray
    info: dict


def read_groups(run_root: AnyPath) -> StoredGroups:
    """The near-duplicate groups of a complete run (`NeardupError` naming the fix when it has none)."""
    from hype.data.uids import arrow_to_pairs

    run = RunDir(run_root)
    info = read_json(groups_marker(run))
    summary = read_json(run.summary) or {}
    recorded = (summary.get("neardup") or {}).get("digest")
    if info is None or recorded is None or info.get("digest") != recorded:
        raise NeardupError(
            f"{run.root}: no near-duplicate groups of this run's scores (neardup/groups.json missing or from "
            "another run); rerun `hype score` on it with neardup.enabled=true (a rerun reuses every finished "
            "stage)"
        )
    m = read_parquet(groups_path(run), columns=["uid", "hype", "centroid_sim"])
    e = read_parquet(edges_path(run))
    hi, lo = arrow_to_pairs(m.column("uid"), f"{groups_path(run)}: uid")
    return StoredGroups(
        hi,
        lo,
        m.column("hype").to_numpy(),
        m.column("centroid_sim").to_numpy(),
        e.column("a").to_numpy(),
        e.column("b").to_numpy(),
        e.column("sim").to_numpy(),
        info,
    )


def regroup(stored: StoredGroups, threshold: float, keeper: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(group per member, -1 where alone at `threshold`; keeper flag) from the stored forest: the groups
    of the pairs >= threshold, for any threshold >= the stored one (see `hype.scoring.neardup`)."""
    stored_t = float(stored.info["threshold"])
    if threshold < stored_t:
        raise NeardupError(
            f"dedup threshold {threshold} is below the {stored_t} the run's near-duplicate stage kept pairs "
            f"at; use threshold >= {stored_t}, or rerun `hype score` with neardup.threshold={threshold}"
        )
    n = len(stored.hi)
    if n == 0:  # a pool without near-duplicates
        return np.zeros(0, np.int64), np.zeros(0, bool)
    strong = stored.sim >= threshold
    label = components(n, stored.a[strong], stored.b[strong])
    group = np.where(np.bincount(label)[label] >= 2, label, -1)
    keep = keepers(
        group,
        keeper,
        hi=stored.hi,
        lo=stored.lo,
        hype=stored.hype,
        centroid_sim=stored.centroid_sim,
        seed=seed,
    )
    return group, keep


# --- the stage in a `hype score` run -----------------------------------------------------------------

# the split per shard: the embed, clusters and dedup markers and outputs; the centroids per worker
SPLIT_READS = ShardReads(markers=3, parquets=3, sets=1)
PIXEL_READS = ShardReads(markers=1, parquets=1)  # `PixelStage` per shard: the embed marker and keys


def _run(ctx: Any, settings: Any, inputs: dict) -> dict:
    """Near-duplicate groups and keepers, after merge: the `hype` keeper reads the scores."""
    try:
        return find_near_duplicates(ctx, inputs["dedup"], inputs["clusters"])
    except NeardupError as e:
        raise ScoreError(str(e)) from None


def neardup_requests(
    shards: int,
    groups: int,
    split_bytes: float,
    member_bytes: float,
    embed_bytes: float,
    workers: int,
    *,
    clusters: int,
    reuse: bool,
) -> dict[str, dict]:
    """Bucket requests of the stage, per part: `SplitStage` per shard (`split_bytes` each), `GroupStage`
    per group of clusters (each reads its row group of every shard: the shard's marker, then the row group
    when it has one: only `clusters` groups hold rows; `member_bytes` written per group), and the driver
    (its own k-means unless it `reuse`s c_IN's; groups.parquet and edges.parquet gathered, with the cosines
    to the keepers)."""
    s, g = shards, groups
    split = stage_requests(SPLIT_READS, s, split_bytes, embed_bytes, workers)
    if not reuse:  # no cluster column to read: the stage's own centroids assign each row instead
        split["get"] -= s * (2 * JSON_GET + parquet_get(embed_bytes))
    filled = max(1, min(g, clusters))  # a cluster's group is `cluster % groups`
    group = {
        "get": g * s * JSON_GET + filled * s * parquet_get(split_bytes / filled),
        "put": 3 * g,  # edges, members, marker
        "list": 1 if not reuse else lists(0),  # its own k-means wrote into neardup/ first
    }
    driver = add(
        MISSING,
        # both files of each group, its members' features twice (keepers', then each member's); groups.json
        {"get": 4 * g * parquet_get(member_bytes), "put": 3},
    )
    if not reuse:  # the k-means model: its marker looked for, the features sampled, centroids + marker
        driver = add(driver, MISSING, {"get": s * parquet_get(embed_bytes), "put": 2})
    return {"split": split, "groups": group, "driver": driver}


def plan(est: Any) -> None:
    """The pixel stage (with the pixel partition), the split and the groups of clusters, linear in samples:
    groups hold `rows_per_group` rows each, so their number grows with the pool; the driver's steps
    (k-means, gathering) are in the groups' time. Each pool tar is streamed once, by the pixel stage (the
    split with the copy check and `partition=clip`)."""
    nc = est.cfg.neardup
    groups = cluster_groups(est.N, nc)
    est.markers_of["neardup"] = groups
    reuse = bool(est.cl) and nc.reuse_clusters and not nc.pixel_partition
    k = est.k_r if reuse else nc.num_clusters or default_num_clusters(est.N)
    fit = est.fit("neardup")
    members = fit.out_bytes / max(1, est.probe.samples) * est.N / groups
    split = est.shard_bytes(SplitStage.name)
    req = neardup_requests(est.S, groups, split, members, est.embed_bytes, est.W, clusters=k, reuse=reuse)
    tars = {"pool_get": est.S * stream_get(est.tar_bytes)}  # each pool tar streamed once for its work images
    if nc.copy_check:  # a group reads its rows again (their work images)
        req["groups"] = add(req["groups"], {"get": req["groups"]["get"]})
    if nc.pixel_partition:  # `PixelStage` reads the tars; the split its output, the k-means sample its pixels
        # (a probe without the stage: the work images and descriptors uncompressed)
        pixels = est.shard_bytes(PixelStage.name) or (WORK_BYTES + PIXEL_BYTES) * est.N / max(1, est.S)
        stage = add(stage_requests(PIXEL_READS, est.S, pixels, est.embed_bytes, est.W), tars)
        req["split"] = add(req["split"], {"get": est.S * (2 * JSON_GET + parquet_get(pixels))})
        req["driver"] = add(
            req["driver"], {"get": est.S * parquet_get(pixels * PIXEL_BYTES / (WORK_BYTES + PIXEL_BYTES))}
        )
        if est.fit(PixelStage.name).shards:
            est.map(PixelStage.name, "neardup pixels", "samples", requests=stage)
        else:  # nothing of it timed: its requests still counted
            req["split"] = add(req["split"], stage)
    elif nc.copy_check:  # the split streams each pool tar
        req["split"] = add(req["split"], tars)
    est.map(SplitStage.name, "neardup split", "samples", requests=req["split"])
    est.map("neardup", "neardup groups", "samples", requests=add(req["groups"], req["driver"]))


def _summary(view: SummaryView) -> dict:
    info = view.outputs.get("neardup")
    if info is None:
        return {}
    # `hype select --filter dedup` checks its digest
    return {"neardup": {k: v for k, v in info.items() if k not in ("fingerprint", "output", "edges")}}


# after merge: the `hype` keeper reads the HYPE score
STAGE = StageSpec(
    "neardup",
    _run,
    lambda c: c.neardup,
    reads=("dedup", "clusters", "merge"),
    driver=True,
    when=lambda c: c.neardup.enabled,
    plan=plan,
    summary=_summary,
)
