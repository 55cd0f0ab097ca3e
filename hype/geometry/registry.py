"""The embedding geometries of the papers, each as one small class. DESIGN §2.2.

A `Geometry` turns an encoder's projected features into embeddings (`embed`) and scores pairs of
embeddings with the logit used before the logit scale (`pairwise` for all pairs, `rowwise` for aligned
rows). Training, scoring and evaluation only go through this interface, so adding a geometry means
adding one class here and one name in `GEOMETRIES` (see README "Adding a geometry").

Conventions: images are rows, texts columns (`pairwise(images, texts)`), and for entailment the text is
the cone apex and the image the point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hype.geometry import euclidean, lorentz, oblique, sphere
from hype.geometry._numerics import Tensor, geometry_op

CLIP_LOGIT_SCALE_INIT = 1 / 0.07


@dataclass(frozen=True)
class Geometry:
    """Base class. Subclasses set the class attributes and override the methods they support."""

    name = "base"
    uses_curvature = False  # learnable curvature c (hyperbolic)
    uses_alpha = False  # learnable per-modality embedding scales α_img, α_txt (hyperbolic)
    supports_entailment = False
    default_K = 0.0  # entailment cone constant
    logit_scale_init = CLIP_LOGIT_SCALE_INIT
    logit_scale_max = 100.0

    def embed(self, features: Tensor, *, curv: Tensor | float | None = None, alpha: Tensor | None = None):
        raise NotImplementedError

    def pairwise(self, images: Tensor, texts: Tensor, *, curv: Tensor | float | None = None) -> Tensor:
        raise NotImplementedError

    def rowwise(self, images: Tensor, texts: Tensor, *, curv: Tensor | float | None = None) -> Tensor:
        raise NotImplementedError

    def ensemble(self, embeddings: Tensor, *, curv: Tensor | float | None = None) -> Tensor:
        """One embedding standing for a set (..., P, n) -> (..., n), e.g. a class's prompt templates."""
        raise NotImplementedError

    def entailment_energy(self, apex: Tensor, point: Tensor, *, curv=None, K: float | None = None):
        """Row-wise E(apex -> point) = ext - aper; only for geometries with entailment cones."""
        raise ValueError(f"geometry {self.name!r} has no entailment cones; use euclidean* or hyperbolic*")

    def pairwise_entailment_energy(self, apex: Tensor, point: Tensor, *, curv=None, K: float | None = None):
        raise ValueError(f"geometry {self.name!r} has no entailment cones; use euclidean* or hyperbolic*")


@dataclass(frozen=True)
class Clip(Geometry):
    name = "clip"

    def embed(self, features, *, curv=None, alpha=None):
        return sphere.normalize(features)

    def pairwise(self, images, texts, *, curv=None):
        return sphere.pairwise_cosine(images, texts)

    def rowwise(self, images, texts, *, curv=None):
        return sphere.cosine(images, texts)

    @geometry_op
    def ensemble(self, embeddings, *, curv=None):
        # CLIP's zero-shot recipe: normalize, mean, normalize.
        return sphere.normalize(sphere.normalize(embeddings).mean(-2))


@dataclass(frozen=True)
class Elliptic(Clip):
    """Negative great-circle distance on the sphere; same ordering as cosine, range [-π, 0]."""

    name = "elliptic"

    def pairwise(self, images, texts, *, curv=None):
        return -sphere.pairwise_geodesic(images, texts)

    def rowwise(self, images, texts, *, curv=None):
        return -sphere.geodesic(images, texts)


@dataclass(frozen=True)
class Euclidean(Geometry):
    """Features scaled by 1/sqrt(n), no normalization; logit -|x-y| (or -|x-y|^2 when squared)."""

    squared: bool = False
    supports_entailment = True
    default_K = euclidean.DEFAULT_K

    @property
    def name(self) -> str:  # type: ignore[override]
        return "euclidean-squared" if self.squared else "euclidean"

    @property
    def logit_scale_init(self) -> float:  # type: ignore[override]
        # EuCLIP: distance-squared logits are unstable at 1/0.07; they start at β = 1.
        return 1.0 if self.squared else CLIP_LOGIT_SCALE_INIT

    @geometry_op
    def embed(self, features, *, curv=None, alpha=None):
        return features / math.sqrt(features.shape[-1])

    def pairwise(self, images, texts, *, curv=None):
        if self.squared:
            return -euclidean.pairwise_squared_distance(images, texts)
        return -euclidean.pairwise_distance(images, texts)

    def rowwise(self, images, texts, *, curv=None):
        if self.squared:
            return -euclidean.squared_distance(images, texts)
        return -euclidean.distance(images, texts)

    @geometry_op
    def ensemble(self, embeddings, *, curv=None):
        # EuCLIP: the plain centroid; normalizing would discard the norm that carries information.
        return embeddings.mean(-2)

    def entailment_energy(self, apex, point, *, curv=None, K=None):
        return euclidean.entailment_energy(apex, point, self.default_K if K is None else K)

    def pairwise_entailment_energy(self, apex, point, *, curv=None, K=None):
        return euclidean.pairwise_entailment_energy(apex, point, self.default_K if K is None else K)


