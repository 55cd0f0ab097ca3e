"""Euclidean space (EuCLIP): distances and the Euclidean entailment cone. DESIGN §2.2.

Entailment (Ganea et al., as modified by EuCLIP): aper(x) = asin(min(1, K/|x|)),
ext(x, y) = acos((y - x)·x / (|y - x| |x|)), E = ext - aper. EuCLIP uses K = 0.3.
"""

from __future__ import annotations

import math

import torch

from hype.geometry._numerics import (
    Tensor,
    acos_resolved,
    angle_from,
    geometry_op,
    safe_div,
    safe_norm,
    safe_sqrt,
    scaled_gap,
    sq_norm,
    unit_clamp,
)

DEFAULT_K = 0.3


@geometry_op
def distance(x: Tensor, y: Tensor) -> Tensor:
    """Row-wise |x - y|, with a zero gradient (not NaN) at x == y (torch's norm masks it)."""
    return torch.linalg.vector_norm(x - y, dim=-1)


@geometry_op
def squared_distance(x: Tensor, y: Tensor) -> Tensor:
    return sq_norm(x - y)


@geometry_op
def pairwise_squared_distance(x: Tensor, y: Tensor) -> Tensor:
    """|x_i - y_j|^2 for all pairs via one matmul, clamped at 0 against cancellation.

    Summed as (|x|^2 - 2 x·y) + |y|^2 (EuCLIP's order, the first sum fused into the matmul): the first
    partial sum is the smaller one for near-identical pairs and for a point far beyond another.
    """
    return torch.clamp(torch.addmm(sq_norm(x)[:, None], x, y.T, alpha=-2.0) + sq_norm(y)[None, :], min=0.0)


@geometry_op
def pairwise_distance(x: Tensor, y: Tensor) -> Tensor:
    return safe_sqrt(pairwise_squared_distance(x, y))


@geometry_op
def half_aperture(x: Tensor, K: float = DEFAULT_K) -> Tensor:
    """asin(min(1, K/|x|)); exactly π/2 with zero gradient inside radius K."""
    s = K / safe_norm(x)
    return torch.where(s >= 1.0, torch.full_like(s, math.pi / 2), torch.asin(unit_clamp(s)))


@geometry_op
def exterior_angle(x: Tensor, y: Tensor) -> Tensor:
    """Row-wise π - angle Oxy: the angle between x and y - x, to a few ulps (π/2 if either vanishes)."""
    return vector_angle(x, y - x)


def vector_angle(u: Tensor, v: Tensor) -> Tensor:
    """The angle between u and v, to about one ulp; π/2 if either vector vanishes.

    acos of the cosine where |cos| <= 1/2 (there it is the most accurate form), elsewhere
    2 atan2(||v|u - |u|v|, ||v|u + |u|v|) (Kahan), which keeps full accuracy near 0 and π where acos has
    only sqrt(eps) resolution.
    """
    a, b = safe_norm(u), safe_norm(v)
    cos = (u * v).sum(-1) / (a * b)
    gap, _ = scaled_gap(u, v, a, b)
    kahan = 2.0 * angle_from(safe_norm(gap), safe_norm(b[..., None] * u + a[..., None] * v))
    return torch.where(cos.abs() <= 0.5, torch.acos(torch.clamp(cos, -0.5, 0.5)), kahan)


@geometry_op
def pairwise_exterior_angle(x: Tensor, y: Tensor) -> Tensor:
    """Exterior angle at apex x_i towards point y_j, shape (N, M)."""
    num = x @ y.T - sq_norm(x)[:, None]  # (y - x)·x
    den = pairwise_distance(x, y) * safe_norm(x)[:, None]
    return acos_resolved(safe_div(num, den))


@geometry_op
def entailment_energy(x: Tensor, y: Tensor, K: float = DEFAULT_K) -> Tensor:
    return exterior_angle(x, y) - half_aperture(x, K)


@geometry_op
def pairwise_entailment_energy(x: Tensor, y: Tensor, K: float = DEFAULT_K) -> Tensor:
    return pairwise_exterior_angle(x, y) - half_aperture(x, K)[:, None]


@geometry_op
def entailment_loss(x: Tensor, y: Tensor, K: float = DEFAULT_K) -> Tensor:
    return torch.clamp(entailment_energy(x, y, K), min=0.0)
