"""Attribute vocabulary of the synthetic world and the sampling of scenes.

A `Scene` is a complete, render-ready description of one image: every random choice (object centres,
radii, background colours, the seed of pixel noise) is made here, so that rendering is a pure function of
`(scene, width, height)` and any image can be re-rendered later (near-duplicates re-render their source).
Coordinates are normalised: x in units of the image width, y of the height, radii of the shorter side.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hype.synth.rng import Rng

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "cross", "ring", "diamond", "hexagon")

# Saturated, mutually distant hues; none is close to the neutral backgrounds, so colour stays readable.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 35, 35),
    "orange": (245, 140, 20),
    "yellow": (238, 218, 30),
    "green": (35, 160, 55),
    "cyan": (30, 195, 215),
    "blue": (35, 70, 220),
    "purple": (135, 55, 190),
    "pink": (245, 120, 195),
}
COLOR_NAMES: tuple[str, ...] = tuple(COLORS)

SIZES: tuple[str, ...] = ("small", "large")
POSITIONS: tuple[str, ...] = ("left", "right", "top", "bottom", "center")
BACKGROUNDS: tuple[str, ...] = ("white", "black", "gradient", "striped")
COUNTS: tuple[int, ...] = (1, 2, 3, 4)

# Scene kinds. "single"/"multi"/"mix" are specific images; "blank"/"noise"/"clutter" are the pool's
# underspecified images; "background" (a background and nothing on it) and "crowd" (a group of assorted
# shapes) are the scorer set's generic images, drawn by recipes of their own (never a pool recipe).
SPECIFIC_KINDS: tuple[str, ...] = ("single", "multi", "mix")
UNDERSPECIFIED_IMAGE_KINDS: tuple[str, ...] = ("blank", "noise", "clutter")
GENERIC_KINDS: tuple[str, ...] = ("background", "crowd")
# Backgrounds of the generic images only: a linear gradient between two colours.
GENERIC_BACKGROUNDS: tuple[str, ...] = ("gradient", "striped", "tinted")

_POSITION_XY = {
    "left": (0.28, 0.5),
    "right": (0.72, 0.5),
    "top": (0.5, 0.28),
    "bottom": (0.5, 0.72),
    "center": (0.5, 0.5),
}
_RADIUS = {"small": (0.12, 0.16), "large": (0.24, 0.28)}
# In multi-object scenes each object owns one cell of a 2x2 grid, so objects never overlap.
_MULTI_RADIUS = {"small": (0.09, 0.12), "large": (0.17, 0.2)}
_CELLS = ((0.25, 0.25), (0.75, 0.25), (0.25, 0.75), (0.75, 0.75))


@dataclass(frozen=True)
class Obj:
    shape: str
    color: str
    cx: float
    cy: float
    r: float
    angle: float = 0.0


@dataclass(frozen=True)
class Scene:
    """One image's content. `seed` drives the only randomness left to rendering (pixel noise)."""

    kind: str
    objects: tuple[Obj, ...] = ()
    background: str | None = None
    # gradient: (c0, c1, axis); striped: (c0, c1, period_fraction, orientation); blank: (fill,)
    bg_params: tuple = field(default_factory=tuple)
    size: str | None = None
    position: str | None = None
    seed: int = 0
    # A crop around one object: (object index, half-side of the square crop in units of its radius).
    # Rendering draws the whole scene and cuts the crop out, so neighbours show at the edges.
    crop: tuple[int, float] | None = None

    @property
    def target(self) -> Obj | None:
        """The object a crop is centred on."""
        return None if self.crop is None else self.objects[self.crop[0]]

    @property
    def shape(self) -> str | None:
        if self.crop is not None:
            return self.objects[self.crop[0]].shape
        if self.kind in ("single", "multi"):
            return self.objects[0].shape
        return "mixed" if self.kind in ("mix", "clutter", "crowd") else None

    @property
    def color(self) -> str | None:
        if self.crop is not None:
            return self.objects[self.crop[0]].color
        if self.kind in ("single", "multi"):
            return self.objects[0].color
        return "mixed" if self.kind in ("mix", "clutter", "crowd") else None

    @property
    def count(self) -> int | None:
        return len(self.objects) if self.objects else None

    @property
    def shapes(self) -> tuple[str, ...]:
        return tuple(sorted({o.shape for o in self.objects}))

    @property
    def image_level(self) -> int:
        """Ground-truth image specificity: nothing to see (0) .. one clear large object (4)."""
        if self.kind in ("blank", "noise", "background"):
            return 0
        if self.kind == "crowd":
            return 1
        if self.crop is not None:
            return 2  # one object, cut out of its scene: what it is, little of where
        if self.kind == "clutter":
            return 1
        if self.kind == "mix":
            return 2
        if self.kind == "multi" or self.size == "small":
            return 3
        return 4


