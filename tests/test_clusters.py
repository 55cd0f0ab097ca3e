"""c_IN clustering against brute force on small data (real faiss)."""

from __future__ import annotations

import numpy as np
import pytest

from hype.scoring.clusters import (
    C_IN_VALUE,
    c_in,
    default_num_clusters,
    kmeans_centroids,
    nearest_centroid,
    target_centroids,
)


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


def test_assignment_is_inner_product_argmax_like_datacomp():
    rng = np.random.default_rng(1)
    feats, cents = rng.normal(size=(300, 8)).astype(np.float32), rng.normal(size=(7, 8)).astype(np.float32)
    expected = np.argmax(feats @ cents.T, axis=1)
    assert np.array_equal(nearest_centroid(feats, cents, batch=64), expected)
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
