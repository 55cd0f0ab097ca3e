"""Grounding of a synthetic sample as GRIT stores it (HyCoCLIP's boxes, SPEC §2.6).

GRIT's sample JSON holds `noun_chunks` and `ref_exps`: rows `[start, end, x1, y1, x2, y2, score]`, the
character span of a phrase in the caption and the box of what it names, in coordinates normalised by the
image's width and height. A real GRIT row comes from a grounding model; here the scene is known, so every
object of the image whose noun phrase the caption contains gets a row with score 1.0 (a plural phrase,
"three red stars", names each of its objects: one row per box, as GRIT lists them). `ref_exps` stays
empty: the synthetic captions' referring expressions are their noun phrases.

A misaligned caption describes another scene: its phrases ground only where the image happens to hold
an object of the named shape (and colour, when the phrase says one), as a grounding model would find it.
"""

from __future__ import annotations

import re

import numpy as np

from hype.synth.captions import COUNT_WORDS, SHAPE_WORDS, SIZE_WORDS, _plural
from hype.synth.render import jitter_crop
from hype.synth.scenes import COLOR_NAMES, Obj, Scene

# Stars and triangles reach 1.05-1.1 radii from their centre (render._polygon); a box holds all of it.
_EXTENT = 1.1
_DETERMINERS = sorted(
    {"a", "an", "some", "several"} | {w for words in COUNT_WORDS.values() for w in words},
    key=len,
    reverse=True,
)
_SIZES = sorted({w for words in SIZE_WORDS.values() for w in words}, key=len, reverse=True)


def _phrase_pattern(shape: str) -> re.Pattern:
    nouns = sorted({n for w in SHAPE_WORDS[shape] for n in (w, _plural(w))}, key=len, reverse=True)
    alt = "|".join
    return re.compile(
        rf"\b(?:(?:{alt(_DETERMINERS)}) )?(?:(?:{alt(_SIZES)}) )?(?:(?P<color>{alt(COLOR_NAMES)}) )?"
        rf"(?:{alt(map(re.escape, nouns))})\b",
        re.IGNORECASE,
    )


_PATTERNS = {shape: _phrase_pattern(shape) for shape in SHAPE_WORDS}


def _span(caption: str, obj: Obj) -> tuple[int, int] | None:
    """The first phrase naming `obj`'s shape whose colour, if it says one, is `obj`'s."""
    for m in _PATTERNS[obj.shape].finditer(caption):
        if m.group("color") is None or m.group("color").lower() == obj.color:
            return m.start(), m.end()
    return None


def _box(obj: Obj, width: int, height: int) -> tuple[float, float, float, float]:
    """The object's box in pixels of a `width` x `height` rendering of its whole scene."""
    cx, cy, r = obj.cx * width, obj.cy * height, _EXTENT * obj.r * min(width, height)
    return cx - r, cy - r, cx + r, cy + r


def _visible(scene: Scene, width: int, height: int) -> list[tuple[Obj, tuple[float, float, float, float]]]:
    """Objects of the image with their pixel boxes; a crop shows its target (the one its caption names)."""
    if scene.crop is None:
        return [(o, _box(o, width, height)) for o in scene.objects]
    index, half = scene.crop
    obj = scene.objects[index]
    full = max(width, round(width / (2 * half * obj.r)))  # as render._render_crop draws it
    x0 = min(max(0, round(obj.cx * full - width / 2)), full - width)
    y0 = min(max(0, round(obj.cy * full - width / 2)), full - width)
    bx0, by0, bx1, by1 = _box(obj, full, full)
    return [(obj, (bx0 - x0, by0 - y0, bx1 - x0, by1 - y0))]


def grounding(
    scene: Scene, caption: str, width: int, height: int, dup_seed: int | None = None
) -> dict[str, list]:
    """GRIT's `noun_chunks` / `ref_exps` of a sample rendered at `width` x `height` (a near-duplicate:
    through the jitter crop `dup_seed` draws; its resize keeps normalised coordinates)."""
    x_off, y_off, w, h = 0, 0, width, height
    if dup_seed is not None:
        dx0, dy0, dx1, dy1 = jitter_crop(width, height, np.random.default_rng(dup_seed))
        x_off, y_off, w, h = dx0, dy0, width - dx0 - dx1, height - dy0 - dy1
    rows = []
    for obj, (x1, y1, x2, y2) in _visible(scene, width, height):
        span = _span(caption, obj)
        if span is None:
            continue
        box = [(x1 - x_off) / w, (y1 - y_off) / h, (x2 - x_off) / w, (y2 - y_off) / h]
        box = [round(min(max(v, 0.0), 1.0), 4) for v in box]
        if box[2] > box[0] and box[3] > box[1]:
            rows.append([span[0], span[1], *box, 1.0])
    return {"noun_chunks": rows, "ref_exps": []}
