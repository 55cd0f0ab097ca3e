"""The noisy pool: planning (who is what noise kind, which caption) and rendering of its samples.

Planning draws every random choice from the pool's RNG stream into light `Sample` records; rendering is
a pure function of a record (plus its source record for near-duplicates), so shards can be rendered in
any order or in parallel with identical bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from hype.data.uids import validate_uid
from hype.io import blake2b128_bytes
from hype.synth import captions as cap
from hype.synth.noise import NOISE_KINDS, allocate
from hype.synth.render import decode, encode_jpeg, jitter, render
from hype.synth.rng import Rng
from hype.synth.scenes import (
    COLOR_NAMES,
    SHAPES,
    Scene,
    same_content,
    sample_crop,
    sample_generic_scene,
    sample_scene,
    sample_underspecified_image,
)

# Caption levels of clean samples: every level present, more of the informative ones.
LEVEL_P = {1: 0.15, 2: 0.25, 3: 0.3, 4: 0.3}


@dataclass(frozen=True)
class Sample:
    """One pool (or clean-set) sample, fully determined before any pixel is drawn."""

    index: int
    uid: str
    noise: str
    scene: Scene
    width: int
    height: int
    quality: int
    caption: str
    text_level: int
    true_caption: str | None
    source_uid: str | None = None  # the sample whose caption (misaligned) or image (near-dup) this copies
    # Near-duplicates only: the jitter seed and the JPEG quality the source was published at. With these
    # a record renders on its own, without its source record.
    dup_seed: int | None = None
    src_quality: int | None = None

    @property
    def image_level(self) -> int:
        return self.scene.image_level


def make_uid(seed: int, split: str, index: int) -> str:
    """Deterministic 128-bit uid; the split name keeps pool and clean uids apart."""
    return validate_uid(blake2b128_bytes(f"hype-synth:{seed}:{split}:{index}".encode()))


def sample_level(rng: Rng) -> int:
    return tuple(LEVEL_P)[rng.weighted(tuple(LEVEL_P.values()))]


def sample_image_size(rng: Rng, odd: bool = True) -> tuple[int, int]:
    """Mostly 48..160 px at moderate aspect; with `odd`, a few tiny and a few extreme-aspect images, so
    that an image-size or aspect-ratio filter has something to remove."""
    u = rng.random()
    if odd and u < 0.03:
        side = rng.integers(12, 32)
        return side, side + rng.integers(-2, 3)
    if odd and u < 0.06:
        short, ratio = rng.integers(40, 65), rng.uniform(3.0, 5.0)
        long_ = round(short * ratio)
        return (long_, short) if rng.random() < 0.5 else (short, long_)
    side = rng.integers(48, 161)
    ar = math.exp(rng.uniform(math.log(0.75), math.log(4 / 3)))
    return max(8, round(side * math.sqrt(ar))), max(8, round(side / math.sqrt(ar)))


def _specific(rng: Rng, index: int, uid: str, noise: str, odd: bool = True) -> Sample:
    scene = sample_scene(rng)
    w, h = sample_image_size(rng, odd)
    level = sample_level(rng)
    text = cap.caption(scene, level, rng)
    return Sample(index, uid, noise, scene, w, h, rng.integers(80, 96), text, level, text)


def _different_scene(rng: Rng, scene: Scene) -> Scene:
    """A scene sharing neither a shape nor a colour with `scene` (fallback source of a misalignment)."""
    shapes = [s for s in SHAPES if s not in {o.shape for o in scene.objects}]
    colors = [c for c in COLOR_NAMES if c not in {o.color for o in scene.objects}]
    return sample_scene(
        rng,
        "single",
        shape=rng.pick(shapes),
        color=rng.pick(colors),
    )


def plan_pool(n: int, seed: int, rng: Rng, fractions: Mapping[str, float]) -> list[Sample]:
    """Assign noise kinds (exact counts from `fractions`) and plan every sample of an `n`-sample pool."""
    counts = allocate(n, fractions)
    labels = np.array([k for k in NOISE_KINDS for _ in range(counts[k])], dtype=object)
    labels = labels[rng.permutation(n)]
    dependent = [i for i, k in enumerate(labels) if k in ("misaligned", "near_duplicate")]
    if dependent and "clean" not in set(labels):
        labels[dependent[0]] = "clean"  # tiny pools: the copies need one original to copy
    samples: list[Sample | None] = [None] * n

    # First pass: kinds that stand alone. Second pass: kinds that copy a clean sample.
    for i, noise in enumerate(labels):
        uid = make_uid(seed, "pool", i)
        if noise == "clean":
            samples[i] = _specific(rng, i, uid, noise)
        elif noise == "underspecified_text":
            s = _specific(rng, i, uid, noise)
            samples[i] = replace(s, caption=cap.underspecified_text(rng), text_level=0)
        elif noise == "underspecified_image":
            # A specific caption attached to an image with nothing (or too much) in it.
            scene = sample_underspecified_image(rng)
            w, h = sample_image_size(rng)
            level = sample_level(rng)
            text = cap.caption(sample_scene(rng), level, rng)
            samples[i] = Sample(i, uid, noise, scene, w, h, rng.integers(80, 96), text, level, None)

    clean = [i for i, k in enumerate(labels) if k == "clean"]
    for i, noise in enumerate(labels):
        uid = make_uid(seed, "pool", i)
        if noise == "misaligned":
            s = _specific(rng, i, uid, noise)
            source = None
            for j in rng.gen.choice(clean, size=min(32, len(clean)), replace=False):
                if not same_content(samples[int(j)].scene, s.scene):
                    source = samples[int(j)]
                    break
            if source is not None:
                samples[i] = replace(
                    s,
                    caption=source.caption,
                    text_level=source.text_level,
                    true_caption=cap.caption(s.scene, source.text_level, rng),
                    source_uid=source.uid,
                )
            else:
                other = _different_scene(rng, s.scene)
                samples[i] = replace(s, caption=cap.caption(other, s.text_level, rng))
        elif noise == "near_duplicate":
            src = samples[int(rng.pick(clean))]
            text = (
                src.caption
                if rng.random() < 0.5
                else cap.paraphrase(src.scene, src.text_level, rng, src.caption)
            )
            samples[i] = Sample(
                i,
                uid,
                noise,
                src.scene,
                src.width,  # provisional: the jittered copy's size is known once rendered
                src.height,
                rng.integers(55, 86),
                text,
                src.text_level,
                src.true_caption,
                source_uid=src.uid,
                dup_seed=rng.seed(),
                src_quality=src.quality,
            )
    return samples  # type: ignore[return-value]


def render_sample(s: Sample) -> tuple[bytes, int, int]:
    """JPEG bytes and final size of a sample's image."""
    if s.dup_seed is None:
        return encode_jpeg(render(s.scene, s.width, s.height), s.quality), s.width, s.height
    # A near-duplicate is a jittered, re-encoded copy of its source as the source was published.
    original = decode(encode_jpeg(render(s.scene, s.width, s.height), s.src_quality))
    img = jitter(original, np.random.default_rng(s.dup_seed))
    return encode_jpeg(img, s.quality), img.width, img.height


