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
from hype.io import blake2b128_chunks, load_npy, local_file, read_parquet, storage
from hype.scoring import embed_format
from hype.scoring.clusters import (
    ASSIGN,
    backend_key,
    c_in,
    faiss_index_vectors,
    kmeans_centroids,
    nearest_centroid,
    placement,
    target_centroids,
)
from hype.scoring.dedup import keep_mask
from hype.scoring.rundir import (
    RunDir,
    ShardTask,
    atomic_write_bytes,
    atomic_write_json,
    completed,
    fingerprint,
)
from hype.scoring.stagebase import ShardStage
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
        return np.zeros((0, 0), np.float32), pool, eligible
    key, oid = np.concatenate(keys), np.concatenate(ids)
    chosen = oid[np.lexsort((oid, key))[:max_points]]  # the sample, in its order
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
