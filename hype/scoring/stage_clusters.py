"""Clusters stage: c_IN, DataComp's image-based clustering filter as a per-sample term. DESIGN §2.4.

1. `load_class_features` (driver): the reference-class image features, from `--class-features` (an
   (N, d) float array in .npy, read with allow_pickle=False, or .safetensors) or from the `classes`
   stage outputs (`--class-images` embedded with the CLIP model).
2. `CaptionStage` (per shard): DataComp's caption filter of the image-based baseline (English, > 1
   fastText token, > 5 characters: `hype.text.language.datacomp_caption_ok`) -> `caption_ok` in
   `RUN_DIR/captions/<id>.parquet`, row-aligned with the embed output. Off: `clusters.caption_filter=false`.
3. `train_clusters` (driver): k-means (L2, `niter` iterations, `seed`; faiss, or torch on the run's
   device with `clusters.backend=torch`: `hype.scoring.clusters.torch_kmeans`) of the pool's CLIP image
   features into K centroids, trained, as DataComp trains, on the rows that pass the caption filter
   (all rows when it is off): a deterministic sample of at most `points_per_centroid`·K of them
   streamed from the embed outputs (the rows with the smallest uid hashes: independent of shard order
   and of the executor); the centroids some class image is nearest to (inner product) are the
   targets -> `RUN_DIR/clusters/centroids.npy`, `targets.npy`, marker `model.json`. With `--centroids`
   (`use_centroids`) the given centroids replace the training: a .npy, DataComp's released .pt, or a
   flat faiss index (`read_centroids_file`); the file's digest keys the marker.
4. `AssignStage` (per shard): each sample's nearest centroid (inner product, as DataComp assigns) and
   c_IN = 10 when the centroid is a target and the caption passes -> `RUN_DIR/clusters/<id>.parquet`.

A run that grows (`hype.scoring.grow`) keeps its centroids and targets: only steps 2 and 4 run, for the
new shards.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from hype.data.uids import uids_to_pairs
from hype.io import blake2b128_chunks, blake2b128_file, load_npy, local_file, read_parquet, storage
from hype.scoring import embed_format
from hype.scoring.clusters import (
    ASSIGN,
    backend_key,
    c_in,
    default_num_clusters,
    faiss_index_vectors,
    kmeans_centroids,
    nearest_centroid,
    placement,
    target_centroids,
)
from hype.scoring.config import ClustersConfig
from hype.scoring.context import RunContext, StageSpec, SummaryView
from hype.scoring.dedup import keep_mask
from hype.scoring.embed import ClassEmbedStage, ModelRef
from hype.scoring.errors import ScoreError
from hype.scoring.pricing import MISSING, ShardReads, add, lists, parquet_get
from hype.scoring.rundir import (
    RunDir,
    ShardTask,
    atomic_write_bytes,
    atomic_write_json,
    completed,
    fingerprint,
    make_tasks,
)
from hype.scoring.stage_embed import EmbedSettings
from hype.scoring.stagebase import ShardStage
from hype.scoring.summary import kmeans_note
from hype.scoring.topk import order_id, split_order_id

# Enters the captions' fingerprint: change it when the caption rule changes, so runs recompute it.
CAPTION_RULE = "datacomp-image-based: en, fasttext tokens > 1, chars > 5"
FAISS = {"backend": "faiss", "device": "cpu"}  # where k-means and assignments run by default


class ClassFeatureError(ValueError):
    """Reference-class features that cannot be used; names the file and the fix."""


class ClustersError(ValueError):
    """c_IN's clusters cannot be made from these inputs; the message says why and what to do."""


def read_class_features_file(path: str | Path, dim: int) -> np.ndarray:
    """(N, dim) float32 features from .npy (no pickles) or .safetensors (a `features` tensor, or the
    only tensor); a local path or a URL."""
    if not storage.is_file(path):
        raise ClassFeatureError(f"{path}: class features file not found")
    with local_file(path) as local:
        return _read_class_features(local, storage.location(path), dim)