@dataclass(frozen=True)
class Hyperbolic(Geometry):
    """MERU: features × α, exponential map at the origin; logit -d_L (or -d_L^2 when squared)."""

    squared: bool = False
    uses_curvature = True
    uses_alpha = True
    supports_entailment = True
    default_K = lorentz.DEFAULT_K

    @property
    def name(self) -> str:  # type: ignore[override]
        return "hyperbolic-squared" if self.squared else "hyperbolic"

    @property
    def logit_scale_init(self) -> float:  # type: ignore[override]
        return 1.0 if self.squared else CLIP_LOGIT_SCALE_INIT

    @geometry_op
    def embed(self, features, *, curv=None, alpha=None):
        _need(curv, "curv", self.name)
        return lorentz.exp_map0(features if alpha is None else features * alpha, curv)

    def pairwise(self, images, texts, *, curv=None):
        _need(curv, "curv", self.name)
        if self.squared:
            return -lorentz.pairwise_squared_distance(images, texts, curv)
        return -lorentz.pairwise_distance(images, texts, curv)

    def rowwise(self, images, texts, *, curv=None):
        _need(curv, "curv", self.name)
        if self.squared:
            return -lorentz.squared_distance(images, texts, curv)
        return -lorentz.distance(images, texts, curv)

    @geometry_op
    def ensemble(self, embeddings, *, curv=None):
        # MERU: average in the tangent space at the origin, then lift.
        _need(curv, "curv", self.name)
        return lorentz.exp_map0(lorentz.log_map0(embeddings, curv).mean(-2), curv)

    def entailment_energy(self, apex, point, *, curv=None, K=None):
        _need(curv, "curv", self.name)
        return lorentz.entailment_energy(apex, point, curv, self.default_K if K is None else K)

    def pairwise_entailment_energy(self, apex, point, *, curv=None, K=None):
        _need(curv, "curv", self.name)
        return lorentz.pairwise_entailment_energy(apex, point, curv, self.default_K if K is None else K)


@dataclass(frozen=True)
class Oblique(Geometry):
    """Product of `num_spheres` unit spheres; logit Σ_k <u_k, v_k> ∈ [-k, k], max logit scale 100/k."""

    num_spheres: int = 1
    name = "oblique"

    def __post_init__(self) -> None:
        if self.num_spheres < 1:
            raise ValueError(f"oblique geometry needs num_spheres >= 1, got {self.num_spheres}")

    @property
    def logit_scale_max(self) -> float:  # type: ignore[override]
        return 100.0 / self.num_spheres

    @property
    def logit_scale_init(self) -> float:  # type: ignore[override]
        # CLIP's 1/0.07 exceeds the cap 100/k once k >= 7; start at the cap then.
        return min(CLIP_LOGIT_SCALE_INIT, self.logit_scale_max)

    def embed(self, features, *, curv=None, alpha=None):
        return oblique.normalize(features, self.num_spheres)

    def pairwise(self, images, texts, *, curv=None):
        return oblique.pairwise_inner(images, texts)

    def rowwise(self, images, texts, *, curv=None):
        return oblique.inner(images, texts)

    @geometry_op
    def ensemble(self, embeddings, *, curv=None):
        # Per sphere, CLIP's recipe: normalize, mean, normalize each sub-vector.
        return oblique.normalize(oblique.normalize(embeddings, self.num_spheres).mean(-2), self.num_spheres)


def _need(value, what: str, name: str) -> None:
    if value is None:
        raise ValueError(f"geometry {name!r} needs `{what}`")


GEOMETRIES: dict[str, type[Geometry] | tuple[type[Geometry], dict]] = {
    "clip": Clip,
    "elliptic": Elliptic,
    "euclidean": (Euclidean, {"squared": False}),
    "euclidean-squared": (Euclidean, {"squared": True}),
    "hyperbolic": (Hyperbolic, {"squared": False}),
    "hyperbolic-squared": (Hyperbolic, {"squared": True}),
    "oblique": Oblique,
}


def get_geometry(name: str, **options) -> Geometry:
    """Build a geometry by name; `options` are class fields (e.g. `num_spheres` for oblique)."""
    if name not in GEOMETRIES:
        raise ValueError(f"unknown geometry {name!r}; choose one of: {', '.join(GEOMETRIES)}")
    entry = GEOMETRIES[name]
    cls, fixed = entry if isinstance(entry, tuple) else (entry, {})
    return cls(**fixed, **options)
