"""c_IN: DataComp's image-based clustering filter as a per-sample flag. DESIGN §2.4.

k-means (faiss, L2, 20 iterations, seed 0) of the pool's CLIP image embeddings into K centroids; every
image of a labelled reference set (ImageNet-1k train in DataComp) is assigned to its nearest centroid by
inner product, and those centroids are the targets; a pool sample gets c_IN = 10 when its own nearest
centroid (inner product, as DataComp assigns) is a target and it passes DataComp's caption filter.
"""

from __future__ import annotations

import contextlib

import numpy as np

C_IN_VALUE = 10.0
DATACOMP_K = 100_000
DATACOMP_POOL_PER_CENTROID = 128  # 12.8M-sample small pool / 100,000 centroids
ASSIGN_BATCH = 1 << 16
# k-means and assignment: faiss (CPU; faiss-gpu with `gpu`), or torch on a device (`clusters.backend`).
BACKENDS = ("faiss", "torch")
FAISS_MAX_POINTS_PER_CENTROID = 256  # faiss.Kmeans's default subsample, kept by the torch backend
SPLIT_EPS = 1.0 / 1024  # faiss's perturbation when an empty cluster takes half of a large one
TORCH_BLOCK_BYTES = 1 << 30  # the (points, K) fp32 distance block of one torch assignment step


def default_num_clusters(pool_size: int) -> int:
    """DataComp's 100,000 centroids, scaled down to keep its ~128 pool samples per centroid."""
    return int(min(DATACOMP_K, max(2, round(pool_size / DATACOMP_POOL_PER_CENTROID))))


def placement(backend: str, device: str) -> dict:
    """Where k-means and assignments run, as `kmeans_centroids`/`nearest_centroid` keywords: faiss on the
    CPU; torch on `device` as this machine resolves it (`auto`: cuda when there is one)."""
    if backend != "torch":
        return {"backend": backend, "device": "cpu"}
    from hype.scoring.stagebase import resolve_device

    return {"backend": backend, "device": resolve_device(device)}


def backend_key(backend: str) -> dict:
    """The backend as a fingerprint or marker entry: none for faiss, so faiss runs keep the keys they had."""
    return {} if backend == "faiss" else {"backend": backend}


def kmeans_centroids(
    features: np.ndarray,
    k: int,
    *,
    niter: int = 20,
    seed: int = 0,
    gpu: bool = False,
    backend: str = "faiss",
    device: str = "cpu",
) -> np.ndarray:
    """L2 k-means centroids (k, d): faiss.Kmeans (`gpu`: faiss-gpu), or `torch_kmeans` on `device`. Both
    subsample to 256 points per centroid with `seed`; they draw differently, so their centroids differ."""
    x = _as_f32(features)
    if k < 1 or k > x.shape[0]:
        raise ValueError(f"number of clusters must be in [1, {x.shape[0]}] for {x.shape[0]} points, got {k}")
    if backend == "torch":
        return _lloyd(x, k, niter, seed, device)
    import faiss

    km = faiss.Kmeans(x.shape[1], k, niter=niter, seed=seed, gpu=gpu, verbose=False)
    km.train(x)
    return np.ascontiguousarray(km.centroids, dtype=np.float32)


def nearest_centroid(
    features: np.ndarray,
    centroids: np.ndarray,
    batch: int = ASSIGN_BATCH,
    *,
    backend: str = "faiss",
    device: str = "cpu",
) -> np.ndarray:
    """Index of the centroid with the largest inner product, for every row (batched, exact in fp32; the
    two backends differ only where two products tie to fp32 rounding)."""
    x, c = _as_f32(features), _as_f32(centroids)
    if backend == "torch":
        return _torch_nearest(x, c, device, l2=False)
    import faiss

    index = faiss.IndexFlatIP(c.shape[1])
    index.add(c)
    out = np.empty(x.shape[0], dtype=np.int64)
    for start in range(0, x.shape[0], batch):
        _, ids = index.search(x[start : start + batch], 1)
        out[start : start + batch] = ids[:, 0]
    return out


