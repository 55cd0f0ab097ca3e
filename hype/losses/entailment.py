"""Entailment loss over local pairs: the text is the apex, its paired image the point."""

from __future__ import annotations

import torch

from hype.geometry import Geometry

Tensor = torch.Tensor


def entailment_loss(
    texts: Tensor,
    images: Tensor,
    geometry: Geometry,
    *,
    curv: Tensor | float | None = None,
    K: float | None = None,
) -> Tensor:
    """mean_i max(0, ext(t_i, v_i) - aper(t_i)) for the geometries with entailment cones."""
    energy = geometry.entailment_energy(texts, images, curv=curv, K=K)
    return torch.clamp(energy, min=0.0).mean()
