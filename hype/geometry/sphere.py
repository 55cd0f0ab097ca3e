"""The unit sphere: CLIP's cosine and the elliptic (great-circle) distance of EuCLIP. DESIGN §2.2."""

from __future__ import annotations

import torch

from hype.geometry._numerics import Tensor, acos_resolved, geometry_op, safe_norm

NORM_FLOOR = 1e-12  # a zero vector normalizes to zero instead of NaN


@geometry_op
def normalize(x: Tensor) -> Tensor:
    """x / |x| over the last dim (zero stays zero)."""
    return x / torch.clamp(safe_norm(x), min=NORM_FLOOR)[..., None]


@geometry_op
def cosine(x: Tensor, y: Tensor) -> Tensor:
    """Row-wise cos θ of (not necessarily normalized) x and y."""
    return (normalize(x) * normalize(y)).sum(-1)


@geometry_op
def pairwise_cosine(x: Tensor, y: Tensor) -> Tensor:
    return normalize(x) @ normalize(y).T


@geometry_op
def geodesic(x: Tensor, y: Tensor) -> Tensor:
    """Row-wise great-circle distance θ ∈ [0, π] between the directions of x and y, to a few ulps also
    for near-identical and antipodal directions (`euclidean.vector_angle`); π/2 for a zero vector."""
    from hype.geometry.euclidean import vector_angle  # euclidean imports nothing from here

    return vector_angle(x, y)


@geometry_op
def pairwise_geodesic(x: Tensor, y: Tensor) -> Tensor:
    return acos_resolved(pairwise_cosine(x, y))
