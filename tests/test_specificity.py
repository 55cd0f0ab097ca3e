"""ε_i / ε_t against a float64 reference; chunking never changes the result."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference import r_aper, r_ext_law_of_cosines

from hype.geometry import lorentz
from hype.geometry._tiles import run_tiles, tile_grid
from hype.scoring.specificity import chunk_rows, image_specificity, text_specificity

RNG = np.random.default_rng(7)


def ref_energy(apex, points, c, K=0.1):
    """(N, M) float64 E(apex_i -> point_j) through the law of cosines."""
    return r_ext_law_of_cosines(apex[:, None], points[None], c) - r_aper(apex, c, K)[:, None]


@pytest.mark.parametrize("hinge", [False, True])
@pytest.mark.parametrize("c", [0.1, 1.0])
def test_specificity_matches_float64_reference(hinge, c):
    texts, images = RNG.normal(size=(37, 16)) * 0.6, RNG.normal(size=(41, 16)) * 0.6
    ref_txt, ref_img = RNG.normal(size=(23, 16)) * 0.6, RNG.normal(size=(29, 16)) * 0.6
    h = (lambda e: np.maximum(e, 0)) if hinge else (lambda e: e)
    # ε_t(x): the pool text is the apex, reference images the points; mean over references.
    expected_t = h(ref_energy(texts, ref_img, c)).mean(1)
    # ε_i(y): reference texts are the apexes, the pool image the point.
    expected_i = h(ref_energy(ref_txt, images, c)).mean(0)
    got_t = text_specificity(torch.tensor(texts).float(), torch.tensor(ref_img).float(), c, hinge=hinge)
    got_i = image_specificity(torch.tensor(images).float(), torch.tensor(ref_txt).float(), c, hinge=hinge)
    np.testing.assert_allclose(got_t.numpy(), expected_t, atol=2e-3)
    np.testing.assert_allclose(got_i.numpy(), expected_i, atol=2e-3)
    # float64 inputs are computed in float64.
    got64 = text_specificity(torch.tensor(texts), torch.tensor(ref_img), c, hinge=hinge)
    assert got64.dtype == torch.float64
    np.testing.assert_allclose(got64.numpy(), expected_t, atol=1e-8)


def test_chunk_size_does_not_change_the_result():
    texts, refs = torch.randn(500, 32) * 0.3, torch.randn(64, 32) * 0.3
    whole = text_specificity(texts, refs, 0.5, budget_elems=10**9)
    for budget in (64, 64 * 7, 64 * 100):
        assert chunk_rows(64, budget) == max(1, budget // 64)
        torch.testing.assert_close(text_specificity(texts, refs, 0.5, budget_elems=budget), whole)
        torch.testing.assert_close(
            image_specificity(texts, refs, 0.5, budget_elems=budget),
            image_specificity(texts, refs, 0.5, budget_elems=10**9),
        )


def test_kernel_equals_the_differentiable_pairwise_form():
    a, b = torch.randn(30, 8), torch.randn(45, 8)
    for dim in (0, 1):
        for hinge in (False, True):
            e = lorentz.pairwise_entailment_energy(a, b, 0.3)
            expected = (e.clamp(min=0) if hinge else e).mean(dim)
            got = lorentz.mean_entailment_energy(
                lorentz.prepare(a, 0.3), lorentz.prepare(b, 0.3), 0.3, dim=dim, hinge=hinge
            )
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_edge_cases_are_finite_and_empty_pools_work():
    refs = torch.randn(10, 8)
    pool = torch.cat([torch.zeros(2, 8), refs[:3], refs[:3] * 1e4])  # origin, identical, huge
    for fn in (text_specificity, image_specificity):
        assert torch.isfinite(fn(pool, refs, 0.1)).all()
        assert fn(pool[:0], refs, 0.1).shape == (0,)


def test_specific_samples_score_higher_than_generic_ones():
    # A generic text near the origin has a wide cone containing the references: low ε_t. A text far out
    # along some direction has a narrow cone that excludes most references: high ε_t.
    refs = torch.randn(200, 8) * 1.5
    generic = torch.randn(20, 8) * 0.01
    specific = torch.randn(20, 8) * 3.0
    assert text_specificity(specific, refs, 1.0).min() > text_specificity(generic, refs, 1.0).max()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_tiles_and_threads_do_not_change_the_kernel(monkeypatch, threads):
    # Small tiles so that both axes are split (ragged edges included) and every thread gets work.
    monkeypatch.setattr(lorentz, "CPU_TILE", (7, 5))
    a, b = torch.randn(30, 8), torch.randn(46, 8)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dim in (0, 1):
            for hinge in (False, True):
                e = lorentz.pairwise_entailment_energy(a, b, 0.3)
                expected = (e.clamp(min=0) if hinge else e).mean(dim)
                got = lorentz.mean_entailment_energy(
                    lorentz.prepare(a, 0.3), lorentz.prepare(b, 0.3), 0.3, dim=dim, hinge=hinge
                )
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert torch.get_num_threads() == threads  # restored after the tiles ran single-threaded
    finally:
        torch.set_num_threads(before)


def test_run_tiles_covers_every_tile_once_and_reraises():
    tiles, shape = tile_grid(10, 23, 4, 10)
    assert shape == (4, 8)  # 10 rows -> 3 tiles of <= 4, 23 cols -> 3 tiles of <= 8, not 10 + 10 + 3
    seen = torch.zeros(10, 23, dtype=torch.int32)

    def mark(r, c, scratch):
        seen[r, c] += 1

    assert torch.is_grad_enabled()
    run_tiles(tiles, mark, threads=2)
    assert (seen == 1).all()
    assert torch.is_grad_enabled()  # the caller ran tiles too, and keeps its own grad mode

    def fail(r, c, scratch):
        raise RuntimeError("tile failed")

    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="tile failed"):
        run_tiles(tiles, fail, threads=2)
    assert torch.get_num_threads() == before
