"""Lorentz model of hyperbolic space with curvature -c (MERU, HYPE). SPEC §2.1.

Points are stored by their space components x ∈ R^n; the time component x_t = sqrt(1/c + |x|^2) is
derived. Every function has a row-wise form (x[i] with y[i], broadcasting over leading dims) and a
`pairwise_` form (every row of x with every row of y, shape (N, M)) that runs as one matrix product.

Two formulations, on purpose:
- Row-wise forms use z = -c<x,y>_L - 1 computed from differences,
  z = c (|x-y|^2 - (x_t-y_t)^2) / 2 with x_t - y_t = (x-y)·(x+y) / (x_t+y_t),
  so d(x, x) vanishes (<= 1e-15) and its error shrinks with |x - y| even at norms near the 2^15 clamp.
- Pairwise forms use z = c (x_t y_t - x·y) - 1 from one matmul. Its absolute error is about
  c |x| |y| eps, fine for trained embeddings (|x| of a few units) but not for identical points at huge
  norms; use the row-wise form there.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from hype.geometry._numerics import (
    SINH_MAX,
    TINY,
    Tensor,
    acosh1p,
    delta,
    geometry_op,
    safe_div,
    safe_norm,
    safe_sqrt,
    sq_norm,
    unit_clamp,
)

DEFAULT_K = 0.1  # MERU's minimum-radius constant of the entailment cone

Curv = float | Tensor


@geometry_op
def time_component(x: Tensor, curv: Curv) -> Tensor:
    """x_t = sqrt(1/c + |x|^2), shape x.shape[:-1]."""
    return torch.sqrt(1.0 / curv + sq_norm(x))


@geometry_op
def inner(x: Tensor, y: Tensor, curv: Curv) -> Tensor:
    """Row-wise Lorentz inner product <x,y>_L = x·y - x_t y_t (<= -1/c on the manifold)."""
    return (x * y).sum(-1) - time_component(x, curv) * time_component(y, curv)


@geometry_op
def pairwise_inner(x: Tensor, y: Tensor, curv: Curv) -> Tensor:
    """<x_i, y_j>_L for all pairs, shape (N, M)."""
    return x @ y.T - time_component(x, curv)[:, None] * time_component(y, curv)[None, :]


def _rowwise_z(x: Tensor, y: Tensor, curv: Curv) -> Tensor:
    """z = -c<x,y>_L - 1 >= 0, from differences so that it is exactly 0 when x == y."""
    xt, yt = time_component(x, curv), time_component(y, curv)
    dt = ((x - y) * (x + y)).sum(-1) / (xt + yt)
    return torch.clamp(curv * (sq_norm(x - y) - dt * dt) / 2.0, min=0.0)


def _pairwise_z(x: Tensor, y: Tensor, curv: Curv) -> Tensor:
    return torch.clamp(-curv * pairwise_inner(x, y, curv) - 1.0, min=0.0)


@geometry_op
def distance(x: Tensor, y: Tensor, curv: Curv) -> Tensor:
    """Row-wise geodesic distance d_L = acosh(-c<x,y>_L) / sqrt(c)."""
    return acosh1p(_rowwise_z(x, y, curv)) / curv**0.5


@geometry_op
def pairwise_distance(x: Tensor, y: Tensor, curv: Curv) -> Tensor:
    """d_L(x_i, y_j) for all pairs, shape (N, M)."""
    return acosh1p(_pairwise_z(x, y, curv)) / curv**0.5


@geometry_op
def squared_distance(x: Tensor, y: Tensor, curv: Curv) -> Tensor:
    return distance(x, y, curv) ** 2


@geometry_op
def pairwise_squared_distance(x: Tensor, y: Tensor, curv: Curv) -> Tensor:
    return pairwise_distance(x, y, curv) ** 2


@geometry_op
def exp_map0(v: Tensor, curv: Curv) -> Tensor:
    """Exponential map at the origin: tangent vector v -> space components sinh(√c|v|)/(√c|v|) · v.

    The sinh argument is clamped at asinh(2^15) (MERU), so |x| <= 2^15/√c; v = 0 maps to 0 with an
    identity Jacobian.
    """
    r = curv**0.5 * safe_norm(v)
    return (torch.sinh(torch.clamp(r, max=SINH_MAX)) / r)[..., None] * v


@geometry_op
def log_map0(x: Tensor, curv: Curv) -> Tensor:
    """Logarithmic map at the origin (inverse of `exp_map0` below its clamp): asinh(√c|x|)/(√c|x|) · x."""
    r = curv**0.5 * safe_norm(x)
    return (torch.asinh(r) / r)[..., None] * x


@geometry_op
def half_aperture(x: Tensor, curv: Curv, K: float = DEFAULT_K) -> Tensor:
    """aper(x) = asin(min(1, 2K / (√c |x|))); exactly π/2 (with zero gradient) inside radius 2K/√c."""
    s = 2.0 * K / (curv**0.5 * safe_norm(x))
    return torch.where(s >= 1.0, torch.full_like(s, math.pi / 2), torch.asin(unit_clamp(s)))


def _exterior_from_z(xt: Tensor, yt: Tensor, xnorm: Tensor, z: Tensor) -> Tensor:
    # With c<x,y>_L = -(1 + z):  numerator y_t + x_t c<x,y>_L = y_t - x_t (1 + z),
    # and (c<x,y>_L)^2 - 1 = z (z + 2) without cancellation.
    num = yt - xt * (1.0 + z)
    den = xnorm * safe_sqrt(z * (z + 2.0))
    return torch.acos(unit_clamp(safe_div(num, den)))


@geometry_op
def exterior_angle(x: Tensor, y: Tensor, curv: Curv) -> Tensor:
    """Row-wise exterior angle at x of the triangle O-x-y (π minus the angle Oxy)."""
    z = _rowwise_z(x, y, curv)
    return _exterior_from_z(time_component(x, curv), time_component(y, curv), safe_norm(x), z)


@geometry_op
def pairwise_exterior_angle(x: Tensor, y: Tensor, curv: Curv) -> Tensor:
    """Exterior angle at x_i towards y_j for all pairs, shape (N, M): x are apexes, y points."""
    z = _pairwise_z(x, y, curv)
    xt, yt = time_component(x, curv), time_component(y, curv)
    return _exterior_from_z(xt[:, None], yt[None, :], safe_norm(x)[:, None], z)


@geometry_op
def entailment_energy(x: Tensor, y: Tensor, curv: Curv, K: float = DEFAULT_K) -> Tensor:
    """E(x -> y) = ext(x, y) - aper(x), row-wise; negative when y lies inside x's cone."""
    return exterior_angle(x, y, curv) - half_aperture(x, curv, K)


