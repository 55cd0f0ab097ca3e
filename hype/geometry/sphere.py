"""The unit sphere: CLIP's cosine and the elliptic (great-circle) distance of EuCLIP. SPEC §2.2."""

from __future__ import annotations

import torch

from hype.geometry._numerics import Tensor, geometry_op, safe_norm, unit_clamp

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
    """Row-wise great-circle distance arccos(cos θ) ∈ [0, π]."""
    return torch.acos(unit_clamp(cosine(x, y)))


@geometry_op
def pairwise_geodesic(x: Tensor, y: Tensor) -> Tensor:
    return torch.acos(unit_clamp(pairwise_cosine(x, y)))
