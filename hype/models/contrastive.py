"""`ContrastiveModel`: two open_clip towers, a geometry and the learnable scalars. DESIGN §2.1–2.2.

The model produces embeddings on the geometry's manifold and the pre-scale logits between them; the
losses live in `hype.losses`. Scalars follow MERU: stored as logs in fp32 and clamped in place (the
parameter data, under no_grad) at the start of every `forward`, so the optimizer state stays
consistent and gradients keep flowing through `exp`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from open_clip.tokenizer import SimpleTokenizer
from open_clip.transform import AugmentationCfg, image_transform
from torch import nn

from hype.geometry import Geometry, get_geometry
from hype.models.config import ModelConfig
from hype.models.towers import build_image_tower, build_text_tower

Tensor = torch.Tensor


def _log_param(value: float, requires_grad: bool = True) -> nn.Parameter:
    return nn.Parameter(torch.tensor(math.log(value), dtype=torch.float32), requires_grad=requires_grad)


def _log_bound(value: float | None) -> float | None:
    # Round the bound to fp32 like the parameter itself: with a float64 bound, a parameter initialized
    # at the bound (oblique's default logit scale) could sit one fp32 rounding above it forever, and
    # the clamp in the properties would then zero its gradient.
    return None if value is None else float(np.float32(math.log(value)))


class ContrastiveModel(nn.Module):
    """Image and text encoders whose outputs are embedded by `config.geometry`.

    Attributes: `visual` (image tower), `text` (text tower), `geometry`, `config`, and the fp32
    log-scalars `log_logit_scale` and, for hyperbolic geometries, `log_curv`, `log_alpha_img`,
    `log_alpha_txt` (None otherwise).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.geometry: Geometry = get_geometry(config.geometry, **config.geometry_options)
        self.visual = build_image_tower(config)
        self.text = build_text_tower(config)

        s = config.scalars
        self.log_logit_scale = _log_param(s.logit_scale_init)
        self._logit_scale_bounds = (None, _log_bound(s.logit_scale_max))
        if self.geometry.uses_curvature:
            self.log_curv = _log_param(s.curv_init, requires_grad=s.learn_curv)
            self._curv_bounds = (_log_bound(s.curv_min), _log_bound(s.curv_max))
        else:
            self.register_parameter("log_curv", None)
        if self.geometry.uses_alpha:
            self.log_alpha_img = _log_param(s.alpha_init)
            self.log_alpha_txt = _log_param(s.alpha_init)
            self._alpha_bounds = (None, _log_bound(s.alpha_max))
        else:
            self.register_parameter("log_alpha_img", None)
            self.register_parameter("log_alpha_txt", None)
        self._tokenizer: SimpleTokenizer | None = None

    # --- scalars --------------------------------------------------------------------------------

    def _scalars(self) -> list[tuple[nn.Parameter, tuple[float | None, float | None]]]:
        out = [(self.log_logit_scale, self._logit_scale_bounds)]
        if self.log_curv is not None:
            out.append((self.log_curv, self._curv_bounds))
        if self.log_alpha_img is not None:
            out += [(self.log_alpha_img, self._alpha_bounds), (self.log_alpha_txt, self._alpha_bounds)]
        return out

    @torch.no_grad()
    def clamp_scalars_(self) -> None:
        """Clamp the log-scalars' data into their bounds in place (MERU); `forward` calls this first."""
        for param, (lo, hi) in self._scalars():
            param.clamp_(min=lo, max=hi)

    @staticmethod
    def _exp(param: Tensor, bounds: tuple[float | None, float | None]) -> Tensor:
        # The value is clamped even when the model is used without `forward` (scoring right after an
        # optimizer step), but the gradient is the identity, as in MERU where only the data is clamped:
        # torch.clamp would zero the gradient at the bound and pin a scalar there (curvature often
        # reaches its lower bound and must be able to leave it). Inside the bounds this is exactly exp.
        clamped = torch.clamp(param, min=bounds[0], max=bounds[1])
        return (param + (clamped - param).detach()).exp()

    @property
    def logit_scale(self) -> Tensor:
        return self._exp(self.log_logit_scale, self._logit_scale_bounds)

    @property
    def curv(self) -> Tensor | None:
        return None if self.log_curv is None else self._exp(self.log_curv, self._curv_bounds)

    @property
    def alpha_img(self) -> Tensor | None:
        return None if self.log_alpha_img is None else self._exp(self.log_alpha_img, self._alpha_bounds)

    @property
    def alpha_txt(self) -> Tensor | None:
        return None if self.log_alpha_txt is None else self._exp(self.log_alpha_txt, self._alpha_bounds)

    # --- encoders -------------------------------------------------------------------------------

    def _embed(self, features: Tensor, alpha: Tensor | None) -> Tensor:
        # Under mixed precision the towers return fp16/bf16; the lift onto the manifold (|x|², sinh)
        # must run in fp32 (DESIGN §2.1), so cast up and keep autocast off for the whole step.
        if features.dtype not in (torch.float32, torch.float64):
            features = features.float()
        with torch.autocast(device_type=features.device.type, enabled=False):
            return self.geometry.embed(features, curv=self.curv, alpha=alpha)

    def encode_image(self, images: Tensor) -> Tensor:
        """Images (B, 3, H, W), normalized by `preprocess` -> embeddings (B, embed_dim) on the manifold."""
        return self._embed(self.visual(images), self.alpha_img)

    def encode_text(self, tokens: Tensor) -> Tensor:
        """Token ids (B, L <= context_length) from `tokenizer()` -> embeddings (B, embed_dim)."""
        return self._embed(self.text(tokens), self.alpha_txt)

    def similarity(self, image_emb: Tensor, text_emb: Tensor) -> Tensor:
        """Pre-scale logits (N_img, N_txt): cos θ, -d_L, -|x-y|², ... depending on the geometry."""
        return self.geometry.pairwise(image_emb, text_emb, curv=self.curv)

    def forward(self, images: Tensor, tokens: Tensor) -> dict[str, Any]:
        self.clamp_scalars_()
        return {
            "image": self.encode_image(images),
            "text": self.encode_text(tokens),
            "logit_scale": self.logit_scale,
            "curv": self.curv,
        }

    # --- data -----------------------------------------------------------------------------------

    def tokenizer(self) -> SimpleTokenizer:
        """open_clip's CLIP BPE tokenizer for this context length (reads the vocabulary bundled with
        open_clip; no network). Call it on a string or list of strings to get (B, context_length) ids."""
        if self._tokenizer is None:
            self._tokenizer = SimpleTokenizer(context_length=self.config.text.context_length)
        return self._tokenizer

    def preprocess(self, train: bool) -> Any:
        """open_clip image transform (PIL image -> normalized tensor) with this config's size and stats."""
        p = self.config.preprocess
        return image_transform(
            self.config.vision.image_size,
            is_train=train,
            mean=p.mean,
            std=p.std,
            resize_mode=p.resize_mode,
            interpolation=p.interpolation,
            aug_cfg=AugmentationCfg(scale=tuple(p.crop_scale)),
        )

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.visual.set_grad_checkpointing(enable)
        self.text.set_grad_checkpointing(enable)

    def extra_repr(self) -> str:
        return (
            f"name={self.config.name!r}, geometry={self.geometry.name!r}, embed_dim={self.config.embed_dim}"
        )
