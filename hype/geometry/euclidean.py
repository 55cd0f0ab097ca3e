"""Euclidean space (EuCLIP): distances and the Euclidean entailment cone. SPEC §2.2.

Entailment (Ganea et al., as modified by EuCLIP): aper(x) = asin(min(1, K/|x|)),
ext(x, y) = acos((y - x)·x / (|y - x| |x|)), E = ext - aper. EuCLIP uses K = 0.3.
"""

from __future__ import annotations

import math

import torch

from hype.geometry._numerics import Tensor, geometry_op, safe_div, safe_norm, safe_sqrt, sq_norm, unit_clamp

DEFAULT_K = 0.3


@geometry_op
def distance(x: Tensor, y: Tensor) -> Tensor:
    """Row-wise |x - y|, with a zero gradient (not NaN) at x == y."""
    return safe_norm(x - y)


@geometry_op
def squared_distance(x: Tensor, y: Tensor) -> Tensor:
    return sq_norm(x - y)


@geometry_op
def pairwise_squared_distance(x: Tensor, y: Tensor) -> Tensor:
    """|x_i - y_j|^2 for all pairs via one matmul, clamped at 0 against cancellation."""
    return torch.clamp(sq_norm(x)[:, None] + sq_norm(y)[None, :] - 2.0 * (x @ y.T), min=0.0)


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
    """Row-wise π - angle Oxy: the angle between x and y - x."""
    d = y - x
    return torch.acos(unit_clamp(safe_div((d * x).sum(-1), safe_norm(d) * safe_norm(x))))


@geometry_op
def pairwise_exterior_angle(x: Tensor, y: Tensor) -> Tensor:
    """Exterior angle at apex x_i towards point y_j, shape (N, M)."""
    num = x @ y.T - sq_norm(x)[:, None]  # (y - x)·x
    den = pairwise_distance(x, y) * safe_norm(x)[:, None]
    return torch.acos(unit_clamp(safe_div(num, den)))


@geometry_op
def entailment_energy(x: Tensor, y: Tensor, K: float = DEFAULT_K) -> Tensor:
    return exterior_angle(x, y) - half_aperture(x, K)


@geometry_op
def pairwise_entailment_energy(x: Tensor, y: Tensor, K: float = DEFAULT_K) -> Tensor:
    return pairwise_exterior_angle(x, y) - half_aperture(x, K)[:, None]


@geometry_op
def entailment_loss(x: Tensor, y: Tensor, K: float = DEFAULT_K) -> Tensor:
    return torch.clamp(entailment_energy(x, y, K), min=0.0)