def _read_class_features(local: Path, path: Any, dim: int) -> np.ndarray:
    try:
        if path.suffix == ".safetensors":
            from safetensors.numpy import load_file

            tensors = load_file(str(local))
            if "features" in tensors:
                arr = tensors["features"]
            elif len(tensors) == 1:
                arr = next(iter(tensors.values()))
            else:
                raise ClassFeatureError(
                    f"{path}: several tensors ({', '.join(sorted(tensors))}); name the features 'features'"
                )
        else:
            arr = np.load(local, allow_pickle=False)
    except ClassFeatureError:
        raise
    except Exception as e:  # noqa: BLE001 - numpy/safetensors raise several types
        raise ClassFeatureError(
            f"{path}: not a plain .npy array or safetensors file ({type(e).__name__}: {e}); save the "
            "features with np.save(path, array) (float, shape (N, d))"
        ) from None
    return _float_matrix(
        arr, path, dim, ClassFeatureError, "features", "a non-empty (N, d) float array, got shape {shape}"
    )


def read_centroids_file(path: str | Path, dim: int | None) -> np.ndarray:
    """(K, dim) float32 centroids from `--centroids`: a .npy (no pickles), DataComp's released
    `<scale>_centroids_l14.pt` (a numpy array saved with torch.save, read without running pickled code)
    or a flat faiss index; recognised by content, not by name. `dim` None: any width."""
    if not storage.is_file(path):
        raise ClustersError(f"{path}: centroids file not found")
    with local_file(path) as local:
        return _read_centroids(local, storage.location(path), dim)


def _read_centroids(local: Path, path: Any, dim: int | None) -> np.ndarray:
    from hype.io import NPY_ERRORS, PickledArrayError, read_pickled_array

    with open(local, "rb") as f:
        magic = f.read(6)
    try:
        if magic == b"\x93NUMPY":
            arr = np.load(local, allow_pickle=False)
        elif magic[:4] == b"PK\x03\x04":
            arr = read_pickled_array(local)
        else:
            arr = faiss_index_vectors(str(local))
    except (PickledArrayError, OSError, *NPY_ERRORS) as e:
        detail = str(e).removeprefix(f"{local}: ").removeprefix(f"{path}: ")
        raise ClustersError(
            f"{path}: cannot read centroids ({detail}); --centroids takes a (K, d) float .npy, DataComp's "
            "released <scale>_centroids_l14.pt, or a flat faiss index"
        ) from None
    return _float_matrix(
        arr,
        path,
        dim,
        ClustersError,
        "centroids",
        "a non-empty (K, d) float array of centroids, got {shape}, {dtype}",
        " (DataComp's centroids: OpenAI ViT-L/14, 768)",
    )


def _float_matrix(
    arr, path: Path, dim: int | None, error: type[Exception], what: str, expected: str, hint: str = ""
) -> np.ndarray:
    """`arr` as a contiguous float32 (rows, dim) matrix, or `error` naming the file and what is wrong."""
    if not isinstance(arr, np.ndarray) or arr.ndim != 2 or arr.dtype.kind != "f" or arr.shape[0] == 0:
        shape, dtype = getattr(arr, "shape", None), getattr(arr, "dtype", None)
        raise error(f"{path}: expected " + expected.format(shape=shape, dtype=dtype))
    if dim is not None and arr.shape[1] != dim:
        raise error(
            f"{path}: {what} have width {arr.shape[1]} but the CLIP features of the pool have {dim}; they "
            f"must come from the same CLIP model{hint}"
        )
    if not np.isfinite(arr).all():
        raise error(f"{path}: {what} contain NaN or inf")
    return np.ascontiguousarray(arr, dtype=np.float32)


def class_features_from_stage(run: RunDir, tasks: list[ShardTask]) -> np.ndarray:
    parts = [embed_format.read_embeddings(run.shard_output("classes", t), "clip_img") for t in tasks]
    parts = [p for p in parts if len(p)]
    if not parts:
        raise ClassFeatureError(
            "--class-images: no image could be embedded (see RUN_DIR/classes/*_stats.json)"
        )
    return np.concatenate(parts)


