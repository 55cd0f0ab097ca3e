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
