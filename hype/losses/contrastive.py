"""Symmetric InfoNCE with any geometry's logit, over the global batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hype.geometry import Geometry
from hype.losses.distributed import gather_with_grad, world

Tensor = torch.Tensor


def contrastive_loss(
    images: Tensor,
    texts: Tensor,
    geometry: Geometry,
    logit_scale: Tensor | float,
    *,
    curv: Tensor | float | None = None,
) -> Tensor:
    """Mean of image->text and text->image cross-entropy with logits `scale * geometry.pairwise`.

    Local rows are scored against columns gathered from every rank; the positive of local row i sits at
    column rank * B + i. On one process this is the ordinary CLIP loss.
    """
    rank, _ = world()
    all_images, all_texts = gather_with_grad(images), gather_with_grad(texts)
    labels = torch.arange(images.shape[0], device=images.device) + rank * images.shape[0]
    logits_per_image = logit_scale * geometry.pairwise(images, all_texts, curv=curv)
    logits_per_text = logit_scale * geometry.pairwise(all_images, texts, curv=curv).T
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2