def train_clusters(
    run: RunDir,
    tasks: list[ShardTask],
    drops: dict[int, np.ndarray],
    class_features: np.ndarray,
    *,
    caption_filter: bool,
    k: int,
    niter: int,
    seed: int,
    max_points: int,
    gpu: bool,
    fp: str,
    warn: Callable[[str], None],
    where: dict | None = None,
) -> dict:
    """k-means on a deterministic sample of the pool's (caption-filtered) CLIP features, then the target
    centroids."""
    done = completed(run.clusters_marker, fp)
    if done is not None and run.centroids.is_file() and run.targets.is_file():
        return done
    started = time.perf_counter()
    sample, pool, eligible = sample_pool_features(run, tasks, drops, max_points, caption_filter)
    if eligible == 0:
        raise ClustersError(
            f"none of the {pool} samples passes DataComp's caption filter: nothing to train k-means on; "
            "set clusters.caption_filter=false or pass released centroids with --centroids"
            if caption_filter and pool
            else "no sample was embedded: nothing to cluster"
        )
    if k > len(sample):
        warn(f"{len(sample)} training points for k-means: number of clusters reduced from {k}")
        k = len(sample)
    where = where or FAISS
    centroids = kmeans_centroids(sample, k, niter=niter, seed=seed, gpu=gpu, **where)
    info = _save_model(run, centroids, class_features, fp, where)
    info |= {
        "train_points": len(sample),
        "train_rows": "caption-filtered" if caption_filter else "all",
        "train_eligible": eligible,
        "pool": pool,
        "niter": niter,
        "seed": seed,
        **(where if where["backend"] != "faiss" else {}),  # faiss runs' markers as they were
        "seconds": round(time.perf_counter() - started, 4),
    }
    atomic_write_json(run.clusters_marker, info)
    return info


def sample_pool_features(
    run: RunDir, tasks: list[ShardTask], drops: dict[int, np.ndarray], max_points: int, caption_filter: bool
) -> tuple[np.ndarray, int, int]:
    """(a deterministic sample of at most `max_points` CLIP image features of the pool: the rows with the
    smallest uid hashes, ties by pool order, in that order, independent of shard order; pool rows;
    eligible rows), on the caption-filtered rows when `caption_filter`.

    Two passes over the embed outputs: the uids pick the rows, then only their features are read into an
    array allocated once at its final size, checked against this machine's memory first (at DataComp's
    K = 100,000 the sample is up to 25.6M rows: 79 GB of 768-d features)."""
    chosen, pool, eligible = sample_pool_rows(run, tasks, drops, max_points, caption_filter)
    if not eligible:
        return np.zeros((0, 0), np.float32), pool, eligible
    by_id = np.argsort(chosen, kind="stable")  # its rows grouped by shard, in row order
    shard_of, row_of = split_order_id(chosen[by_id])
    feats: np.ndarray | None = None
    for task in tasks:
        lo, hi = np.searchsorted(shard_of, [task.index, task.index + 1])
        if lo == hi:
            continue
        col = read_parquet(run.shard_output("embed", task), columns=["clip_img"]).column("clip_img")
        block = embed_format.fixed_list_to_numpy(col.take(pa.array(row_of[lo:hi])))
        if feats is None:
            feats = _allocate_sample(len(chosen), block.shape[1])
        feats[by_id[lo:hi]] = block
    return feats, pool, eligible


def sample_pool_rows(
    run: RunDir, tasks: list[ShardTask], drops: dict[int, np.ndarray], max_points: int, caption_filter: bool
) -> tuple[np.ndarray, int, int]:
    """(the order ids (`order_id`) of `sample_pool_features`' rows, in the sample's order; pool rows; eligible
    rows): the rows with the smallest uid hashes, from one pass over the embed outputs' uids."""
    keys, ids, pool, eligible = [], [], 0, 0
    for task in tasks:
        t = read_parquet(run.shard_output("embed", task), columns=["uid"])
        keep = keep_mask(t.num_rows, drops.get(task.index))
        pool += int(keep.sum())
        if caption_filter:
            keep &= read_caption_ok(run, task, t.num_rows)
        rows = np.nonzero(keep)[0]
        eligible += len(rows)
        if len(rows):
            keys.append(uids_to_pairs(t.column("uid").take(pa.array(rows)).to_pylist())[0])
            ids.append(order_id(task.index, rows))
    if not eligible:
        return np.zeros(0, np.int64), pool, eligible
    key, oid = np.concatenate(keys), np.concatenate(ids)
    return oid[np.lexsort((oid, key))[:max_points]], pool, eligible  # the sample, in its order


