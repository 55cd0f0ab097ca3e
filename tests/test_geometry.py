"""Geometry against an independent float64 reference and its defining properties.

The reference is plain numpy on the DESIGN §2 formulas; the exterior angles are checked through the law of
cosines on distances (MERU App. C), a different route than the closed forms under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from reference import (
    mp_aper,
    mp_dist,
    mp_euc_ext,
    mp_ext,
    mp_sphere_geodesic,
    r_aper,
    r_dist,
    r_euc_ext,
    r_exp0,
    r_ext_law_of_cosines,
    r_inner,
    r_time,
)

from hype.geometry import GEOMETRIES, euclidean, get_geometry, lorentz, oblique, sphere
from hype.geometry._numerics import acosh1p, delta

RNG = np.random.default_rng(0)


def t(a, dtype=torch.float32):
    return torch.tensor(a, dtype=dtype)


def points(n=64, dim=16, scale=0.5):
    # Space components of moderate norm, like trained MERU embeddings.
    return RNG.normal(size=(n, dim)) * scale


# ---------------------------------------------------------------- Lorentz vs reference
@pytest.mark.parametrize("c", [0.1, 1.0, 3.0])
@pytest.mark.parametrize("dtype,rtol,atol", [(torch.float64, 1e-9, 1e-9), (torch.float32, 1e-4, 3e-3)])
def test_lorentz_matches_reference(c, dtype, rtol, atol):
    x, y = points(), points()
    np.testing.assert_allclose(lorentz.time_component(t(x, dtype), c).numpy(), r_time(x, c), rtol=rtol)
    np.testing.assert_allclose(
        lorentz.inner(t(x, dtype), t(y, dtype), c).numpy(), r_inner(x, y, c), rtol=rtol
    )
    np.testing.assert_allclose(
        lorentz.distance(t(x, dtype), t(y, dtype), c).numpy(), r_dist(x, y, c), rtol=rtol, atol=atol
    )
    pd = lorentz.pairwise_distance(t(x, dtype), t(y, dtype), c).numpy()
    np.testing.assert_allclose(pd, r_dist(x[:, None], y[None], c), rtol=rtol, atol=atol)
    np.testing.assert_allclose(
        lorentz.pairwise_squared_distance(t(x, dtype), t(y, dtype), c).numpy(),
        r_dist(x[:, None], y[None], c) ** 2,
        rtol=rtol,
        atol=atol,
    )
    np.testing.assert_allclose(lorentz.exp_map0(t(x, dtype), c).numpy(), r_exp0(x, c), rtol=rtol, atol=atol)
    np.testing.assert_allclose(
        lorentz.half_aperture(t(x, dtype), c, 0.1).numpy(), r_aper(x, c, 0.1), rtol=rtol
    )
    ext = r_ext_law_of_cosines(x, y, c)
    np.testing.assert_allclose(lorentz.exterior_angle(t(x, dtype), t(y, dtype), c).numpy(), ext, atol=atol)
    pext = lorentz.pairwise_exterior_angle(t(x, dtype), t(y, dtype), c).numpy()
    np.testing.assert_allclose(pext, r_ext_law_of_cosines(x[:, None], y[None], c), atol=atol)
    energy = lorentz.pairwise_entailment_energy(t(x, dtype), t(y, dtype), c, 0.1).numpy()
    np.testing.assert_allclose(
        energy, r_ext_law_of_cosines(x[:, None], y[None], c) - r_aper(x, c, 0.1)[:, None], atol=atol
    )


def test_lorentz_pairwise_equals_rowwise_on_the_diagonal():
    x, y = t(points()), t(points())
    torch.testing.assert_close(lorentz.pairwise_distance(x, y, 0.5).diagonal(), lorentz.distance(x, y, 0.5))
    torch.testing.assert_close(
        lorentz.pairwise_entailment_energy(x, y, 0.5).diagonal(),
        lorentz.entailment_energy(x, y, 0.5),
        atol=2e-3,
        rtol=1e-3,
    )


# ---------------------------------------------------------------- Lorentz properties
def test_exp_log_round_trip():
    v = t(points(scale=0.5), torch.float64)  # sqrt(c)|v| stays below the asinh(2^15) clamp
    for c in (0.1, 1.0, 10.0):
        torch.testing.assert_close(lorentz.log_map0(lorentz.exp_map0(v, c), c), v)
    # Round trip is also fine in fp32 for vectors of moderate norm.
    v32 = v.float()
    torch.testing.assert_close(lorentz.log_map0(lorentz.exp_map0(v32, 1.0), 1.0), v32, atol=1e-5, rtol=1e-5)


def test_exp_map_is_clamped_so_norms_stay_finite():
    v = torch.full((2, 512), 10.0)  # |v| ≈ 226: sinh would overflow fp32 without the clamp
    x = lorentz.exp_map0(v, 0.1)
    assert torch.isfinite(x).all()
    assert torch.allclose(x.norm(dim=-1), torch.tensor(2.0**15 / math.sqrt(0.1)), rtol=1e-4)
    assert torch.isfinite(lorentz.time_component(x, 0.1)).all()


def test_distance_to_self_is_zero_even_at_huge_norms():
    x = torch.randn(8, 64)
    for c, scale in [(1.0, 1.0), (0.1, 2.0**15 / math.sqrt(0.1))]:
        xs = x / x.norm(dim=-1, keepdim=True) * scale
        assert lorentz.distance(xs, xs, c).max() < 1e-6
        assert lorentz.exterior_angle(xs, xs, c).isfinite().all()


def test_symmetry_and_triangle_inequality():
    x, y, z = (t(points(200, 8, 1.5), torch.float64) for _ in range(3))
    for c in (0.1, 1.0, 7.0):
        dxy, dyx = lorentz.distance(x, y, c), lorentz.distance(y, x, c)
        torch.testing.assert_close(dxy, dyx)
        assert (dxy <= lorentz.distance(x, z, c) + lorentz.distance(z, y, c) + 1e-9).all()
        pd = lorentz.pairwise_distance(x, y, c)
        torch.testing.assert_close(pd, lorentz.pairwise_distance(y, x, c).T)


def test_entailment_cone_contains_the_ray_beyond_x_and_not_the_segment_to_the_origin():
    x = t(points(32, 8, 1.0))
    for c in (0.1, 1.0, 4.0):
        further = lorentz.entailment_energy(x, 3.0 * x, c)  # same geodesic ray from O, beyond x
        closer = lorentz.entailment_energy(x, 0.3 * x, c)  # same ray, between O and x
        assert (further < 0).all(), further
        assert (closer > 0).all(), closer
        torch.testing.assert_close(
            lorentz.exterior_angle(x, 0.3 * x, c), torch.full((32,), math.pi), atol=3e-3, rtol=0
        )


def test_aperture_saturates_at_half_pi_near_the_origin_and_shrinks_outwards():
    c, K = 1.0, 0.1
    inside = torch.randn(16, 8)
    inside = inside / inside.norm(dim=-1, keepdim=True) * (2 * K / math.sqrt(c)) * 0.9
    assert torch.equal(lorentz.half_aperture(inside, c, K), torch.full((16,), math.pi / 2))
    radii = torch.tensor([0.3, 1.0, 10.0, 100.0])
    aper = lorentz.half_aperture(radii[:, None] * torch.eye(8)[0], c, K)
    assert (aper.diff() < 0).all()


# ---------------------------------------------------------------- Euclidean, sphere, oblique vs reference
@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-9), (torch.float32, 2e-3)])
def test_euclidean_matches_reference(dtype, atol):
    x, y = points(scale=1.0), points(scale=1.0)
    np.testing.assert_allclose(
        euclidean.pairwise_distance(t(x, dtype), t(y, dtype)).numpy(),
        np.linalg.norm(x[:, None] - y[None], axis=-1),
        rtol=1e-5,
        atol=atol,
    )
    np.testing.assert_allclose(
        euclidean.squared_distance(t(x, dtype), t(y, dtype)).numpy(), ((x - y) ** 2).sum(-1), rtol=1e-5
    )
    K = 0.3
    aper = np.arcsin(np.minimum(1, K / np.linalg.norm(x, axis=-1)))
    np.testing.assert_allclose(euclidean.half_aperture(t(x, dtype), K).numpy(), aper, rtol=1e-5)
    np.testing.assert_allclose(
        euclidean.exterior_angle(t(x, dtype), t(y, dtype)).numpy(), r_euc_ext(x, y), atol=atol
    )
    np.testing.assert_allclose(
        euclidean.pairwise_entailment_energy(t(x, dtype), t(y, dtype), K).numpy(),
        r_euc_ext(x[:, None], y[None]) - aper[:, None],
        atol=atol,
    )
    further = euclidean.entailment_energy(t(x, dtype), 2.0 * t(x, dtype), K)
    assert (further < 0).all()


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-9), (torch.float32, 2e-3)])
def test_sphere_and_oblique_match_reference(dtype, atol):
    x, y = points(dim=24), points(dim=24)
    xn = x / np.linalg.norm(x, axis=-1, keepdims=True)
    yn = y / np.linalg.norm(y, axis=-1, keepdims=True)
    np.testing.assert_allclose(sphere.pairwise_cosine(t(x, dtype), t(y, dtype)).numpy(), xn @ yn.T, atol=1e-6)
    np.testing.assert_allclose(
        sphere.pairwise_geodesic(t(x, dtype), t(y, dtype)).numpy(),
        np.arccos(np.clip(xn @ yn.T, -1, 1)),
        atol=atol,
    )
    k, m = 4, 6
    xs = x.reshape(-1, k, m) / np.linalg.norm(x.reshape(-1, k, m), axis=-1, keepdims=True)
    ys = y.reshape(-1, k, m) / np.linalg.norm(y.reshape(-1, k, m), axis=-1, keepdims=True)
    u, v = oblique.normalize(t(x, dtype), k), oblique.normalize(t(y, dtype), k)
    np.testing.assert_allclose(u.numpy(), xs.reshape(x.shape), atol=1e-6)
    np.testing.assert_allclose(
        oblique.pairwise_inner(u, v).numpy(), np.einsum("ikm,jkm->ij", xs, ys), atol=1e-5
    )
    geo = np.sqrt((np.arccos(np.clip(np.einsum("ikm,jkm->ijk", xs, ys), -1, 1)) ** 2).sum(-1))
    np.testing.assert_allclose(oblique.pairwise_geodesic(u, v, k).numpy(), geo, atol=atol)
    np.testing.assert_allclose(oblique.geodesic(u, v, k).numpy(), geo.diagonal(), atol=atol)
    with pytest.raises(ValueError, match="not divisible"):
        oblique.normalize(t(x), 5)


# ---------------------------------------------------------------- fp32 accuracy in the hard regimes
def _hard_regimes(n=48, dim=32):
    """Pairs rounded to fp32 (as float64): far apart with unequal norms, inside the cone, near-identical."""
    rng = np.random.default_rng(1)

    def unit():
        v = rng.normal(size=(n, dim))
        return v / np.linalg.norm(v, axis=-1, keepdims=True)

    def radius(lo, hi):
        return np.exp(rng.uniform(np.log(lo), np.log(hi), size=(n, 1)))

    x = unit() * radius(0.5, 3)
    perp = unit()
    perp -= (perp * x).sum(-1, keepdims=True) * x / (x * x).sum(-1, keepdims=True)
    perp /= np.linalg.norm(perp, axis=-1, keepdims=True)
    lam = radius(1.2, 20)
    near = unit() * radius(0.3, 3e4)
    out = {
        "far": (unit() * radius(0.3, 3), unit() * radius(1e2, 1e4)),
        "cone": (x, lam * x + perp * radius(1e-4, 1e-1) * lam * np.linalg.norm(x, axis=-1, keepdims=True)),
        "near": (near, near + unit() * radius(1e-6, 1e-2) * np.linalg.norm(near, axis=-1, keepdims=True)),
    }
    return {k: tuple(v.astype(np.float32).astype(np.float64) for v in pair) for k, pair in out.items()}


HARD = _hard_regimes()


def _meru_distance(x, y, c):  # MERU's / HYPE's form: acosh(-c<x,y>_L) from the product, in fp32
    xt, yt = torch.sqrt(1 / c + (x * x).sum(-1)), torch.sqrt(1 / c + (y * y).sum(-1))
    return torch.acosh(torch.clamp(c * (xt * yt - (x * y).sum(-1)), min=1 + 1e-8)) / c**0.5


def _meru_exterior_angle(x, y, c):  # MERU's oxy_angle, in fp32
    xt, yt = torch.sqrt(1 / c + (x * x).sum(-1)), torch.sqrt(1 / c + (y * y).sum(-1))
    L = c * ((x * y).sum(-1) - xt * yt)
    den = x.norm(dim=-1) * torch.sqrt(torch.clamp(L * L - 1, min=1e-8)) + 1e-8
    return torch.acos(torch.clamp((yt + L * xt) / den, -1 + 1e-8, 1 - 1e-8))


@pytest.mark.parametrize("regime", sorted(HARD))
@pytest.mark.parametrize("c", [0.1, 1.0])
def test_lorentz_rowwise_fp32_is_accurate_where_the_product_form_cancels(regime, c):
    x64, y64 = HARD[regime]
    x, y = t(x64), t(y64)
    ref_d, ref_ext = mp_dist(x64, y64, c), mp_ext(x64, y64, c)
    err_d = np.abs(lorentz.distance(x, y, c).numpy() / ref_d - 1)
    meru_d = np.abs(_meru_distance(x, y, c).numpy() / ref_d - 1)
    assert err_d.max() < 5e-7 and err_d.max() <= 1.5 * meru_d.max(), (err_d.max(), meru_d.max())
    err_ext = np.abs(lorentz.exterior_angle(x, y, c).numpy() - ref_ext)
    meru_ext = np.abs(_meru_exterior_angle(x, y, c).numpy() - ref_ext)
    assert err_ext.max() < 1e-6 and err_ext.max() <= 1.5 * meru_ext.max(), (err_ext.max(), meru_ext.max())
    if regime == "cone":  # MERU's acos form loses ~3 digits for small angles; the atan2 form does not
        assert (ref_ext < lorentz.half_aperture(x, c).numpy()).mean() > 0.5
        assert err_ext.max() < meru_ext.max() / 100
    # The pairwise form is MERU's matmul formula, and as accurate.
    xt, yt = torch.sqrt(1 / c + (x * x).sum(-1)), torch.sqrt(1 / c + (y * y).sum(-1))
    w = torch.clamp(c * (xt[:, None] * yt[None, :] - x @ y.T), min=1 + 1e-8)
    meru_pd = np.abs((torch.acosh(w) / c**0.5).diagonal().numpy() / ref_d - 1)
    pd = np.abs(lorentz.pairwise_distance(x, y, c).diagonal().numpy() / ref_d - 1)
    assert pd.max() <= 1.01 * meru_pd.max() + 1e-7, (pd.max(), meru_pd.max())


@pytest.mark.parametrize("regime", sorted(HARD))
@pytest.mark.parametrize("c", [0.1, 1.0])
def test_pairwise_exterior_angle_fp32_is_at_least_as_accurate_as_meru(regime, c):
    # The one-matmul angle hands the pairs it cannot resolve to the row-wise form, differentiably.
    x64, y64 = HARD[regime]
    x, y = t(x64).requires_grad_(), t(y64).requires_grad_()
    ref = mp_ext(x64, y64, c)
    pairwise = lorentz.pairwise_exterior_angle(x, y, c)
    ours = np.abs(pairwise.diagonal().detach().double().numpy() - ref)
    meru = np.abs(_meru_exterior_angle(x, y, c).detach().double().numpy() - ref)
    assert np.isfinite(ours).all() and ours.max() <= meru.max(), (ours.max(), meru.max())
    # A ceiling, not the contract (that is the line above): the matmul's summation order, and so the last
    # bits of a cosine, depends on the BLAS kernel the machine picks (1.5e-6 seen on a loaded CI runner).
    assert ours.max() < (5e-4 if regime == "cone" else 5e-6), (ours.max(), meru.max())
    pairwise.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(y.grad).all()


def _hype_energy(x, y, c):  # HYPE's E = oxy_angle - half_aperture (MERU's aperture form), in fp32
    aper = torch.asin(
        torch.clamp(2 * lorentz.DEFAULT_K / (x.norm(dim=-1) * c**0.5 + 1e-8), -1 + 1e-8, 1 - 1e-8)
    )
    return _meru_exterior_angle(x, y, c) - aper


def _kernel_energy(x, y, c):  # E(x_i -> y_i) as `hype score` computes it: the tiled kernel, pair by pair
    prep = lorentz.prepare
    return torch.cat(
        [
            lorentz.mean_entailment_energy(prep(x[i : i + 1], c), prep(y[i : i + 1], c), c, dim=1)
            for i in range(len(x))
        ]
    )


@pytest.mark.parametrize("regime", sorted(HARD))
@pytest.mark.parametrize("c", [0.1, 1.0])
def test_entailment_kernel_fp32_is_at_least_as_accurate_as_hype(regime, c):
    # The ε kernel gets the numerator of cos ext from its matmul and hands the pairs whose cosine is
    # ill-conditioned (near-identical points, angles near 0 or π) to the row-wise form.
    x64, y64 = HARD[regime]
    x, y = t(x64), t(y64)
    ref = mp_ext(x64, y64, c) - mp_aper(x64, c, lorentz.DEFAULT_K)
    ours = np.abs(_kernel_energy(x, y, c).double().numpy() - ref)
    hype = np.abs(_hype_energy(x, y, c).double().numpy() - ref)
    assert np.isfinite(ours).all() and ours.max() <= hype.max(), (ours.max(), hype.max())
    # Inside the cone the numerator itself cancels (y_t ~ λ x_t): both forms lose digits there, ours fewer.
    assert ours.max() < (5e-4 if regime == "cone" else 1e-6), (ours.max(), hype.max())


@pytest.mark.parametrize("dim", [0, 1])
def test_entailment_kernel_resolves_ill_conditioned_pairs_among_others(monkeypatch, dim):
    # Small tiles mixing ordinary pairs with near-identical ones, points deep inside a cone and norms of
    # 1e3; every mean matches the 50-digit reference, with and without the hinge.
    monkeypatch.setattr(lorentz, "CPU_TILE", (3, 5))
    rng = np.random.default_rng(4)
    x = rng.normal(size=(7, 8)) * 0.4
    y = np.concatenate(
        [x[:3] + 1e-5 * rng.normal(size=(3, 8)), 4 * x[3:5], rng.normal(size=(4, 8)), 1e3 * x[5:]]
    )
    x, y = x.astype(np.float32).astype(np.float64), y.astype(np.float32).astype(np.float64)
    xi, yj = np.repeat(x, len(y), axis=0), np.tile(y, (len(x), 1))
    energy = (mp_ext(xi, yj, 0.5) - mp_aper(xi, 0.5, lorentz.DEFAULT_K)).reshape(len(x), len(y))
    hype = _hype_energy(t(xi), t(yj), 0.5).double().numpy().reshape(len(x), len(y))
    apex, pts = lorentz.prepare(t(x), 0.5), lorentz.prepare(t(y), 0.5)
    for hinge in (False, True):
        ref = (np.maximum(energy, 0) if hinge else energy).mean(1 - dim)
        theirs = np.abs((np.maximum(hype, 0) if hinge else hype).mean(1 - dim) - ref).max()
        got = lorentz.mean_entailment_energy(apex, pts, 0.5, dim=1 - dim, hinge=hinge).double().numpy()
        assert np.abs(got - ref).max() < 1e-6 < theirs, (np.abs(got - ref).max(), theirs)


@pytest.mark.parametrize("regime", sorted(HARD))
def test_euclidean_and_sphere_rowwise_angles_are_accurate_near_0_and_pi(regime):
    x64, y64 = HARD[regime]
    x, y = t(x64), t(y64)
    assert np.abs(euclidean.exterior_angle(x, y).numpy() - mp_euc_ext(x64, y64)).max() < 5e-7
    assert np.abs(sphere.geodesic(x, y).numpy() - mp_sphere_geodesic(x64, y64)).max() < 5e-7
    u, v = oblique.normalize(x, 4), oblique.normalize(y, 4)
    assert torch.isfinite(oblique.geodesic(u, v, 4)).all()


def test_acos_margin_is_one_ulp_and_pairwise_angles_resolve_below_it():
    # The margin clamps the argument one fp32 ulp below 1 (acos 3.45e-4 rad) for the gradient only; the value
    # is acos of the cosine itself, so identical directions give 0 or a few ulps of the cosine's rounding
    # (the old 4-ulp margin floored every one at 9.8e-4).
    x = torch.randn(8, 16)
    y = x + 1e-5 * torch.randn(8, 16)
    geo = sphere.pairwise_geodesic(x, x.clone()).diagonal()
    assert geo.max() < 7e-4 and (geo < 3.5e-4).any(), geo
    one = torch.tensor(1.0)
    assert torch.tensor(1.0 - delta(torch.float32)) == torch.nextafter(one, torch.tensor(0.0))
    # Coincident points: the exterior angle is undefined; π/2 as in MERU, in every form.
    assert torch.allclose(lorentz.exterior_angle(x, x.clone(), 1.0), torch.full((8,), math.pi / 2))
    assert torch.allclose(euclidean.exterior_angle(x, x.clone()), torch.full((8,), math.pi / 2))
    for a, b in [(x, x.clone()), (x, y)]:
        a = a.clone().requires_grad_(True)
        sphere.pairwise_geodesic(a, b).sum().backward()
        assert torch.isfinite(a.grad).all() and a.grad.abs().max() < 1e4
    ref = mp_sphere_geodesic(x.double().numpy(), y.double().numpy())
    assert np.abs(sphere.geodesic(x, y).numpy() - ref).max() < 1e-7  # row-wise: no floor at all


def test_lorentz_rowwise_distance_keeps_the_difference_form_for_trained_embeddings():
    # Where the difference form loses at most one bit it is used as before, so scores keep their bits.
    x, y = t(points()), t(points())
    xt, yt = lorentz.time_component(x, 0.5), lorentz.time_component(y, 0.5)
    dt = ((x - y) * (x + y)).sum(-1) / (xt + yt)
    old = acosh1p(torch.clamp(0.5 * (((x - y) ** 2).sum(-1) - dt * dt) / 2.0, min=0.0)) / 0.5**0.5
    keep = 2 * dt * dt <= ((x - y) ** 2).sum(-1)
    assert keep.float().mean() > 0.9
    assert torch.equal(lorentz.distance(x, y, 0.5)[keep], old[keep])


# ---------------------------------------------------------------- edge cases: finite values and gradients
def _edge_inputs():
    zeros = torch.zeros(4, 16)
    x = torch.randn(4, 16)
    huge = x / x.norm(dim=-1, keepdim=True) * (2.0**15 / math.sqrt(0.1))
    tiny = x * 1e-20
    return {
        "zero-zero": (zeros, zeros.clone()),
        "zero-x": (zeros, x),
        "x-zero": (x, zeros),
        "identical": (x, x.clone()),
        "huge-identical": (huge, huge.clone()),
        "huge-x": (huge, x),
        "tiny-x": (tiny, x),
    }


LORENTZ_FNS = {
    "distance": lambda a, b: lorentz.distance(a, b, 0.1),
    "squared_distance": lambda a, b: lorentz.squared_distance(a, b, 0.1),
    "pairwise_distance": lambda a, b: lorentz.pairwise_distance(a, b, 0.1),
    "entailment_energy": lambda a, b: lorentz.entailment_energy(a, b, 0.1),
    "pairwise_entailment_energy": lambda a, b: lorentz.pairwise_entailment_energy(a, b, 0.1),
    "exp_map0": lambda a, b: lorentz.exp_map0(a, 0.1) + lorentz.exp_map0(b, 0.1),
    "log_map0": lambda a, b: lorentz.log_map0(a, 0.1) + lorentz.log_map0(b, 0.1),
    "euc_distance": euclidean.distance,
    "euc_pairwise_distance": euclidean.pairwise_distance,
    "euc_entailment": lambda a, b: euclidean.entailment_energy(a, b, 0.3),
    "euc_pairwise_entailment": lambda a, b: euclidean.pairwise_entailment_energy(a, b, 0.3),
    "cosine": sphere.cosine,
    "geodesic": sphere.pairwise_geodesic,
    "oblique_geodesic": lambda a, b: oblique.geodesic(oblique.normalize(a, 4), oblique.normalize(b, 4), 4),
}


@pytest.mark.parametrize("fn_name", sorted(LORENTZ_FNS))
@pytest.mark.parametrize("autocast", [False, True])
def test_outputs_and_gradients_finite_on_edge_cases(fn_name, autocast):
    fn = LORENTZ_FNS[fn_name]
    for case, (a, b) in _edge_inputs().items():
        if "huge" in case and fn_name.startswith(("euc", "cosine", "geodesic", "oblique")):
            a, b = a * 1e-3, b * 1e-3  # the clamp norm is a hyperbolic notion
        a = a.clone().requires_grad_(True)
        b = b.clone().requires_grad_(True)
        inputs = (a.bfloat16(), b.bfloat16()) if autocast else (a, b)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = fn(*inputs)
        assert out.dtype == torch.float32, (fn_name, case)
        assert torch.isfinite(out).all(), (fn_name, case, out)
        out.sum().backward()
        assert torch.isfinite(a.grad).all() and torch.isfinite(b.grad).all(), (fn_name, case)


def test_float64_inputs_compute_in_float64():
    x = torch.randn(3, 4, dtype=torch.float64)
    assert lorentz.distance(x, x.flip(0), 1.0).dtype == torch.float64
    assert (
        lorentz.distance(x.float(), x.flip(0).float(), torch.tensor(1.0, dtype=torch.float64)).dtype
        == torch.float64
    )


# ---------------------------------------------------------------- registry
def test_every_geometry_embeds_and_scores_consistently():
    feats_i, feats_t = torch.randn(6, 32), torch.randn(5, 32)
    for name in GEOMETRIES:
        g = get_geometry(name, num_spheres=4) if name == "oblique" else get_geometry(name)
        kw = {"curv": torch.tensor(0.5)} if g.uses_curvature else {}
        alpha = torch.tensor(32**-0.5) if g.uses_alpha else None
        ei, et = g.embed(feats_i, alpha=alpha, **kw), g.embed(feats_t, alpha=alpha, **kw)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert g.embed(feats_i.bfloat16(), alpha=alpha, **kw).dtype == torch.float32, name
        logits = g.pairwise(ei, et, **kw)
        assert logits.shape == (6, 5) and torch.isfinite(logits).all(), name
        torch.testing.assert_close(
            g.pairwise(ei[:5], et, **kw).diagonal(), g.rowwise(ei[:5], et, **kw), atol=3e-3, rtol=1e-3
        )
        assert g.name == name
        if g.supports_entailment:
            assert g.entailment_energy(et, ei[:5], **kw).shape == (5,)
        else:
            with pytest.raises(ValueError, match="no entailment"):
                g.entailment_energy(et, ei[:5], **kw)
    assert get_geometry("oblique", num_spheres=16).logit_scale_max == pytest.approx(100 / 16)
    assert get_geometry("oblique", num_spheres=16).logit_scale_init == pytest.approx(100 / 16)
    assert get_geometry("oblique", num_spheres=2).logit_scale_init == pytest.approx(1 / 0.07)
    assert get_geometry("euclidean-squared").logit_scale_init == 1.0
    with pytest.raises(ValueError, match="unknown geometry 'poincare'"):
        get_geometry("poincare")


def test_prompt_ensembles_stay_on_the_manifold_and_average_correctly():
    prompts = torch.randn(3, 5, 16)  # 3 classes x 5 templates
    for name in GEOMETRIES:
        g = get_geometry(name, num_spheres=4) if name == "oblique" else get_geometry(name)
        kw = {"curv": 0.5} if g.uses_curvature else {}
        emb = g.embed(prompts, **kw)
        ens = g.ensemble(emb, **kw)
        assert ens.shape == (3, 16) and torch.isfinite(ens).all(), name
        # A set of identical members ensembles to that member.
        torch.testing.assert_close(
            g.ensemble(emb[:, :1].expand(3, 4, 16), **kw), emb[:, 0], atol=1e-5, rtol=1e-5
        )
    clip = get_geometry("clip").ensemble(get_geometry("clip").embed(prompts))
    torch.testing.assert_close(clip.norm(dim=-1), torch.ones(3))
    ob = get_geometry("oblique", num_spheres=4).ensemble(
        get_geometry("oblique", num_spheres=4).embed(prompts)
    )
    torch.testing.assert_close(ob.reshape(3, 4, 4).norm(dim=-1), torch.ones(3, 4))
    # Hyperbolic: the mean of the tangent vectors, lifted (MERU's zero-shot classifier).
    hyp = get_geometry("hyperbolic")
    v = torch.randn(3, 5, 16, dtype=torch.float64) * 0.3
    expected = lorentz.exp_map0(v.mean(-2), 0.5)
    torch.testing.assert_close(hyp.ensemble(lorentz.exp_map0(v, 0.5), curv=0.5), expected)
