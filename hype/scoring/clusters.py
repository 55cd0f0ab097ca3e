"""c_IN: DataComp's image-based clustering filter as a per-sample flag. DESIGN §2.4.

k-means (faiss, L2, 20 iterations, seed 0) of the pool's CLIP image embeddings into K centroids; every
image of a labelled reference set (ImageNet-1k train in DataComp) is assigned to its nearest centroid by
inner product, and those centroids are the targets; a pool sample gets c_IN = 10 when its own nearest
centroid (inner product, as DataComp assigns) is a target and it passes DataComp's caption filter.
"""

from __future__ import annotations

import contextlib

import numpy as np

from hype.geometry.exact import fp32_dot_error, pair_dots

C_IN_VALUE = 10.0
DATACOMP_K = 100_000
DATACOMP_POOL_PER_CENTROID = 128  # 12.8M-sample small pool / 100,000 centroids
ASSIGN_BATCH = 1 << 16
# k-means and assignment: faiss (CPU; faiss-gpu with `gpu`), or torch on a device (`clusters.backend`).
BACKENDS = ("faiss", "torch")
FAISS_MAX_POINTS_PER_CENTROID = 256  # faiss.Kmeans's default subsample, kept by the torch backend
SPLIT_EPS = 1.0 / 1024  # faiss's perturbation when an empty cluster takes half of a large one
TORCH_BLOCK_BYTES = 1 << 30  # the (points, K) fp32 distance block of one torch assignment step
TOP = 8  # candidates per point from the fp32 search; more inside the margin: all K measured exactly
# Enters the assignments' fingerprints (and torch k-means's): change it when the assignment rule changes.
ASSIGN = {"assign": "fp32 candidates, float64 fixed-order best, ties to the lower index"}


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
    """The backend as a fingerprint or marker entry: none for faiss, so faiss runs keep the keys they had;
    torch's centroids also depend on the assignment rule of its Lloyd steps."""
    return {} if backend == "faiss" else {"backend": backend} | ASSIGN


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
    """Index of the centroid with the largest inner product for every row, ties to the lower index: the
    same on both backends, any batch, device or BLAS kernel (`exact_best`)."""
    x, c = _as_f32(features), _as_f32(centroids)
    if backend == "torch":
        return _torch_nearest(x, c, device, l2=False)
    import faiss

    index = faiss.IndexFlatIP(c.shape[1])
    index.add(c)
    out = np.empty(x.shape[0], dtype=np.int64)
    for start in range(0, x.shape[0], batch):
        top, ids = index.search(x[start : start + batch], min(TOP, c.shape[0]))
        out[start : start + batch] = exact_best(x[start : start + batch], c, top, ids)
    return out


def exact_best(
    x: np.ndarray,
    c: np.ndarray,
    top: np.ndarray,
    ids: np.ndarray,
    *,
    l2: bool = False,
    exclude: np.ndarray | None = None,
) -> np.ndarray:
    """Each row's best centroid by `pair_dots` (x·c, or with `l2` x·c - |c|²/2), ties to the lower index,
    from the fp32 search's `top` scores (descending) of centroids `ids`; with `exclude` (one centroid per
    row, or m per row as columns), the best other than the row's excluded centroids (the search then lists
    m more: their columns drop out).

    A float32 dot product of d terms, summed in any order or blocking (BLAS, faiss, a GPU, TF32 off), is
    within γ·Σ|x_i c_i| <= γ|x||c| of the true one (γ = d·2^-24/(1 - d·2^-24)); with `l2` the fp32 -|c|²/2
    and the one addition add at most γ|c|²/2 + 2^-24·|score|. Two candidates' search scores can then swap
    by twice that, and the float64 sums differ from the true ones by ~d·2^-53 of it, so every centroid that
    could be the best (or tie with it) by `pair_dots` scores within `margin` = (d + 2)·2^-22·(|x|·max|c| +
    max|c|²/2) of the search's best. One candidate inside: it is the best; several: they are measured
    again; the last of the `top` still inside: the row is measured against all K."""
    d, others = x.shape[1], len(c)
    if exclude is not None:  # each row's list without its m excluded centroids (or its last, if not listed)
        exclude = exclude.reshape(len(x), -1)
        m = exclude.shape[1]
        dropped = (ids[:, :, None] == exclude[:, None, :]).any(axis=2)
        keep = np.argsort(dropped, axis=1, kind="stable")[:, :-m]
        top, ids, others = np.take_along_axis(top, keep, 1), np.take_along_axis(ids, keep, 1), len(c) - m
    half = pair_dots(c, c, *[np.arange(len(c))] * 2) / 2 if l2 else np.zeros(len(c))
    cmax = float(np.sqrt(half.max() * 2)) if l2 else float(np.sqrt(np.einsum("ij,ij->i", c, c).max()))
    xnorm = np.sqrt(np.einsum("ij,ij->i", x, x, dtype=np.float64))
    margin = 4 * fp32_dot_error(d + 2) * (xnorm * cmax + (cmax * cmax / 2 if l2 else 0.0))  # (d+2)·2^-22
    inside = top >= top[:, :1] - margin[:, None]
    best = ids[:, 0].astype(np.int64)
    full = inside[:, -1] & (ids.shape[1] < others)
    rows, cols = np.nonzero(inside & (inside.sum(1, keepdims=True) > 1) & ~full[:, None])
    if len(rows):
        cand = ids[rows, cols].astype(np.int64)
        score = pair_dots(x, c, rows, cand) - half[cand]
        first = np.lexsort((cand, -score, rows))  # per row: the best score, then the lower index
        rows, cand = rows[first], cand[first]
        head = np.r_[True, rows[1:] != rows[:-1]]
        best[rows[head]] = cand[head]
    every = np.arange(len(c))
    for r in np.flatnonzero(full):  # rare: more than TOP centroids inside the margin
        score = pair_dots(x, c, np.full(len(c), r), every) - half
        if exclude is not None:
            score[exclude[r]] = -np.inf
        best[r] = int(np.argmax(score))  # first: lower index
    return best


