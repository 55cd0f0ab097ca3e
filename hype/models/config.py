"""Model configuration: YAML -> validated, frozen dataclasses. DESIGN §2.2 (geometries), §2.5 (recipes).

A config file has these sections (see `configs/models/*.yaml`):

    name, description, geometry, embed_dim, quick_gelu   (top level)
    vision:     the ViT image tower
    text:       the causal text transformer
    oblique:    only for geometry `oblique` (num_spheres, multi_token)
    scalars:    init values and clamps of the learnable log-scalars
    loss:       entailment weight λ and cone constant K (read by `hype.losses` / training)
    preprocess: image mean/std and augmentation

Geometry-dependent defaults (`null` in YAML) are resolved when the config is built, so a config
saved with `to_dict()` (checkpoints) rebuilds exactly the same model even if the defaults change later.
Every mistake is a `ConfigError` (a `ValueError`) naming the file and the dotted key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hype.config import ConfigError, build, one_of, positive, read_yaml, to_dict
from hype.geometry import GEOMETRIES, get_geometry

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

POS_EMBEDS = ("learnable", "sincos")
RESIZE_MODES = ("shortest", "longest", "squash")
INTERPOLATIONS = ("bicubic", "bilinear")

# Per-geometry defaults of the entailment loss: MERU (λ = 0.2, K = 0.1) for hyperbolic, EuCLIP
# (λ = 0.1, K = 0.3) for Euclidean; geometries without cones get λ = 0 and no K.
ENTAILMENT_WEIGHT_DEFAULTS = {
    "euclidean": 0.1,
    "euclidean-squared": 0.1,
    "hyperbolic": 0.2,
    "hyperbolic-squared": 0.2,
}


@dataclass(frozen=True)
class VisionConfig:
    """A ViT built by open_clip's `_build_vision_tower` (class-token pooling, linear projection)."""

    image_size: int = 224
    patch_size: int = 16
    width: int = 768
    layers: int = 12
    head_width: int = 64
    mlp_ratio: float = 4.0
    final_ln: bool = True  # EuCLIP removes the LayerNorm after the last block (ln_post)
    pos_embed: str = "learnable"  # learnable | sincos (MERU: fixed 2-D sin-cos, MoCo-v3 layout)
    # MERU's timm ViT differs from open_clip's in two places: no LayerNorm before the blocks and a
    # bias in the patch embedding. Both are options so MERU checkpoints map one-to-one.
    ln_pre: bool = True
    patch_bias: bool = False
    ln_eps: float = 1e-5  # HYPE's released ViT-L/14 uses the dtype's eps (fp32: 2**-23)

    def __post_init__(self) -> None:
        positive(self, "image_size", "patch_size", "width", "layers", "head_width", "mlp_ratio", "ln_eps")
        one_of(self, "pos_embed", POS_EMBEDS)
        if self.image_size % self.patch_size:
            raise ConfigError("patch_size", f"{self.patch_size} does not divide image_size {self.image_size}")
        if self.width % self.head_width:
            raise ConfigError("head_width", f"{self.head_width} does not divide width {self.width}")
        if self.pos_embed == "sincos" and self.width % 4:
            raise ConfigError("pos_embed", f"sincos needs width divisible by 4, got width {self.width}")

    @property
    def heads(self) -> int:
        return self.width // self.head_width

    @property
    def grid_size(self) -> int:
        return self.image_size // self.patch_size


@dataclass(frozen=True)
class TextConfig:
    """open_clip's causal `TextTransformer`, pooled at the EOT token (the highest token id)."""

    context_length: int = 77
    vocab_size: int = 49408  # the real CLIP BPE tokenizer
    width: int = 512
    heads: int = 8
    layers: int = 12
    mlp_ratio: float = 4.0
    final_ln: bool = True  # EuCLIP removes ln_final
    ln_eps: float = 1e-5

    def __post_init__(self) -> None:
        positive(self, "context_length", "vocab_size", "width", "heads", "layers", "mlp_ratio", "ln_eps")
        if self.width % self.heads:
            raise ConfigError("heads", f"{self.heads} does not divide width {self.width}")


@dataclass(frozen=True)
class ObliqueConfig:
    """Ob(num_spheres, sphere_dim) with sphere_dim = embed_dim / num_spheres."""

    num_spheres: int = 16
    multi_token: bool = False  # one class token per sphere in each tower instead of a reshape

    def __post_init__(self) -> None:
        positive(self, "num_spheres")


@dataclass(frozen=True)
class ScalarsConfig:
    """Init values and clamps of the learnable scalars (stored as logs, clamped in place like MERU).

    `null` means the geometry's default: logit scale 1/0.07 (1 for squared distances) clamped at
    100 (100/k for oblique, whose init is then min(1/0.07, 100/k)); for hyperbolic geometries
    curvature 1 in [0.1, 10] and α = 1/sqrt(embed_dim) clamped at 1. Curvature and α entries must
    stay `null` for geometries that do not use them.
    """

    logit_scale_init: float | None = None
    logit_scale_max: float | None = None
    curv_init: float | None = None
    curv_min: float | None = None
    curv_max: float | None = None
    learn_curv: bool = True
    alpha_init: float | None = None
    alpha_max: float | None = None