def _bg_params(rng: Rng, background: str) -> tuple:
    # Neutral (grey) backgrounds only: a tinted background would blur the colour attribute.
    if background == "gradient":
        lo, hi = rng.integers(60, 110), rng.integers(190, 245)
        if rng.random() < 0.5:
            lo, hi = hi, lo
        return (lo, hi, rng.integers(0, 2))
    if background == "striped":
        if rng.random() < 0.5:  # light stripes
            c0, c1 = rng.integers(215, 250), rng.integers(160, 195)
        else:
            c0, c1 = rng.integers(20, 50), rng.integers(75, 105)
        return (c0, c1, rng.uniform(0.08, 0.16), rng.integers(0, 3))
    return ()


def _angle(rng: Rng, shape: str) -> float:
    # Small tilts add variety; large ones would turn a square into a diamond.
    return 0.0 if shape in ("circle", "ring") else rng.uniform(-12.0, 12.0)


def sample_scene(
    rng: Rng,
    kind: str | None = None,
    *,
    shape: str | None = None,
    color: str | None = None,
    count: int | None = None,
    size: str | None = None,
    position: str | None = None,
    background: str | None = None,
    kind_weights: tuple[float, float, float] = (0.5, 0.3, 0.2),
) -> Scene:
    """Sample a specific scene; any attribute given is fixed, the rest are drawn from `rng`.

    `count` > 1 implies a multi-object scene of one kind of object unless `kind="mix"`.
    """
    if kind is None:
        if count is not None:
            kind = "single" if count == 1 else "multi"
        else:
            kind = SPECIFIC_KINDS[rng.weighted(kind_weights)]
    if kind not in SPECIFIC_KINDS:
        raise ValueError(f"unknown specific scene kind {kind!r}; expected one of {SPECIFIC_KINDS}")
    background = background or rng.pick(BACKGROUNDS)
    size = size or rng.pick(SIZES)
    bg_params = _bg_params(rng, background)

    if kind == "single":
        shape = shape or rng.pick(SHAPES)
        color = color or rng.pick(COLOR_NAMES)
        position = position or rng.pick(POSITIONS)
        x, y = _POSITION_XY[position]
        lo, hi = _RADIUS[size]
        obj = Obj(
            shape,
            color,
            x + rng.uniform(-0.03, 0.03),
            y + rng.uniform(-0.03, 0.03),
            rng.uniform(lo, hi),
            _angle(rng, shape),
        )
        return Scene("single", (obj,), background, bg_params, size, position, rng.seed())

    n = count if count is not None else rng.integers(2, 5)
    if not 2 <= n <= 4:
        raise ValueError(f"multi-object scenes hold 2..4 objects, got {n}")
    cells = rng.permutation(4)[:n]
    lo, hi = _MULTI_RADIUS[size]
    if kind == "multi":
        shape = shape or rng.pick(SHAPES)
        color = color or rng.pick(COLOR_NAMES)
        kinds = [(shape, color)] * n
    else:
        # Distinct shapes and distinct colours, so every object can be named unambiguously.
        shapes = rng.permutation(len(SHAPES))[:n]
        colors = rng.permutation(len(COLOR_NAMES))[:n]
        kinds = [(SHAPES[int(s)], COLOR_NAMES[int(c)]) for s, c in zip(shapes, colors, strict=True)]
    objs = []
    for cell, (s, c) in zip(sorted(int(i) for i in cells), kinds, strict=True):
        cx, cy = _CELLS[cell]
        objs.append(
            Obj(
                s,
                c,
                cx + rng.uniform(-0.04, 0.04),
                cy + rng.uniform(-0.04, 0.04),
                rng.uniform(lo, hi),
                _angle(rng, s),
            )
        )
    return Scene(kind, tuple(objs), background, bg_params, size, None, rng.seed())


