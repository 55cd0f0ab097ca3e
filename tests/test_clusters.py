"""c_IN clustering against brute force on small data (real faiss)."""

from __future__ import annotations

import numpy as np
import pytest

from hype.config import ConfigError
from hype.scoring import clusters
from hype.scoring.clusters import (
    C_IN_VALUE,
    SPLIT_EPS,
    c_in,
    default_num_clusters,
    kmeans_centroids,
    nearest_centroid,
    target_centroids,
    torch_kmeans,
)
from hype.scoring.config import load_score_config


def _blobs(rng, centers, n_per, noise=0.05):
    x = np.concatenate([c + noise * rng.normal(size=(n_per, centers.shape[1])) for c in centers])
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_kmeans_is_deterministic_and_finds_separated_blobs():
    rng = np.random.default_rng(0)
    centers = np.eye(6, 16) * 3
    x = _blobs(rng, centers, 50)
    a, b = kmeans_centroids(x, 6), kmeans_centroids(x, 6)
    assert np.array_equal(a, b)  # seed 0, 20 iterations: reproducible
    labels = nearest_centroid(x, a)
    # Each blob maps to exactly one centroid and blobs do not share centroids.
    per_blob = [set(labels[i * 50 : (i + 1) * 50]) for i in range(6)]
    assert all(len(s) == 1 for s in per_blob) and len(set.union(*per_blob)) == 6


def test_assignment_is_inner_product_argmax_like_datacomp(monkeypatch):
    rng = np.random.default_rng(1)
    feats, cents = rng.normal(size=(300, 8)).astype(np.float32), rng.normal(size=(7, 8)).astype(np.float32)
    expected = np.argmax(feats.astype(np.float64) @ cents.T.astype(np.float64), axis=1)
    assert np.array_equal(nearest_centroid(feats, cents, batch=64), expected)
    assert np.array_equal(nearest_centroid(feats, cents, backend="torch"), expected)
    monkeypatch.setattr(clusters, "TORCH_BLOCK_BYTES", 4 * 7 * 64)  # 64 points per block: 5 blocks
    assert np.array_equal(nearest_centroid(feats, cents, backend="torch"), expected)
    assert nearest_centroid(feats[:0], cents, backend="torch").dtype == np.int64
    # Not L2: with unnormalized centroids the two rules disagree somewhere.
    l2 = np.argmin(((feats[:, None] - cents[None]) ** 2).sum(-1), axis=1)
    assert (l2 != expected).any()


def test_targets_and_flags():
    rng = np.random.default_rng(2)
    centers = np.eye(4, 16) * 3
    pool = _blobs(rng, centers, 40)
    cents = kmeans_centroids(pool, 4)
    reference = _blobs(rng, centers[:2], 10)  # the "ImageNet" classes live in blobs 0 and 1
    targets = target_centroids(reference, cents)
    assert len(targets) == 2
    flags = c_in(nearest_centroid(pool, cents), targets)
    assert set(np.unique(flags)) == {0.0, C_IN_VALUE}
    assert (flags[:80] == C_IN_VALUE).all() and (flags[80:] == 0).all()
    caption_ok = np.ones(160, bool)
    caption_ok[:5] = False
    assert (c_in(nearest_centroid(pool, cents), targets, caption_ok)[:5] == 0).all()


def test_default_k_and_bad_input():
    assert default_num_clusters(12_800_000) == 100_000
    assert default_num_clusters(128_000_000) == 100_000
    assert default_num_clusters(2000) == 16
    assert default_num_clusters(10) == 2
    with pytest.raises(ValueError, match="number of clusters"):
        kmeans_centroids(np.zeros((3, 4), np.float32), 5)
    with pytest.raises(ValueError, match="NaN"):
        nearest_centroid(np.full((2, 4), np.nan), np.zeros((1, 4)))


