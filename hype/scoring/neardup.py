"""Near-duplicate images (semantic dedup, SemDeDup-style) within k-means clusters: the algorithms, no I/O.

Within one cluster of L2-normalised CLIP image features, every pair with cosine similarity >= threshold is
an edge; duplicate groups are the connected components of that graph. Pairs come from a range search
(faiss `IndexFlatIP.range_search` on the CPU; on a GPU, blocks of `x @ x.T` with torch, since faiss' GPU
flat indexes have no range search) over blocks of query rows, so memory is the cluster's features plus
one block's pairs (`pairs_per_block`), never all pairs of the cluster.

With the copy check the candidates are each row's `k` nearest rows at cosine >= threshold and its `pixel_k`
nearest of those by pixel descriptor (`pixel_descriptors`: an 8 x 8 RGB thumbnail, centred, int8; a small
CLIP ranks a copy among other renders of its kind, the thumbnail ranks it first), `nearest_pairs`.

The clusters are k-means clusters of the rows' pixel descriptors (`neardup.partition=pixel`, the default
with the copy check: `pixel_units`; a copy and its source share one of their 2 nearest for 0.991 of the
true pairs of bench/neardup.py's world 0, whatever the CLIP) or of their CLIP image features (`clip`: 0.83
there with the tiny CLIP); the pairs searched in either are at CLIP cosine >= threshold.
A row may be searched in two clusters (its nearest and second-nearest centroid, `second_nearest`, as
SemDeDup's soft assignment: a copy and its source often fall on two sides of a k-means boundary); groups
are then the connected components across clusters: the forests of the clusters are merged by uid
(`uid_nodes`, `merged_forest`: a pair found in both clusters counts once).

What is kept is the cluster's maximum spanning forest, not every pair: the components of the pairs >= t
are the components of the forest's edges >= t for every t at or above the threshold (a forest edge left
out below t cannot join what a stronger path does not), so one stored forest answers any stricter
threshold later (`hype select --filter dedup:threshold=...`) with at most one edge per member. Blocks are
folded in one at a time (the forest of the forest plus a block's pairs is the forest of everything so
far), so a cluster of identical copies costs one block of pairs, not m².

Same bytes on any machine: the search's own cosines (BLAS or the GPU, in blocks) depend on the kernel, the
block's shape and the thread count, so the search runs `search_margin` below the threshold and every pair
it finds is measured again by `pair_cosines` (float64 products, exact, summed in numpy's pairwise order,
which depends on the vector length alone); the threshold, the forest and the stored similarities use
those. The groups and edges are then the same for any block size, thread count, CPU kernel or device.

Keeper rules (one member of each group stays, the others are marked): `hype`: the highest HYPE score
(paper Eq. 1; the most specific and best aligned copy), `semdedup`: the member farthest from its cluster's
centroid (lowest cosine to it, as SemDeDup keeps), `random`: the smallest seeded hash of the uid. Ties go
to the smallest uid, so the choice never depends on order.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from hype.geometry.exact import fp32_dot_error, pair_dots

KEEPERS = ("hype", "semdedup", "random")
PAIRS_PER_BLOCK = 1 << 24  # range-search results held at once (int64 ids + float32 sims: ~200 MB)
PIXEL_SIDE = 8  # `pixel_descriptors`' grid: 8 x 8 cells x 3 channels
PIXEL_BYTES = PIXEL_SIDE * PIXEL_SIDE * 3  # one row's descriptor (int8)


class NeardupError(ValueError):
    """Near-duplicate search that cannot run on these inputs; the message says why and what to do."""


def normalize_rows(x: np.ndarray) -> np.ndarray:
    """float32 rows of unit L2 norm (a zero row stays zero: it is nobody's duplicate)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms > 0, norms, 1.0).astype(np.float32)


def search_margin(dim: int) -> float:
    """How far below the threshold the search runs: twice `fp32_dot_error` (unit vectors), so no pair at or
    above the threshold is missed."""
    return 2 * fp32_dot_error(dim)


def pair_cosines(x: np.ndarray, a: np.ndarray, b: np.ndarray, chunk: int = 1 << 12) -> np.ndarray:
    """float32 cosine of each pair of rows (a[i], b[i]) of unit `x`, the same bytes on any machine
    (`pair_dots`, rounded once to float32)."""
    return pair_dots(x, x, a, b, chunk).astype(np.float32)


def _faiss_pairs(x: np.ndarray, threshold: float, block: int) -> Iterator[tuple[np.ndarray, ...]]:
    import faiss

    index = faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    for start in range(0, len(x), block):
        lims, sims, ids = index.range_search(x[start : start + block], float(threshold))
        rows = start + np.repeat(np.arange(len(lims) - 1, dtype=np.int64), np.diff(lims).astype(np.int64))
        yield rows, ids.astype(np.int64, copy=False), sims


def _torch_pairs(
    x: np.ndarray, threshold: float, block: int, device: str
) -> Iterator[tuple[np.ndarray, ...]]:
    import torch

    xt = torch.from_numpy(x).to(device)
    for start in range(0, len(x), block):
        sims = xt[start : start + block] @ xt.T
        rows, ids = torch.nonzero(sims >= threshold, as_tuple=True)
        yield (rows + start).cpu().numpy(), ids.cpu().numpy(), sims[rows, ids].cpu().numpy()


def similar_pairs(
    x: np.ndarray, threshold: float, *, pairs_per_block: int = PAIRS_PER_BLOCK, device: str = "cpu"
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Blocks of (a, b, sim) with a < b and cosine sim >= threshold (rows of unit `x`); each pair once, in
    (a, b) order, sim from `pair_cosines`."""
    block = max(1, pairs_per_block // max(1, len(x)))
    wide = threshold - search_margin(x.shape[1])
    found = _faiss_pairs(x, wide, block) if device == "cpu" else _torch_pairs(x, wide, block, device)
    for a, b, _ in found:
        a, b = a[a < b], b[a < b]
        s = pair_cosines(x, a, b)
        keep = s >= threshold
        order = np.lexsort((b[keep], a[keep]))
        yield a[keep][order], b[keep][order], s[keep][order]


def pixel_descriptors(work: np.ndarray) -> np.ndarray:
    """(n, PIXEL_BYTES) int8: each (WORK_SIDE, WORK_SIDE, 3) uint8 work image's RGB block sums on a
    `PIXEL_SIDE` x `PIXEL_SIDE` grid, each channel's mean removed (a brightness or tint change moves none of
    them), scaled to norm ~127 and rounded: their dot product ranks a row's copies first where a small CLIP
    ranks them among other renders of the same kind (`nearest_pairs`). A grid cell is 1/8 of the side, so
    a crop of a few percent of each side or a resize moves little; a flat image is all zeros (it ranks
    nobody first). Exact on any machine: integer sums, then one correctly rounded sqrt, division and
    product per entry; their dot products are integers below 2^24, the same in any order."""
    n, side = len(work), work.shape[1]
    cell = side // PIXEL_SIDE
    sums = work.reshape(n, PIXEL_SIDE, cell, PIXEL_SIDE, cell, 3).sum(axis=(2, 4), dtype=np.int64)
    v = (PIXEL_SIDE * PIXEL_SIDE * sums - sums.sum(axis=(1, 2), keepdims=True)).reshape(n, PIXEL_BYTES)
    return np.rint(v * (127.0 / _int_norms(v))).astype(np.int8)


def pixel_units(pixels: np.ndarray) -> np.ndarray:
    """float32 unit rows of `pixel_descriptors` (a flat image's zero row stays zero): the space that the
    pixel partition's k-means and assignment (`neardup.partition=pixel`) work in. Exact on any machine:
    integer squared norms, then one correctly rounded sqrt and division per entry."""
    p = pixels.astype(np.int64)
    return (p / _int_norms(p)).astype(np.float32)


def _int_norms(v: np.ndarray) -> np.ndarray:
    """(n, 1) float64 L2 norms of int64 rows, at least 1 (a zero row stays zero when divided): the squared
    norm is an integer sum below 2^53, exact in any order, then one correctly rounded sqrt."""
    return np.maximum(np.sqrt(np.einsum("ij,ij->i", v, v).astype(np.float64))[:, None], 1.0)


def _nearest(a: np.ndarray, b: np.ndarray, score: np.ndarray, k: int) -> np.ndarray:
    """bool per pair (a, b): b is among a's `k` best by `score` (ties to the smaller b)."""
    order = np.lexsort((b, -score, a))
    near = np.zeros(len(a), dtype=bool)
    near[order] = np.arange(len(a)) - np.searchsorted(a[order], a[order]) < k  # place among a's pairs
    return near


def nearest_pairs(
    x: np.ndarray,
    threshold: float,
    k: int,
    *,
    pixels: np.ndarray | None = None,
    pixel_k: int = 0,
    pairs_per_block: int = PAIRS_PER_BLOCK,
    device: str = "cpu",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(a, b, sim), a < b, each pair once: every row's `k` nearest other rows of unit `x` at cosine >=
    threshold (the copy check's candidates), with `pixels` (`pixel_descriptors` of the rows) also its
    `pixel_k` nearest of those rows by pixel descriptor. Ranked by `pair_cosines` and by the descriptors'
    exact integer dot products (ties to the smaller row), so the candidates are the same on any machine;
    memory is one block of pairs plus k + pixel_k per row."""
    block = max(1, pairs_per_block // max(1, len(x)))
    wide = threshold - search_margin(x.shape[1])
    found = _faiss_pairs(x, wide, block) if device == "cpu" else _torch_pairs(x, wide, block, device)
    parts = []
    for a, b, _ in found:  # a block holds every neighbour of its query rows: their top k are final
        a, b = a[a != b], b[a != b]
        s = pair_cosines(x, a, b)
        a, b, s = a[s >= threshold], b[s >= threshold], s[s >= threshold]
        near = _nearest(a, b, s.astype(np.float64), k)
        if pixels is not None and pixel_k > 0:
            near |= _nearest(a, b, pair_dots(pixels, pixels, a, b), pixel_k)
        parts.append((np.minimum(a, b)[near], np.maximum(a, b)[near], s[near]))
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
    a, b, s = (np.concatenate(p) for p in zip(*parts, strict=True))
    _, first = np.unique(a * len(x) + b, return_index=True)  # sorted by (a, b), a pair once
    return a[first], b[first], s[first]


def second_nearest(x: np.ndarray, c: np.ndarray, first: np.ndarray, top: int = 8) -> np.ndarray:
    """Each row's nearest centroid (largest inner product with rows `x`) other than its `first` (one per
    row, or several as columns: the third nearest is the nearest other than the first two), ties to the
    lower index, -1 when no other centroid is left: the same on any BLAS, thread count or batch, as
    `hype.scoring.clusters.nearest_centroid` (`exact_best`, the row's `first` excluded)."""
    import faiss

    from hype.scoring.clusters import exact_best

    first = np.asarray(first, np.int64).reshape(len(x), -1) if len(x) else np.zeros((0, 1), np.int64)
    if len(c) <= first.shape[1] or not len(x):
        return np.full(len(x), -1, np.int64)
    index = faiss.IndexFlatIP(c.shape[1])
    index.add(c)
    scores, ids = index.search(x, min(top + first.shape[1], len(c)))
    return exact_best(x, c, scores, ids, exclude=first)


def uid_nodes(hi: np.ndarray, lo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(node of each row, first row of each node): rows with one uid (hi, lo) are one node (a row searched
    in two clusters), nodes numbered in the order of their first rows."""
    n = len(hi)
    order = np.lexsort((np.arange(n), lo, hi))
    new = np.ones(n, dtype=bool)
    new[1:] = (hi[order][1:] != hi[order][:-1]) | (lo[order][1:] != lo[order][:-1])
    by_uid = np.empty(n, np.int64)
    by_uid[order] = np.cumsum(new) - 1
    first = order[new]  # each uid's smallest row (ties in `order` go to the row index)
    rank = np.empty(len(first), np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    return rank[by_uid], np.sort(first)


def merged_forest(
    n: int, a: np.ndarray, b: np.ndarray, sim: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The maximum spanning forest of forests' edges on `n` nodes, a pair found in two clusters counted
    once (its cosine is the same bytes in both: `pair_cosines`). The forest of forests is the forest of all
    their pairs, so the groups at every threshold stay exact."""
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    _, first = np.unique(lo * n + hi, return_index=True)
    first = first[lo[first] != hi[first]]
    return spanning_forest(n, lo[first], hi[first], sim[first])


def spanning_forest(
    n: int, a: np.ndarray, b: np.ndarray, sim: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The maximum spanning forest of the graph on `n` nodes with distinct edges (a, b, sim > 0): at most
    n - 1 edges (scipy's minimum spanning tree of -sim; a zero weight would read as no edge)."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import minimum_spanning_tree

    if not len(a):
        return a, b, sim
    graph = coo_matrix((-sim.astype(np.float64), (a, b)), shape=(n, n)).tocsr()
    tree = minimum_spanning_tree(graph).tocoo()
    lo, hi = np.minimum(tree.row, tree.col), np.maximum(tree.row, tree.col)
    return lo.astype(np.int64), hi.astype(np.int64), (-tree.data).astype(np.float32)


def cluster_forest(
    x: np.ndarray, threshold: float, *, pairs_per_block: int = PAIRS_PER_BLOCK, device: str = "cpu"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The maximum spanning forest of the pairs >= threshold among the rows of unit `x` (one cluster)."""
    fa, fb, fs = np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
    for a, b, s in similar_pairs(x, threshold, pairs_per_block=pairs_per_block, device=device):
        if len(a):
            fa, fb, fs = spanning_forest(
                len(x), np.concatenate([fa, a]), np.concatenate([fb, b]), np.concatenate([fs, s])
            )
    return fa, fb, fs


def components(n: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Component label of each of `n` nodes (labels 0.. in order of each component's first node)."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    graph = coo_matrix((np.ones(len(a), np.int8), (a, b)), shape=(n, n))
    _, labels = connected_components(graph, directed=False)
    # relabel by first appearance: independent of scipy's numbering
    _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    rank = np.empty(len(first), np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    return rank[inverse]


def random_keys(hi: np.ndarray, lo: np.ndarray, seed: int) -> np.ndarray:
    """A seeded hash of each uid (the `random` rule's, as uint64): the `random` keeper keeps the smallest."""
    from hype.data.uids import splitmix64

    s = np.full_like(lo, np.uint64(seed % 2**64))
    return splitmix64(hi ^ splitmix64(lo ^ splitmix64(s)))


def keepers(
    group: np.ndarray,
    rule: str,
    *,
    hi: np.ndarray,
    lo: np.ndarray,
    hype: np.ndarray | None = None,
    centroid_sim: np.ndarray | None = None,
    seed: int = 0,
) -> np.ndarray:
    """bool per member: the one member of its `group` the rule keeps. `group` -1: in no group (kept)."""
    if rule == "hype":
        primary = -np.asarray(hype, np.float64)  # highest score first
    elif rule == "semdedup":
        primary = np.asarray(centroid_sim, np.float64)  # farthest from the centroid first
    elif rule == "random":
        primary = random_keys(hi, lo, seed)
    else:
        raise NeardupError(f"unknown keeper {rule!r}; keepers: {', '.join(KEEPERS)}")
    order = np.lexsort((lo, hi, primary, group))  # best member of each group first, ties by uid
    first = np.ones(len(order), dtype=bool)
    first[1:] = group[order][1:] != group[order][:-1]
    keep = np.zeros(len(group), dtype=bool)
    keep[order[first]] = True
    return keep | (group < 0)