def torch_kmeans(x: np.ndarray, k: int, *, niter: int = 20, seed: int = 0, device: str = "cpu") -> np.ndarray:
    """Lloyd's k-means in torch on `device`: on a GPU, K = 100,000 over DataComp small's pool takes minutes
    where faiss-cpu takes hours (bench/gpu_suite.py `kmeans`). faiss.Kmeans's algorithm, not its random
    draws: at most 256 points per centroid and the k initial centroids are drawn with `seed`; each
    iteration assigns every point to its nearest centroid (L2, fp32 products, TF32 off) and moves each
    centroid to the mean of its points (sums in float64, accumulated in a fixed order: the same input and
    seed give the same bytes); an empty cluster takes half of the largest one (faiss draws the one to split,
    with odds by size; the split itself is faiss's). Points stream from host memory in blocks: the device
    holds the centroids, their sums and one (block, K) distance block."""
    return _lloyd(_as_f32(x), k, niter, seed, device)


def _lloyd(x: np.ndarray, k: int, niter: int, seed: int, device: str) -> np.ndarray:
    """`torch_kmeans` on checked (N, d) float32 features."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if x.shape[0] > FAISS_MAX_POINTS_PER_CENTROID * k:
        x = x[np.sort(torch.randperm(x.shape[0], generator=g)[: FAISS_MAX_POINTS_PER_CENTROID * k].numpy())]
    dev = torch.device(device)
    c = torch.from_numpy(x[torch.randperm(x.shape[0], generator=g)[:k].numpy()]).to(dev)
    with _ieee_fp32():
        for _ in range(niter):
            sums = torch.zeros(k, x.shape[1], dtype=torch.float64, device=dev)
            counts = torch.zeros(k, dtype=torch.int64, device=dev)
            for block, nearest in _torch_blocks(x, c, dev, l2=True):
                sums.index_put_((nearest,), block.double(), accumulate=True)
                counts += torch.bincount(nearest, minlength=k)
            c = _split_empty((sums / counts.clamp(min=1)[:, None]).float(), counts.cpu())
    return np.ascontiguousarray(c.cpu().numpy(), dtype=np.float32)


def _split_empty(c, counts):
    """Empty clusters: each takes the centroid of the largest cluster (deterministic, where faiss draws one
    with odds by size), the two moved apart by ±SPLIT_EPS of every coordinate as faiss does, and half its
    points."""
    import torch

    sign = torch.ones(c.shape[1], device=c.device)
    sign[1::2] = -1
    for i in torch.nonzero(counts == 0).flatten().tolist():
        j = int(counts.argmax())
        c[i], c[j] = c[j] * (1 + SPLIT_EPS * sign), c[j] * (1 - SPLIT_EPS * sign)
        counts[i] = counts[j] // 2
        counts[j] -= counts[i]
    return c


def _torch_nearest(x: np.ndarray, c: np.ndarray, device: str, *, l2: bool) -> np.ndarray:
    import torch

    dev = torch.device(device)
    with _ieee_fp32():
        ct = torch.from_numpy(c).to(dev)
        return torch.cat(
            [n.cpu() for _, n in _torch_blocks(x, ct, dev, l2=l2)] or [torch.zeros(0, dtype=torch.int64)]
        ).numpy()


def _torch_blocks(x: np.ndarray, c, dev, *, l2: bool):
    """(points block on `dev`, index of each point's nearest centroid): largest inner product, or with `l2`
    smallest L2 distance (largest x·c - |c|²/2)."""
    import torch

    rows = max(1, TORCH_BLOCK_BYTES // (4 * c.shape[0]))
    neg_half = -0.5 * (c * c).sum(1) if l2 else None
    for start in range(0, x.shape[0], rows):
        block = torch.from_numpy(x[start : start + rows]).to(dev)
        # addmm: the -|c|²/2 added in the matmul's epilogue, not in another pass over the (block, K) scores
        yield block, (torch.addmm(neg_half, block, c.T) if l2 else block @ c.T).argmax(1)


@contextlib.contextmanager
def _ieee_fp32():
    """fp32 matmuls in full fp32 on CUDA (TF32 off) inside; the caller's setting restored after."""
    import torch

    matmul = torch.backends.cuda.matmul
    saved, matmul.allow_tf32 = matmul.allow_tf32, False
    try:
        yield
    finally:
        matmul.allow_tf32 = saved


def target_centroids(reference_features: np.ndarray, centroids: np.ndarray, **where) -> np.ndarray:
    """Sorted unique centroids that some reference image is nearest to (`where`: backend, device)."""
    return np.unique(nearest_centroid(reference_features, centroids, **where))


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