@dataclass(frozen=True)
class LossConfig:
    """Entailment term of the loss, `L_cont + entailment_weight * L_entail` (text apex, image point)."""

    entailment_weight: float | None = None
    entailment_K: float | None = None


@dataclass(frozen=True)
class PreprocessConfig:
    mean: tuple[float, ...] = OPENAI_MEAN
    std: tuple[float, ...] = OPENAI_STD
    crop_scale: tuple[float, ...] = (0.9, 1.0)  # RandomResizedCrop area range when training
    resize_mode: str = "shortest"
    interpolation: str = "bicubic"

    def __post_init__(self) -> None:
        for name in ("mean", "std"):
            if len(getattr(self, name)) != 3:
                raise ConfigError(name, f"needs 3 values (RGB), got {list(getattr(self, name))}")
        if any(s <= 0 for s in self.std):
            raise ConfigError("std", f"must be > 0, got {list(self.std)}")
        lo_hi = self.crop_scale
        if len(lo_hi) != 2 or not 0.0 < lo_hi[0] <= lo_hi[1] <= 1.0:
            raise ConfigError("crop_scale", f"needs [low, high] with 0 < low <= high <= 1, got {list(lo_hi)}")
        one_of(self, "resize_mode", RESIZE_MODES)
        one_of(self, "interpolation", INTERPOLATIONS)


@dataclass(frozen=True)
class ModelConfig:
    name: str = ""
    geometry: str = "clip"
    embed_dim: int = 512
    description: str = ""
    quick_gelu: bool = False  # OpenAI's checkpoints use QuickGELU; training from scratch uses nn.GELU
    vision: VisionConfig = field(default_factory=VisionConfig)
    text: TextConfig = field(default_factory=TextConfig)
    oblique: ObliqueConfig | None = None
    scalars: ScalarsConfig = field(default_factory=ScalarsConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)

    def __post_init__(self) -> None:
        # A name is written into files (params.txt, logs): a newline would add lines there.
        if not isinstance(self.name, str) or not self.name.isprintable():
            raise ConfigError(
                "name", f"{self.name!r} contains control characters (e.g. a newline); rename it"
            )
        if self.geometry not in GEOMETRIES:
            raise ConfigError(
                "geometry", f"unknown geometry {self.geometry!r}; choose one of: {', '.join(GEOMETRIES)}"
            )
        positive(self, "embed_dim")
        self._resolve_oblique()
        geometry = get_geometry(self.geometry, **self.geometry_options)
        try:
            object.__setattr__(self, "scalars", _resolve_scalars(self.scalars, geometry, self.embed_dim))
        except ConfigError as e:
            raise e.within("scalars") from None
        try:
            object.__setattr__(self, "loss", _resolve_loss(self.loss, geometry))
        except ConfigError as e:
            raise e.within("loss") from None

    def _resolve_oblique(self) -> None:
        if self.geometry != "oblique":
            if self.oblique is not None:
                raise ConfigError("oblique", f"only valid with geometry 'oblique', not {self.geometry!r}")
            return
        if self.oblique is None:
            object.__setattr__(self, "oblique", ObliqueConfig())
        k = self.oblique.num_spheres
        if self.embed_dim % k:
            raise ConfigError(
                "oblique.num_spheres",
                f"{k} does not divide embed_dim {self.embed_dim} (sphere_dim must be whole)",
            )

    @property
    def geometry_options(self) -> dict[str, Any]:
        """Keyword options of `get_geometry` for this config."""
        return {"num_spheres": self.oblique.num_spheres} if self.oblique is not None else {}

    @property
    def num_class_tokens(self) -> int:
        """Class tokens per tower: num_spheres for multi-token oblique, else 1."""
        if self.oblique is not None and self.oblique.multi_token:
            return self.oblique.num_spheres
        return 1

    @property
    def sphere_dim(self) -> int | None:
        return self.embed_dim // self.oblique.num_spheres if self.oblique is not None else None

    def to_dict(self) -> dict[str, Any]:
        """A plain JSON-serializable dict that `ModelConfig.from_dict` / `create_model` accept back."""
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<dict>") -> ModelConfig:
        # Exact ints: a model dimension written as 2.0 is refused rather than rounded.
        return build(cls, data, source=source, exact_ints=True)

    @classmethod
    def from_yaml(cls, path: str | Path) -> ModelConfig:
        data = read_yaml(path)
        data.setdefault("name", Path(path).stem)
        return cls.from_dict(data, source=str(path))