# The scorer set spans specificity on both sides, as web data does for MERU: generic images (empty
# backgrounds, crowds of assorted shapes) with generic captions, single objects with short captions,
# detailed scenes with detailed captions, and crops of one object of a scene with that object's short
# caption. Shares of each tier:
CLEAN_TIERS = {"generic": 0.15, "object": 0.25, "scene": 0.45, "crop": 0.15}
SHORT_LEVEL_P = {1: 0.4, 2: 0.6}
DETAILED_LEVEL_P = {3: 0.5, 4: 0.5}


def _level(rng: Rng, levels: Mapping[int, float]) -> int:
    return tuple(levels)[rng.weighted(tuple(levels.values()))]


def _clean_sample(rng: Rng, index: int, uid: str) -> Sample:
    tier = tuple(CLEAN_TIERS)[rng.weighted(tuple(CLEAN_TIERS.values()))]
    if tier == "generic":
        scene, level = sample_generic_scene(rng), 0
        w, h = sample_image_size(rng, odd=False)
        text = cap.generic_caption(scene, rng)
    else:
        if tier == "crop":
            scene, level = sample_crop(rng), _level(rng, SHORT_LEVEL_P)
            w = h = rng.integers(48, 161)  # crops are square
        else:
            kind = "single" if tier == "object" else None
            scene = sample_scene(rng, kind)
            level = _level(rng, SHORT_LEVEL_P if tier == "object" else DETAILED_LEVEL_P)
            w, h = sample_image_size(rng, odd=False)
        text = cap.caption(scene, level, rng)
    return Sample(index, uid, "clean", scene, w, h, rng.integers(80, 96), text, level, text)


def plan_clean(n: int, seed: int, rng: Rng) -> list[Sample]:
    """The scorer training set: clean, aligned pairs at moderate sizes (no odd sizes) across the
    specificity tiers of `CLEAN_TIERS`. Built from its own RNG stream and none of the pool's noise
    recipes (no blank, noise or clutter image, no underspecified text), so nothing of the pool leaks in."""
    return [_clean_sample(rng, i, make_uid(seed, "clean", i)) for i in range(n)]