def torch_kmeans(x: np.ndarray, k: int, *, niter: int = 20, seed: int = 0, device: str = "cpu") -> np.ndarray:
    """Lloyd's k-means in torch on `device`: on a GPU, K = 100,000 over DataComp small's pool takes minutes
    where faiss-cpu takes hours (bench/gpu_suite.py `kmeans`). faiss.Kmeans's algorithm, not its random
    draws: at most 256 points per centroid and the k initial centroids are drawn with `seed`; each
    iteration assigns every point to its nearest centroid (L2; fp32 candidates, TF32 off, decided by
    `exact_best`) and moves each centroid to the mean of its points (sums in float64 in row order: the
    same input and seed give the same bytes on any CPU, whatever its BLAS kernel or the block); an empty
    cluster takes half of the largest one (faiss draws the one to split, with odds by size; the split
    itself is faiss's). Points stream from host memory in blocks: the device
    holds the centroids, their sums and one (block, K) distance block."""
    return _lloyd(_as_f32(x), k, niter, seed, device)


def _lloyd(x: np.ndarray, k: int, niter: int, seed: int, device: str) -> np.ndarray:
    """`torch_kmeans` on checked (N, d) float32 features."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if x.shape[0] > FAISS_MAX_POINTS_PER_CENTROID * k:
        x = x[np.sort(torch.randperm(x.shape[0], generator=g)[: FAISS_MAX_POINTS_PER_CENTROID * k].numpy())]
    dev = torch.device(device)
    c = np.ascontiguousarray(x[torch.randperm(x.shape[0], generator=g)[:k].numpy()])
    with _ieee_fp32():
        for _ in range(niter):
            sums = torch.zeros(k, x.shape[1], dtype=torch.float64, device=dev)
            counts = torch.zeros(k, dtype=torch.int64, device=dev)
            for block, nearest in _torch_blocks(x, c, dev, l2=True):
                nearest = torch.from_numpy(nearest).to(dev)
                sums.index_put_((nearest,), block.double(), accumulate=True)
                counts += torch.bincount(nearest, minlength=k)
            c = _split_empty((sums / counts.clamp(min=1)[:, None]).float(), counts.cpu()).cpu().numpy()
    return np.ascontiguousarray(c, dtype=np.float32)


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

    with _ieee_fp32():
        return np.concatenate(
            [n for _, n in _torch_blocks(x, c, torch.device(device), l2=l2)] or [np.zeros(0, np.int64)]
        )


def _torch_blocks(x: np.ndarray, c: np.ndarray, dev, *, l2: bool):
    """(points block on `dev`, index of each point's nearest centroid as numpy): largest inner product, or
    with `l2` smallest L2 distance (largest x·c - |c|²/2); the device's fp32 top candidates, decided by
    `exact_best` on the host."""
    import torch

    rows = max(1, TORCH_BLOCK_BYTES // (4 * c.shape[0]))
    ct = torch.from_numpy(c).to(dev)
    neg_half = -0.5 * (ct * ct).sum(1) if l2 else None
    for start in range(0, x.shape[0], rows):
        block = torch.from_numpy(x[start : start + rows]).to(dev)
        # addmm: the -|c|²/2 added in the matmul's epilogue, not in another pass over the (block, K) scores
        scores = torch.addmm(neg_half, block, ct.T) if l2 else block @ ct.T
        top, ids = (t.cpu().numpy() for t in scores.topk(min(TOP, len(c)), dim=1))
        yield block, exact_best(x[start : start + rows], c, top, ids, l2=l2)


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