def _resolve_scalars(s: ScalarsConfig, geometry: Any, embed_dim: int) -> ScalarsConfig:
    scale_max = geometry.logit_scale_max if s.logit_scale_max is None else s.logit_scale_max
    # The default init (1/0.07) exceeds oblique's 100/k once k > 7; start at the cap then.
    scale_init = (
        min(geometry.logit_scale_init, scale_max) if s.logit_scale_init is None else s.logit_scale_init
    )
    r = {"logit_scale_init": scale_init, "logit_scale_max": scale_max}
    hyperbolic = {"curv_init": 1.0, "curv_min": 0.1, "curv_max": 10.0}
    alpha = {"alpha_init": embed_dim**-0.5, "alpha_max": 1.0}
    for defaults, used in ((hyperbolic, geometry.uses_curvature), (alpha, geometry.uses_alpha)):
        for key, default in defaults.items():
            value = getattr(s, key)
            if not used and value is not None:
                raise ConfigError(key, f"geometry {geometry.name!r} has no such scalar; leave it null")
            r[key] = (default if value is None else value) if used else None
    out = dataclasses.replace(s, **r)
    positive(out, "logit_scale_init", "logit_scale_max")
    if out.logit_scale_init > out.logit_scale_max:
        raise ConfigError(
            "logit_scale_init", f"{out.logit_scale_init} exceeds logit_scale_max {out.logit_scale_max}"
        )
    if geometry.uses_curvature:
        positive(out, "curv_min")
        lo, init, hi = out.curv_min, out.curv_init, out.curv_max
        if not lo <= init <= hi:
            raise ConfigError("curv_init", f"needs curv_min <= curv_init <= curv_max; got {lo}, {init}, {hi}")
    if geometry.uses_alpha:
        positive(out, "alpha_init", "alpha_max")
        if out.alpha_init > out.alpha_max:
            raise ConfigError("alpha_init", f"{out.alpha_init} exceeds alpha_max {out.alpha_max}")
    return out


def _resolve_loss(loss: LossConfig, geometry: Any) -> LossConfig:
    if not geometry.supports_entailment:
        if loss.entailment_weight or loss.entailment_K is not None:
            raise ConfigError(
                "entailment_weight",
                f"geometry {geometry.name!r} has no entailment cones; leave the loss section out",
            )
        return LossConfig(entailment_weight=0.0, entailment_K=None)
    weight = (
        ENTAILMENT_WEIGHT_DEFAULTS[geometry.name]
        if loss.entailment_weight is None
        else loss.entailment_weight
    )
    K = geometry.default_K if loss.entailment_K is None else loss.entailment_K
    out = LossConfig(entailment_weight=weight, entailment_K=K)
    if out.entailment_weight < 0:
        raise ConfigError("entailment_weight", f"must be >= 0, got {weight}")
    positive(out, "entailment_K")
    return out


# Each clamp of `ScalarsConfig`: the model's log-parameters it bounds, and which side.
_SCALAR_BOUNDS = {
    "logit_scale_max": (("log_logit_scale",), "upper"),
    "curv_min": (("log_curv",), "lower"),
    "curv_max": (("log_curv",), "upper"),
    "alpha_max": (("log_alpha_img", "log_alpha_txt"), "upper"),
}
_SCALAR_NAMES = {
    "log_logit_scale": "logit scale",
    "log_curv": "curvature",
    "log_alpha_img": "image alpha",
    "log_alpha_txt": "text alpha",
}


def fit_scalar_bounds(config: ModelConfig, logs: Mapping[str, Any]) -> tuple[ModelConfig, list[str]]:
    """`config` with its scalar clamps widened to hold stored log-scalars (`log_curv`, ... -> tensors or
    floats), and a note for each stored value that lay outside.

    A released model (MERU, HYPE, open_clip) clamps its scalars only in its training step; its encoders
    use the stored values as they are. A model read from such a file must compute the same, so the clamps
    move out to the stored values rather than the values in to the clamps (training from the result
    then starts from the file's values)."""
    found = {k: math.exp(float(v)) for k, v in logs.items() if k in _SCALAR_NAMES and v is not None}
    widened: dict[str, float] = {}
    notes = []
    for bound, (params, side) in _SCALAR_BOUNDS.items():
        limit = getattr(config.scalars, bound)
        for param in params:
            value = found.get(param)
            if limit is None or value is None or (value >= limit if side == "lower" else value <= limit):
                continue
            current = widened.get(bound, limit)
            widened[bound] = min(current, value) if side == "lower" else max(current, value)
            notes.append(
                f"stored {_SCALAR_NAMES[param]} {value:.6g} lies outside the config's bounds ({bound} "
                f"{limit:g}); the model uses it as stored, as the released code does at inference (it "
                "clamps only while training), and its config's bound moves to it"
            )
    if not widened:
        return config, []
    return dataclasses.replace(config, scalars=dataclasses.replace(config.scalars, **widened)), notes