def test_centroids_files_in_every_released_form_and_clear_errors(tmp_path):
    """--centroids: a .npy, DataComp's released .pt (torch.save of a numpy array) or a flat faiss index,
    recognised by content; anything else names the file and the forms it takes."""
    import faiss
    import torch

    from hype.scoring.stage_clusters import ClustersError, read_centroids_file

    cents = np.random.default_rng(3).normal(size=(5, 8)).astype(np.float32)
    np.save(tmp_path / "c.npy", cents)
    torch.save(cents, tmp_path / "c.pt", pickle_protocol=4)
    for cls in (faiss.IndexFlatL2, faiss.IndexFlatIP):
        index = cls(8)
        index.add(cents)
        faiss.write_index(index, str(tmp_path / f"{cls.__name__}.index"))
    for name in ("c.npy", "c.pt", "IndexFlatL2.index", "IndexFlatIP.index"):
        got = read_centroids_file(tmp_path / name, 8)
        assert got.dtype == np.float32 and np.array_equal(got, cents), name

    with pytest.raises(ClustersError, match=r"c\.npy: centroids have width 8 .* have 16"):
        read_centroids_file(tmp_path / "c.npy", 16)
    quantizer = faiss.IndexFlatL2(8)  # kept alive: the IVF index only references it
    ivf = faiss.IndexIVFFlat(quantizer, 8, 2)
    ivf.train(np.random.default_rng(4).normal(size=(100, 8)).astype(np.float32))
    ivf.add(cents)
    faiss.write_index(ivf, str(tmp_path / "ivf.index"))
    with pytest.raises(ClustersError, match=r"ivf\.index: .*IndexIVFFlat: only flat indexes"):
        read_centroids_file(tmp_path / "ivf.index", 8)
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    (tmp_path / "junk.bin").write_bytes(b"not centroids at all")
    torch.save({"centroids": torch.from_numpy(cents)}, tmp_path / "tensors.pt")
    for name in ("obj.npy", "junk.bin", "tensors.pt"):
        with pytest.raises(
            ClustersError, match=rf"{name}: cannot read centroids .*<scale>_centroids_l14\.pt"
        ):
            read_centroids_file(tmp_path / name, 8)
    np.save(tmp_path / "ints.npy", np.ones((5, 8), np.int64))
    with pytest.raises(ClustersError, match="float array"):
        read_centroids_file(tmp_path / "ints.npy", 8)
    np.save(tmp_path / "nan.npy", np.full((5, 8), np.nan, np.float32))
    with pytest.raises(ClustersError, match="NaN"):
        read_centroids_file(tmp_path / "nan.npy", 8)
    with pytest.raises(ClustersError, match="not found"):
        read_centroids_file(tmp_path / "absent.npy", 8)


def _lloyd_float64(x: np.ndarray, k: int, niter: int, seed: int, generator=None) -> np.ndarray:
    """An independent reference of the torch backend in float64: the same initial draw (torch's seeded
    permutation; from `generator` where given), argmin of the squared distance, the mean, an empty cluster
    split off the largest."""
    import torch

    x = x.astype(np.float64)
    c = x[torch.randperm(len(x), generator=generator or torch.Generator().manual_seed(seed))[:k].numpy()]
    sign = np.where(np.arange(x.shape[1]) % 2 == 0, 1.0, -1.0)
    for _ in range(niter):
        labels = np.argmin(((x[:, None, :] - c[None]) ** 2).sum(-1), axis=1)
        counts = np.bincount(labels, minlength=k)
        c = np.stack([x[labels == j].mean(0) if counts[j] else np.zeros(x.shape[1]) for j in range(k)])
        for i in np.nonzero(counts == 0)[0]:
            j = int(np.argmax(counts))
            c[i], c[j] = c[j] * (1 + SPLIT_EPS * sign), c[j] * (1 - SPLIT_EPS * sign)
            counts[i] = counts[j] // 2
            counts[j] -= counts[i]
    return c


