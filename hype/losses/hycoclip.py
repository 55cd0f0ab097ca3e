"""HyCoCLIP's loss (Pal et al., ICLR 2025; SPEC §2.6): MERU's contrastive and entailment terms over whole
pairs and over one grounded box per pair.

Each row i of a batch carries its whole pair (I_i, T_i) and one box of it: the crop of the image around a
grounded object (I_b,i) and that object's noun phrase (T_b,i). The box is the more generic concept, so it
is the apex: the whole image lies in its box's cone (intra-modal), as the caption lies in its phrase's;
across modalities the text is the apex of the image, at both levels. With logits −s·d_L:

    contrastive = ¼ [CE(I → T_all) + CE(T → I_all) + CE(I_b → T_all) + CE(T_b → I_all)]
    entailment  = ½ [E(T, I; 0.7) + E(T_b, I_b; 0.7) + E(I_b, I; 1.2) + E(T_b, T; 1.2)]
    E(x, y; m)  = mean relu(ext(x, y) − m · aper(x))
    loss        = contrastive + w · entailment

Box rows are matched to their whole pair's column (the authors' code): a box is contrasted with the whole
texts or images of the global batch, never with other boxes.

The model sees the whole and the box rows in one forward pass, stacked (`[wholes; boxes]`, 2B rows);
this loss splits them again, so the training step stays the one every other loss uses. `box_mask` (B,),
set per step, marks the rows that have a box: the others (a sample without grounding, trained on its
whole pair only) carry a placeholder box row that every box term leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hype.geometry import Geometry, lorentz
from hype.geometry.registry import Hyperbolic
from hype.losses.distributed import gather_with_grad, world

Tensor = torch.Tensor


def _split(x: Tensor) -> tuple[Tensor, Tensor]:
    if x.shape[0] % 2:
        raise ValueError(f"HyCoCLIP batches stack wholes and boxes (2B rows), got {x.shape[0]} rows")
    return x.chunk(2)


def _cone_violation(apex: Tensor, point: Tensor, curv: Tensor | float, K: float, scale: float) -> Tensor:
    """mean relu(ext(apex, point) - scale * aper(apex)); 0 over no rows."""
    if apex.shape[0] == 0:
        return apex.new_zeros(())
    angle = lorentz.exterior_angle(apex, point, curv)
    return torch.clamp(angle - scale * lorentz.half_aperture(apex, curv, K), min=0.0).mean()


@dataclass
class HyCoCLIPLoss:
    """Call with the model's forward output over `[wholes; boxes]`; returns the total and each term."""

    geometry: Geometry
    entailment_weight: float = 0.2
    K: float | None = None
    inter_aperture: float = 0.7  # text ⊃ image, at both levels
    intra_aperture: float = 1.2  # box ⊃ whole, in each modality
    box_mask: Tensor | None = None  # (B,) bool: rows with a box (None: all)

    def __post_init__(self) -> None:
        if not isinstance(self.geometry, Hyperbolic):
            raise ValueError(
                f"HyCoCLIP's loss needs the hyperbolic geometry (MERU's towers), got {self.geometry.name!r}"
            )
        if self.entailment_weight < 0 or self.inter_aperture <= 0 or self.intra_aperture <= 0:
            raise ValueError("entailment_weight must be >= 0 and the aperture scales > 0")

    def __call__(self, out: dict) -> dict[str, Tensor]:
        curv, scale = out["curv"], out["logit_scale"]
        image, box_image = _split(out["image"])
        text, box_text = _split(out["text"])
        rank, _ = world()
        all_images, all_texts = gather_with_grad(image), gather_with_grad(text)
        labels = torch.arange(image.shape[0], device=image.device) + rank * image.shape[0]
        keep = self.box_mask
        if keep is not None:
            keep = keep.to(image.device)
            box_image, box_text, box_labels = box_image[keep], box_text[keep], labels[keep]
            whole_image, whole_text = image[keep], text[keep]
        else:
            box_labels, whole_image, whole_text = labels, image, text

        def ce_image(rows: Tensor, target: Tensor) -> Tensor:
            if rows.shape[0] == 0:
                return rows.new_zeros(())
            return F.cross_entropy(scale * self.geometry.pairwise(rows, all_texts, curv=curv), target)

        def ce_text(rows: Tensor, target: Tensor) -> Tensor:
            if rows.shape[0] == 0:
                return rows.new_zeros(())
            return F.cross_entropy(scale * self.geometry.pairwise(all_images, rows, curv=curv).T, target)

        contrastive = (
            ce_image(image, labels)
            + ce_text(text, labels)
            + ce_image(box_image, box_labels)
            + ce_text(box_text, box_labels)
        ) / 4
        K = self.K if self.K is not None else lorentz.DEFAULT_K
        inter, intra = self.inter_aperture, self.intra_aperture
        entailment = (
            _cone_violation(text, image, curv, K, inter)
            + _cone_violation(box_text, box_image, curv, K, inter)
            + _cone_violation(box_image, whole_image, curv, K, intra)
            + _cone_violation(box_text, whole_text, curv, K, intra)
        ) / 2
        return {
            "loss": contrastive + self.entailment_weight * entailment,
            "contrastive": contrastive,
            "entailment": entailment,
        }