def sample_underspecified_image(rng: Rng, kind: str | None = None) -> Scene:
    """A blank canvas, pure pixel noise, or a clutter of many tiny mixed objects."""
    kind = kind or UNDERSPECIFIED_IMAGE_KINDS[rng.integers(3)]
    if kind == "blank":
        fill = (rng.integers(256), rng.integers(256), rng.integers(256))
        return Scene("blank", bg_params=(fill,), seed=rng.seed())
    if kind == "noise":
        # Either per-pixel noise or smooth blobs (low-resolution noise upsampled).
        return Scene("noise", bg_params=(rng.integers(0, 2),), seed=rng.seed())
    if kind != "clutter":
        raise ValueError(f"unknown underspecified image kind {kind!r}")
    background = rng.pick(BACKGROUNDS)
    n = rng.integers(18, 41)
    objs = tuple(
        Obj(
            rng.pick(SHAPES),
            rng.pick(COLOR_NAMES),
            rng.uniform(0.03, 0.97),
            rng.uniform(0.03, 0.97),
            rng.uniform(0.025, 0.05),
            rng.uniform(0, 360),
        )
        for _ in range(n)
    )
    return Scene("clutter", objs, background, _bg_params(rng, background), None, None, rng.seed())


def sample_generic_scene(rng: Rng) -> Scene:
    """A generic image for the scorer set: a background with nothing on it (neutral gradient or stripes,
    or a gradient between two colours), or a crowd of 6-10 assorted shapes. Plain one-colour canvases,
    pixel noise and clutters of tiny shapes are the pool's noise recipes and are never drawn here."""
    if rng.random() < 0.3:
        return _crowd(rng)
    background = rng.pick(GENERIC_BACKGROUNDS)
    if background == "tinted":
        c0, c1 = (tuple(rng.integers(0, 256) for _ in range(3)) for _ in range(2))
        params = (c0, c1, rng.integers(0, 2))
    else:
        params = _bg_params(rng, background)
    return Scene("background", (), background, params, None, None, rng.seed())


def _crowd(rng: Rng) -> Scene:
    """6-10 shapes of any kind and colour on a jittered 4x3 grid (no overlaps), medium-small."""
    background = rng.pick(BACKGROUNDS)
    n = rng.integers(6, 11)
    cells = sorted(int(i) for i in rng.permutation(12)[:n])
    objs = tuple(
        Obj(
            rng.pick(SHAPES),
            rng.pick(COLOR_NAMES),
            (cell % 4 + 0.5) / 4 + rng.uniform(-0.03, 0.03),
            (cell // 4 + 0.5) / 3 + rng.uniform(-0.03, 0.03),
            rng.uniform(0.07, 0.1),
            rng.uniform(-12.0, 12.0),
        )
        for cell in cells
    )
    return Scene("crowd", objs, background, _bg_params(rng, background), None, None, rng.seed())


def sample_crop(rng: Rng) -> Scene:
    """A crop around one object of a multi-object scene (HyCoCLIP's boxes: a part of a scene is more
    generic than the scene)."""
    parent = sample_scene(rng, rng.pick(("multi", "mix")))
    index = rng.integers(len(parent.objects))
    return replace(parent, crop=(index, rng.uniform(1.4, 1.9)))


def same_content(a: Scene, b: Scene) -> bool:
    """True when a caption of one could honestly describe the other (shared shape or colour)."""
    if not a.objects or not b.objects:
        return False
    return bool({o.shape for o in a.objects} & {o.shape for o in b.objects}) or bool(
        {o.color for o in a.objects} & {o.color for o in b.objects}
    )


def crop_alike(a: Scene, b: Scene) -> bool:
    """True when two renders differ as a copy's crop would, so that no pixel check can tell one from a crop
    of the other (the benches count such look-alikes apart): the same objects (shape, colour) in the same
    order on the same flat white or black background (unchanged by a crop or zoom), each at most 8/7 the
    other's size (a crop of 1/16 on each side zooms by 8/7), its centre moved by at most 1/16 of the side,
    turned by at most 3 degrees (half a pixel on a 64-px image). Crops of a scene never are."""
    flat = a.background in ("white", "black") and (a.background, a.bg_params) == (b.background, b.bg_params)
    if not flat or a.crop or b.crop or not a.objects or len(a.objects) != len(b.objects):
        return False
    return all(
        (p.shape, p.color) == (q.shape, q.color) and max(p.r / q.r, q.r / p.r) <= 8 / 7
        and max(abs(p.cx - q.cx), abs(p.cy - q.cy)) <= 1 / 16 and abs(p.angle - q.angle) <= 3
        for p, q in zip(a.objects, b.objects, strict=True)
    )  # fmt: skip