def test_torch_kmeans_matches_a_float64_reference_and_repeats_its_bytes():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(600, 8)).astype(np.float32)
    got = torch_kmeans(x, 12, niter=6, seed=4)
    np.testing.assert_allclose(got, _lloyd_float64(x, 12, 6, 4), atol=1e-5)
    assert got.dtype == np.float32 and np.isfinite(got).all()
    assert torch_kmeans(x, 12, niter=6, seed=4).tobytes() == got.tobytes()
    assert not np.array_equal(torch_kmeans(x, 12, niter=6, seed=5), got)  # the seed draws the start


def test_torch_kmeans_splits_the_largest_cluster_for_an_empty_one():
    """Six clusters over three distinct points: three start empty or fall empty; each takes half of the
    largest, so every centroid is finite and every point keeps a centroid at (almost) its place."""
    points = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]], np.float32)
    x = np.repeat(points, [50, 30, 20], axis=0)
    got = torch_kmeans(x, 6, niter=4, seed=0)
    np.testing.assert_allclose(got, _lloyd_float64(x, 6, 4, 0), atol=1e-6)
    assert np.isfinite(got).all()
    assert np.abs(got[:, None, :] - points[None]).max(-1).min(0).max() <= 2 * SPLIT_EPS


def test_both_backends_find_the_same_blobs():
    """Lloyd's iterations from k random points (both backends) keep a blob split when two start in it, so
    the torch run takes the first seed whose draw starts one centroid in each blob (faiss's seed 0 does)."""
    import torch

    rng = np.random.default_rng(0)
    x = _blobs(rng, np.eye(6, 16) * 3, 50)
    draw = lambda s: torch.randperm(300, generator=torch.Generator().manual_seed(s))[:6].numpy()  # noqa: E731
    seed = next(s for s in range(100) if len(set(draw(s) // 50)) == 6)
    faiss_c, torch_c = kmeans_centroids(x, 6), kmeans_centroids(x, 6, seed=seed, backend="torch")
    for cents in (faiss_c, torch_c):
        labels = nearest_centroid(x, cents, backend="torch")
        assert all(len(set(labels[i * 50 : (i + 1) * 50])) == 1 for i in range(6)) and len(set(labels)) == 6
    # The same six blob means, in another order.
    order = nearest_centroid(torch_c, faiss_c)
    assert sorted(order) == list(range(6))
    np.testing.assert_allclose(torch_c, faiss_c[order], atol=1e-5)


def test_torch_kmeans_keeps_faiss_subsample_of_256_points_per_centroid():
    """More than 256·K points: both backends train on a seeded sample of 256·K (not all of them); the
    torch sample is the one its seed draws, and training goes on from that draw on exactly those rows."""
    import torch

    rng = np.random.default_rng(7)
    x = rng.normal(size=(256 * 2 + 100, 4)).astype(np.float32)
    got = torch_kmeans(x, 2, niter=3, seed=1)
    g = torch.Generator().manual_seed(1)
    sample = x[np.sort(torch.randperm(len(x), generator=g)[: 256 * 2].numpy())]
    np.testing.assert_allclose(got, _lloyd_float64(sample, 2, 3, seed=1, generator=g), atol=1e-5)


def test_the_backend_is_checked_in_the_config():
    assert load_score_config(None, ["clusters.backend=torch"]).clusters.backend == "torch"
    with pytest.raises(ConfigError, match=r"clusters\.backend: must be one of faiss, torch; got 'cuda'"):
        load_score_config(None, ["clusters.backend=cuda"])
    with pytest.raises(ConfigError, match=r"clusters\.gpu: faiss-gpu's switch"):
        load_score_config(None, ["clusters.backend=torch", "clusters.gpu=true"])


def _tied_world(seed=5, d=64, bases=6, n=240):
    """Points and centroids of multiples of 2^-20 (their float64 dot products are exact) with exact ties
    and 2^-40 near-ties that fp32 sums, in whatever order BLAS adds them, cannot resolve: each base
    centroid in 10 variants, its first 10 coordinates cyclically shifted (shuffled among the others);
    points near a base, half with their first 10 coordinates equal (10 exact ties: more than TOP, so the
    row is measured against every centroid), a quarter with two of them 1 apart (near-ties)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(-(1 << 19), 1 << 19, size=(bases, d))
    base[:, :10] = base[:, :1] + rng.integers(-(1 << 10), 1 << 10, size=(bases, 10))  # variants close
    cents = np.array([np.r_[np.roll(b[:10], s), b[10:]] for b in base for s in range(10)])
    cents = cents[rng.permutation(len(cents))]
    pts = base[rng.integers(0, bases, n)] + rng.integers(-(1 << 16), 1 << 16, size=(n, d))
    pts[: n // 2, :10] = pts[: n // 2, :1]
    pts[n // 2 : 3 * n // 4, :10] = pts[n // 2 : 3 * n // 4, :1]
    pts[n // 2 : 3 * n // 4, 1] += 1
    return pts, cents


def _reference(pts, cents, l2=False):
    """One point at a time, exact int64 sums (no BLAS): the first centroid of the largest x·c (2^-40
    units), or with l2 of the largest 2x·c - |c|² (the same order as x·c - |c|²/2)."""
    return np.array([np.argmax(2 * (c @ p) - l2 * (cents * cents).sum(1)) for p in pts for c in [cents]])


@pytest.mark.parametrize("backend", ["faiss", "torch"])
def test_assignment_is_exact_with_ties_to_the_lower_index_in_any_block(monkeypatch, backend):
    """#34 item 17: the fp32 search only proposes candidates; the best is decided on exact sums, ties to
    the lower index, so any block of points (1, 2, 7, all) gives the exact one-point-at-a-time answer."""
    pts, cents = _tied_world()
    x, c = np.ldexp(pts, -20).astype(np.float32), np.ldexp(cents, -20).astype(np.float32)
    expected = _reference(pts, cents)
    for rows in (1, 2, 7, len(x)):
        monkeypatch.setattr(clusters, "TORCH_BLOCK_BYTES", 4 * len(c) * rows)
        assert np.array_equal(nearest_centroid(x, c, batch=rows, backend=backend), expected), rows
    # the L2 rule of the Lloyd steps, on the same exact sums
    got = np.concatenate([n for _, n in clusters._torch_blocks(x, c, "cpu", l2=True)])
    assert np.array_equal(got, _reference(pts, cents, l2=True))


def test_torch_kmeans_step_is_exact_and_the_same_bytes_in_any_assignment_block(monkeypatch):
    """#34 item 17: a Lloyd step assigns by exact sums (ties to the lower index) in any block of points, so
    torch-trained centroids do not depend on the block or the BLAS kernel: one step from the first k
    points of the seed's draw is the float64 mean, summed in row order, of the exact assignment."""
    import torch

    pts, cents = _tied_world(seed=6, n=160)
    both = np.concatenate([cents, pts])  # the shifted variants among the points: ties between centroids
    x, k = np.ldexp(both, -20).astype(np.float32), 80
    first = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[:k].numpy()
    near, sums = _reference(both, both[first], l2=True), np.zeros((k, x.shape[1]))
    for i, j in enumerate(near):
        sums[j] += x[i]
    counts = np.bincount(near, minlength=k)
    assert counts.min() > 0  # no empty cluster to split
    expected = (sums / counts[:, None]).astype(np.float32)
    for rows in (1, 2, 7, len(x)):
        monkeypatch.setattr(clusters, "TORCH_BLOCK_BYTES", 4 * k * rows)
        assert torch_kmeans(x, k, niter=1).tobytes() == expected.tobytes(), rows
    assert len({torch_kmeans(x, k, niter=3).tobytes() for _ in range(2)}) == 1