def _allocate_sample(rows: int, dim: int) -> np.ndarray:
    """The k-means sample's array, refused before it is allocated when it would not fit in memory."""
    need = rows * dim * 4
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: nothing to check against
        total = None
    if total is not None and need > 0.75 * total:
        fits = int(0.5 * total // (dim * 4))
        raise ClustersError(
            f"the k-means sample is {rows:,} rows of {dim} floats ({need / 2**30:.1f} GiB) and this machine "
            f"has {total / 2**30:.1f} GiB of memory: set clusters.max_train_points={fits} (or fewer "
            "clusters), or pass released centroids with --centroids"
        )
    return np.empty((rows, dim), np.float32)


def use_centroids(
    run: RunDir,
    path: str,
    dim: int,
    class_features: np.ndarray,
    fp: str,
    where: dict | None = None,
) -> dict:
    """Given centroids (`--centroids`) instead of k-means: read, checked, and their target centroids."""
    done = completed(run.clusters_marker, fp)
    if done is not None and run.centroids.is_file() and run.targets.is_file():
        return done
    started = time.perf_counter()
    centroids = read_centroids_file(path, dim)
    info = _save_model(run, centroids, class_features, fp, where or FAISS)
    info |= {"centroids": str(path), "seconds": round(time.perf_counter() - started, 4)}
    atomic_write_json(run.clusters_marker, info)
    return info


def _save_model(run: RunDir, centroids: np.ndarray, class_features: np.ndarray, fp: str, where: dict) -> dict:
    """The target centroids of the class features (assigned where `where` says: backend, device);
    centroids.npy and targets.npy written (not the marker)."""
    targets = target_centroids(class_features, centroids, **where).astype(np.int64)
    for path, arr in ((run.centroids, centroids), (run.targets, targets)):
        buf = io.BytesIO()
        np.save(buf, arr, allow_pickle=False)
        atomic_write_bytes(path, buf.getvalue())
    return {
        "fingerprint": fp,
        "digest": _digest_arrays(centroids, targets),
        "k": int(centroids.shape[0]),
        "class_images": int(class_features.shape[0]),
        "targets": int(len(targets)),
    }


def _digest_arrays(*arrays: np.ndarray) -> str:
    return blake2b128_chunks(np.ascontiguousarray(a).tobytes() for a in arrays)


class CaptionStage(ShardStage):
    """Per shard: DataComp's caption filter of the image-based baseline, row-aligned with the embed output."""

    name = "captions"

    def fingerprint(self, task: ShardTask) -> str:
        return fingerprint(
            {"stage": self.name, "embed": self.upstream_digest("embed", task), "rule": CAPTION_RULE}
        )

    def run(self, task: ShardTask) -> dict:
        from hype.text.language import datacomp_caption_ok

        started = time.perf_counter()
        fp = self.fingerprint(task)
        self._debug_hook(task)
        texts = read_parquet(self.run_dir.shard_output("embed", task), columns=["text"]).column(0).to_pylist()
        ok = datacomp_caption_ok(texts) if texts else np.zeros(0, bool)
        table = pa.table({"caption_ok": pa.array(ok, pa.bool_())})
        return self._finish(
            task, fp, table, started, counts={"samples": table.num_rows, "caption_ok": int(ok.sum())}
        )


def read_caption_ok(run: RunDir, task: ShardTask, rows: int) -> np.ndarray:
    """The shard's `captions` output as a bool mask, checked against the embed output's row count."""
    ok = read_parquet(run.shard_output("captions", task), columns=["caption_ok"]).column(0)
    if len(ok) != rows:
        raise RuntimeError(f"{task.shard_id}: stage outputs are not row-aligned; rerun to recompute them")
    return ok.to_numpy(zero_copy_only=False).astype(bool)


class AssignStage(ShardStage):
    """Per shard: nearest centroid, and c_IN where the caption passes (the `captions` output)."""

    name = "clusters"

    def __init__(self, run: RunDir, *, model_digest: str, caption_filter: bool, backend: str = "faiss", **kw):
        super().__init__(run, **kw)
        self.model_digest = model_digest
        self.caption_filter = caption_filter
        self.backend = backend  # torch: on the stage's device

    def fingerprint(self, task: ShardTask) -> str:
        return fingerprint(
            {
                "stage": self.name,
                "embed": self.upstream_digest("embed", task),
                "model": self.model_digest,
                "captions": self.upstream_digest("captions", task) if self.caption_filter else None,
                # both backends assign the same (exact sums, ties to the lower index): kept for old runs
                **backend_key(self.backend),
                **ASSIGN,
            }
        )

    def setup(self) -> None:
        super().setup()
        self._centroids = load_npy(self.run_dir.centroids)
        self._targets = load_npy(self.run_dir.targets)

    def run(self, task: ShardTask) -> dict:
        started = time.perf_counter()
        fp = self.fingerprint(task)
        self._debug_hook(task)
        t = read_parquet(self.run_dir.shard_output("embed", task), columns=["clip_img"])
        feats = embed_format.fixed_list_to_numpy(t.column("clip_img"))
        where = placement(self.backend, self.device)
        cluster = nearest_centroid(feats, self._centroids, **where) if len(feats) else np.zeros(0, np.int64)
        if self.caption_filter:
            ok = read_caption_ok(self.run_dir, task, t.num_rows)
        else:
            ok = np.ones(t.num_rows, dtype=bool)
        flag = c_in(cluster, self._targets, ok)
        table = pa.table(
            {
                "cluster": pa.array(cluster, pa.int32()),
                "caption_ok": pa.array(ok, pa.bool_()),
                "c_in": pa.array(flag, pa.float32()),
            }
        )
        return self._finish(
            task,
            fp,
            table,
            started,
            counts={
                "samples": table.num_rows,
                "c_in": int((flag > 0).sum()),
                "in_target_cluster": int(np.isin(cluster, self._targets).sum()),
                "caption_ok": int(ok.sum()),
            },
        )


# --- the stages in a `hype score` run: classes, captions, clusters -------------------------------------

CAPTION_READS = ShardReads(markers=1, parquets=1)  # the embed output's marker and its texts
# the embed and captions markers, their outputs; the k-means model and targets per worker
ASSIGN_READS = ShardReads(markers=2, parquets=2, sets=2, folder_written=True)


def has_classes(cc: ClustersConfig) -> bool:
    return cc.class_features is not None or cc.class_images is not None


def _c_in_on(ctx: RunContext) -> bool:
    """Whether the run has c_IN: the frozen clusters of a run that grows, else a class set given."""
    if ctx.frozen is not None:
        return ctx.frozen.clusters is not None
    return has_classes(ctx.cfg.clusters)


def check(ctx: RunContext) -> None:
    """Before the long stages: a grow's --centroids must be its frozen ones, and --centroids is read, so
    that a wrong file fails in seconds, not hours."""
    path = ctx.cfg.clusters.centroids
    if path is None:
        return
    try:
        centroids = read_centroids_file(path, None)
    except ClustersError as e:
        raise ScoreError(f"--centroids: {e}") from None
    if ctx.frozen is not None:
        from hype.scoring.grow import check_centroids

        check_centroids(ctx.frozen, ctx.run, path, centroids)


def begin(ctx: RunContext) -> None:
    """A class set given to a grow must give the frozen c_IN targets with the frozen centroids (class
    images: embedded now, or their outputs reused, before the pool changes)."""
    from hype.scoring.grow import check_targets

    cc, frozen, run = ctx.cfg.clusters, ctx.frozen, ctx.run
    if frozen is None or not has_classes(cc):
        return
    source = (
        f"--class-features {cc.class_features}" if cc.class_features else f"--class-images {cc.class_images}"
    )
    targets = None
    if frozen.clusters is not None:
        centroids = load_npy(run.centroids)
        embed_kw = EmbedSettings.of(ctx.cfg).kwargs()
        feats, _ = _class_features(ctx, ctx.model("clip"), centroids.shape[1], embed_kw, ctx.stage_kwargs())
        targets = target_centroids(feats, centroids).astype("int64")
    check_targets(frozen, run, targets, source)


def classes(ctx: RunContext, cc: ClustersConfig, inputs: dict) -> tuple[Any, str] | None:
    """(class feature matrix, its digest) of the class set given (a run that grows checked its own
    against the frozen targets before the pool changed: `begin`)."""
    if ctx.frozen is not None:
        return None
    pool = inputs["embed"]
    return _class_features(ctx, pool.clip, pool.dims["clip"], pool.embed_kw, pool.kw)


def captions(ctx: RunContext, cc: ClustersConfig, inputs: dict) -> str | None:
    """DataComp's caption filter of every shard (when the run has c_IN); the digest of its outputs."""
    if not _c_in_on(ctx):
        return None
    pool = inputs["embed"]
    stats = ctx.map(CaptionStage(ctx.run, **pool.kw), pool.tasks)
    ctx.check_failures("captions", ctx.plan)
    return fingerprint([s["output"]["digest"] for s in stats])


def clusters(ctx: RunContext, cc: ClustersConfig, inputs: dict) -> dict | None:
    """c_IN: the k-means model (frozen, --centroids, or trained on the pool's CLIP image features), then
    each sample's cluster."""
    pool = inputs["dedup"]
    if ctx.frozen is not None:  # a class set given was checked against it by `check`
        model = ctx.frozen.clusters
    elif not has_classes(cc):
        ctx.warn(
            "no --class-features or --class-images: c_IN is 0 for every sample (the ImageNet-cluster term "
            "is off)"
        )
        model = None
    elif cc.centroids is not None:
        model = _given_centroids(ctx, pool, *inputs["classes"])
    else:
        model = _train_clusters(ctx, pool, *inputs["classes"], inputs["captions"])
    if model is None:
        return None
    assign = AssignStage(
        ctx.run,
        model_digest=model["digest"],
        caption_filter=cc.caption_filter,
        backend=cc.backend,
        **pool.kw,
    )
    assign_stats = ctx.map(assign, pool.tasks)
    ctx.check_failures("clusters", ctx.plan)
    return model | {
        "caption_filter": cc.caption_filter,
        "caption_ok": sum(int(s["counts"]["caption_ok"]) for s in assign_stats),
        "class_source": cc.class_features or cc.class_images,
    }


def _class_features(
    ctx: RunContext, clip: ModelRef | None, width: int, embed_kw: dict, kw: dict
) -> tuple[Any, str]:
    """(class feature matrix, its digest) from --class-features, or embedded from --class-images with
    `clip` (features of `width`)."""
    cc = ctx.cfg.clusters
    try:
        if cc.class_features is not None:
            return read_class_features_file(cc.class_features, width), blake2b128_file(cc.class_features)
        from hype.data.shards import ShardError, expand_shards

        try:
            class_tasks = make_tasks(expand_shards(cc.class_images).paths)
        except ShardError as e:
            raise ScoreError(f"--class-images: {e}") from None
        stage = ClassEmbedStage(ctx.run, clip=clip, **embed_kw, **kw)
        class_stats = ctx.map(stage, class_tasks)
        ctx.check_failures("classes", ctx.plan)
        feats = class_features_from_stage(ctx.run, class_tasks)
        if feats.shape[1] != width:
            raise ClassFeatureError(
                f"--class-images: features of width {feats.shape[1]}, the pool's CLIP features have "
                f"{width}; with --metadata, pass --class-features from the metadata's CLIP model"
            )
        return feats, fingerprint([s["output"]["digest"] for s in class_stats])
    except ClassFeatureError as e:
        raise ScoreError(str(e)) from None


def _given_centroids(ctx: RunContext, pool: Any, feats, class_digest: str) -> dict:
    """--centroids instead of k-means; keyed on the file's digest, so a changed file is noticed."""
    cc = ctx.cfg.clusters
    if cc.num_clusters is not None:
        ctx.warn(f"--num-clusters {cc.num_clusters} ignored: --centroids gives the clusters")
    try:
        # The path too, so the summary names the file given now (the model is cheap to redo).
        fp = fingerprint(
            {"centroids": blake2b128_file(cc.centroids), "path": cc.centroids, "classes": class_digest}
        )
        return ctx.timed(
            "clusters",
            lambda: use_centroids(ctx.run, cc.centroids, pool.dims["clip"], feats, fp, _where(ctx)),
        )
    except (ClustersError, OSError) as e:
        raise ScoreError(f"--centroids: {e}") from None


def _train_clusters(ctx: RunContext, pool: Any, feats, class_digest: str, caption_digest: str | None) -> dict:
    """k-means of the pool's CLIP image features, on the caption-filtered rows when `caption_digest`
    (resumable: keyed on everything it depends on)."""
    cc = ctx.cfg.clusters
    k = cc.num_clusters or default_num_clusters(pool.unique)
    max_points = cc.points_per_centroid * k
    if cc.max_train_points is not None:
        max_points = min(max_points, cc.max_train_points)
    fp = fingerprint(
        {
            "pool": pool.fingerprint,
            "dups": pool.dups["digest"],
            "classes": class_digest,
            "captions": caption_digest,
            "k": k,
            "niter": cc.niter,
            "seed": cc.seed,
            "max_points": max_points,
            "gpu": cc.gpu,
            **backend_key(cc.backend),
            **ASSIGN,  # the targets
        }
    )
    try:
        return ctx.timed(
            "clusters",
            lambda: train_clusters(
                ctx.run,
                pool.tasks,
                pool.drops,
                feats,
                caption_filter=caption_digest is not None,
                k=k,
                niter=cc.niter,
                seed=cc.seed,
                max_points=max_points,
                gpu=cc.gpu,
                fp=fp,
                warn=ctx.warn,
                where=_where(ctx),
            ),
        )
    except ClustersError as e:
        raise ScoreError(str(e)) from None


def _where(ctx: RunContext) -> dict:
    """Where the driver's k-means and target assignment run (`clusters.backend`, the run's device)."""
    return placement(ctx.cfg.clusters.backend, ctx.cfg.device)


KMEANS_CALIBRATION_POINTS = 20_000  # the most points k-means is timed on in the probe


def kmeans_size(cfg: Any, samples: int, eligible: float) -> tuple[int, int]:
    """(K, training points) of a run's k-means over `samples`, as `_train_clusters` sizes them (for
    `hype plan`); `eligible`: the fraction of rows the caption filter passes."""
    cc = cfg.clusters
    k = int(cc.num_clusters or default_num_clusters(samples))
    points = min(cc.points_per_centroid * k, cc.max_train_points or 1 << 62, int(samples * eligible))
    return k, max(1, points)


def _time_kmeans(cfg: Any, samples: int, marker: dict, centroids_file: Path) -> dict | None:
    """The run's k-means (faiss, or torch on the run's device) timed on random points of the run's width at
    the run's K and points (at most KMEANS_CALIBRATION_POINTS points, K cut in proportion): the probe's own
    k-means is too small to time."""
    if not marker.get("train_points") or not centroids_file.exists() or cfg.clusters.centroids:
        return None
    eligible = float(marker.get("train_eligible") or 1) / max(1, int(marker.get("pool") or 1))
    k_r, pts_r = kmeans_size(cfg, samples, eligible)
    points = min(pts_r, KMEANS_CALIBRATION_POINTS)
    k = max(1, min(k_r, round(k_r * points / pts_r), points // 39))
    dim = int(np.load(centroids_file, mmap_mode="r").shape[1])
    x = np.random.default_rng(0).standard_normal((points, dim), dtype=np.float32)
    t0 = time.perf_counter()
    cc = cfg.clusters
    kmeans_centroids(x, k, niter=cc.niter, seed=cc.seed, gpu=cc.gpu, **placement(cc.backend, cfg.device))
    return {"points": points, "k": k, "seconds": time.perf_counter() - t0}


def calibrate(cal: Any) -> None:
    marker = cal.probe.markers["clusters"]
    cal.probe.kmeans = _time_kmeans(cal.cfg, cal.samples, marker, cal.run / "clusters" / "centroids.npy")


def plan_classes(est: Any) -> None:
    """The class images: fixed (they do not grow with the pool); the images listed, the driver then reads
    every shard's features; the CLIP model fetched by each Ray worker."""
    fit = est.fit("classes")
    est.markers_of["classes"] = fit.shards
    features = {"get": fit.shards * parquet_get(fit.out_bytes / max(1, fit.shards)), "pool_list": lists(0)}
    more = add(features, est.model_copies(1, fit.shards))
    est.map(
        "classes",
        "classes",
        "fixed",
        reads=ShardReads(tar=True),
        in_bytes=0,
        fixed_only=True,
        more_requests=more,
    )


def plan_captions(est: Any) -> None:
    est.map("captions", "captions", "samples", reads=CAPTION_READS)


def plan_clusters(est: Any) -> None:
    """The run's K and training points (the plan's scaling), then k-means (K x training points: timed apart
    at up to the run's size, the rest scaled) and each sample's cluster (samples x K)."""
    cfg, n = est.cfg, max(1, est.probe.samples)
    est.cl = est.probe.markers["clusters"]
    est.k_p = int(est.cl.get("k") or 1)
    eligible = float(est.cl.get("train_eligible") or n) / max(1, int(est.cl.get("pool") or n))
    est.k_r, est.pts_r = kmeans_size(cfg, est.N, eligible)
    est.k_r = est.k_p if cfg.clusters.centroids else est.k_r
    est.pts_p = int(est.cl.get("train_points") or 1)
    if not est.cl:
        return
    train_s = float(est.cl.get("seconds", 0.0))
    km = est.probe.kmeans
    if km:  # timed at (up to) the run's size; the rest scales with K x points
        k_scale = km["seconds"] * (est.k_r * est.pts_r) / max(1, km["k"] * km["points"]) / max(train_s, 1e-9)
    else:
        k_scale = 1.0 if est.cfg.clusters.centroids else (est.k_r * est.pts_r) / max(1, est.k_p * est.pts_p)
    # its marker looked for; the features and caption flags of each shard; 3 files written
    shard = parquet_get(est.embed_bytes) + parquet_get(est.shard_bytes("captions"))
    req = add(MISSING, {"get": est.S * shard, "put": 3})
    centroids = est.probe.card_files.get("centroids.npy", 0) * est.k_r / max(1, est.k_p)
    est.driver("clusters train", train_s, k_scale, "K x points", centroids, req, run_stage="clusters")
    k = est.k_r / max(1, est.k_p)
    est.map("clusters", "clusters assign", "samples x K", k, reads=ASSIGN_READS, driver_s=train_s)


def summary(view: SummaryView) -> dict:
    """summary.json's `c_in`: the clusters, targets and k-means, and the samples the merge gave c_IN."""
    model, merged = view.outputs.get("clusters"), view.outputs.get("merge")
    if model is None:
        return {
            "c_in": {
                "enabled": False,
                "note": "no --class-features/--class-images: c_in = 0 for every sample",
            }
        }
    return {
        "c_in": {
            "enabled": True,
            "k": model.get("k"),
            "targets": model.get("targets"),
            "class_images": model.get("class_images"),
            "class_source": model.get("class_source"),
            "train_points": model.get("train_points"),
            "kmeans": kmeans_note(model),
            "centroids": model.get("centroids"),
            "caption_filter": model.get("caption_filter"),
            "samples_c_in": sum(int(s["counts"].get("c_in", 0)) for s in merged or []),
        }
    }


# CLIP features of --class-images, or --class-features read
CLASSES = StageSpec(
    "classes",
    classes,
    lambda c: c.clusters,
    reads=("embed",),
    driver=True,
    when=lambda c: has_classes(c.clusters),
    plan=plan_classes,
)
CAPTIONS = StageSpec(
    "captions",
    captions,
    lambda c: c.clusters,
    reads=("embed",),
    when=lambda c: c.clusters.caption_filter,
    plan=plan_captions,
)
# k-means (driver) or --centroids, then each sample's cluster and c_IN (per shard)
CLUSTERS = StageSpec(
    "clusters",
    clusters,
    lambda c: c.clusters,
    reads=("embed", "dedup", "classes", "captions"),
    driver=True,
    check=check,
    begin=begin,
    plan=plan_clusters,
    summary=summary,
    markers=(("clusters", "clusters/model.json"),),
    calibrate=calibrate,
)
