"""c_IN: DataComp's image-based clustering filter as a per-sample flag. DESIGN §2.4.

k-means (faiss, L2, 20 iterations, seed 0) of the pool's CLIP image embeddings into K centroids; every
image of a labelled reference set (ImageNet-1k train in DataComp) is assigned to its nearest centroid by
inner product, and those centroids are the targets; a pool sample gets c_IN = 10 when its own nearest
centroid (inner product, as DataComp assigns) is a target and it passes DataComp's caption filter.
"""

from __future__ import annotations

import numpy as np

C_IN_VALUE = 10.0
DATACOMP_K = 100_000
DATACOMP_POOL_PER_CENTROID = 128  # 12.8M-sample small pool / 100,000 centroids
ASSIGN_BATCH = 1 << 16


def default_num_clusters(pool_size: int) -> int:
    """DataComp's 100,000 centroids, scaled down to keep its ~128 pool samples per centroid."""
    return int(min(DATACOMP_K, max(2, round(pool_size / DATACOMP_POOL_PER_CENTROID))))


def kmeans_centroids(
    features: np.ndarray, k: int, *, niter: int = 20, seed: int = 0, gpu: bool = False
) -> np.ndarray:
    """L2 k-means centroids (k, d). faiss subsamples to 256 points per centroid with the same seed."""
    import faiss

    x = _as_f32(features)
    if k < 1 or k > x.shape[0]:
        raise ValueError(f"number of clusters must be in [1, {x.shape[0]}] for {x.shape[0]} points, got {k}")
    km = faiss.Kmeans(x.shape[1], k, niter=niter, seed=seed, gpu=gpu, verbose=False)
    km.train(x)
    return np.ascontiguousarray(km.centroids, dtype=np.float32)


def nearest_centroid(features: np.ndarray, centroids: np.ndarray, batch: int = ASSIGN_BATCH) -> np.ndarray:
    """Index of the centroid with the largest inner product, for every row (batched, exact)."""
    import faiss

    index = faiss.IndexFlatIP(centroids.shape[1])
    index.add(_as_f32(centroids))
    x = _as_f32(features)
    out = np.empty(x.shape[0], dtype=np.int64)
    for start in range(0, x.shape[0], batch):
        _, ids = index.search(x[start : start + batch], 1)
        out[start : start + batch] = ids[:, 0]
    return out


def target_centroids(reference_features: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """Sorted unique centroids that some reference image is nearest to."""
    return np.unique(nearest_centroid(reference_features, centroids))


def faiss_index_vectors(path: str) -> np.ndarray:
    """The vectors stored in a flat faiss index file (`faiss.write_index` of IndexFlat/L2/IP, e.g. a
    `faiss.Kmeans(...).index`). Raises ValueError for other index types or files."""
    import faiss

    try:
        index = faiss.read_index(str(path))
    except RuntimeError as e:
        # faiss prefixes its reason with the C++ function and source line: keep the reason
        raise ValueError(
            f"not a faiss index: {str(e).strip().splitlines()[-1].rsplit(': ', 1)[-1]}"
        ) from None
    if not isinstance(index, faiss.IndexFlat):
        raise ValueError(
            f"a faiss {type(index).__name__}: only flat indexes (IndexFlat, IndexFlatL2, IndexFlatIP) hold "
            "the centroids exactly; write the centroids into a faiss.IndexFlatL2 or save them with np.save"
        )
    return np.asarray(index.reconstruct_n(0, index.ntotal))


def c_in(assignments: np.ndarray, targets: np.ndarray, caption_ok: np.ndarray | None = None) -> np.ndarray:
    """10.0 where the sample's centroid is a target (and its caption passes), else 0.0."""
    hit = np.isin(assignments, targets)
    if caption_ok is not None:
        hit &= np.asarray(caption_ok, dtype=bool)
    return np.where(hit, C_IN_VALUE, 0.0).astype(np.float32)


def _as_f32(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    if x.ndim != 2:
        raise ValueError(f"expected a (N, d) array of features, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("features contain NaN or inf")
    return x
