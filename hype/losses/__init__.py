"""Training losses: global-batch InfoNCE for every geometry plus the entailment term."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hype.geometry import Geometry
from hype.losses.contrastive import contrastive_loss
from hype.losses.distributed import gather_with_grad, world
from hype.losses.entailment import entailment_loss

__all__ = ["ContrastiveEntailmentLoss", "contrastive_loss", "entailment_loss", "gather_with_grad", "world"]


@dataclass
class ContrastiveEntailmentLoss:
    """L = L_cont + λ L_entail (λ = 0 disables the entailment term).

    Call it with the model's forward output `{"image", "text", "logit_scale", "curv"}`; returns the
    total and each term (detached copies of the terms are for logging).
    """

    geometry: Geometry
    entailment_weight: float = 0.0
    K: float | None = None

    def __post_init__(self) -> None:
        if self.entailment_weight < 0:
            raise ValueError(f"entailment_weight must be >= 0, got {self.entailment_weight}")
        if self.entailment_weight > 0 and not self.geometry.supports_entailment:
            raise ValueError(
                f"geometry {self.geometry.name!r} has no entailment cones; set entailment_weight to 0"
            )

    def __call__(self, out: dict) -> dict[str, torch.Tensor]:
        curv = out.get("curv")
        cont = contrastive_loss(out["image"], out["text"], self.geometry, out["logit_scale"], curv=curv)
        terms = {"contrastive": cont}
        total = cont
        if self.entailment_weight > 0:
            ent = entailment_loss(out["text"], out["image"], self.geometry, curv=curv, K=self.K)
            terms["entailment"] = ent
            total = total + self.entailment_weight * ent
        return {"loss": total, **terms}