@geometry_op
def pairwise_entailment_energy(x: Tensor, y: Tensor, curv: Curv, K: float = DEFAULT_K) -> Tensor:
    """E(x_i -> y_j) for all pairs, shape (N, M)."""
    return pairwise_exterior_angle(x, y, curv) - half_aperture(x, curv, K)[:, None]


@geometry_op
def entailment_loss(x: Tensor, y: Tensor, curv: Curv, K: float = DEFAULT_K) -> Tensor:
    """Row-wise MERU entailment loss L_e = max(0, E(x -> y))."""
    return torch.clamp(entailment_energy(x, y, curv, K), min=0.0)


# ---------------------------------------------------------------- inference-time reductions
class PreparedPoints(NamedTuple):
    """Per-point quantities of `mean_entailment_energy`, computed once for a reused set (references)."""

    x: Tensor  # space components, compute dtype
    t: Tensor  # time components
    norm: Tensor  # |x|, floored so no quotient is 0/0
    aper: Tensor  # half-aperture


@torch.no_grad()
@geometry_op
def prepare(x: Tensor, curv: Curv, K: float = DEFAULT_K) -> PreparedPoints:
    return PreparedPoints(x, time_component(x, curv), safe_norm(x), half_aperture(x, curv, K))


@torch.no_grad()
def mean_entailment_energy(
    apex: PreparedPoints, points: PreparedPoints, curv: Curv, *, dim: int, hinge: bool = False
) -> Tensor:
    """Mean over `dim` of E(apex_i -> point_j) (or of max(0, E) with `hinge`), for all pairs.

    The same formula as `pairwise_entailment_energy`, arranged for inference on large (N, M) blocks:
    -c<x,y>_L comes out of one matmul plus a rank-1 update, the epilogue runs in place on that one
    buffer, and without the hinge the aperture leaves the loop (mean(ext - aper) = mean(ext) - mean(aper)).
    No autograd; use the pairwise functions for training.
    """
    with torch.autocast(device_type=apex.x.device.type, enabled=False):
        c = float(curv)
        w = (-c * apex.x) @ points.x.T  # w = 1 + z = -c<x,y>_L
        w.addr_(apex.t, points.t, alpha=c)
        num = torch.addcmul(points.t[None, :], apex.t[:, None], w, value=-1.0)  # y_t - x_t (1 + z)
        den = w.mul_(w).sub_(1.0).clamp_(min=TINY).sqrt_().mul_(apex.norm[:, None])  # |x| sqrt(z(z+2))
        d = delta(num.dtype)
        ext = num.div_(den).clamp_(-1.0 + d, 1.0 - d).acos_()
        if hinge:
            return ext.sub_(apex.aper[:, None]).clamp_(min=0.0).mean(dim)
        aper = apex.aper.mean() if dim == 0 else apex.aper
        return ext.mean(dim) - aper
