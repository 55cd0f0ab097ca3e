"""Captions of a scene at five levels of specificity, plus underspecified web texts.

    level 0  "a picture"                       (says nothing about the content)
    level 1  "a star"                          (what kind of object)
    level 2  "a red star"                      (+ colour)
    level 3  "a large red star on a striped background"          (+ size, background)
    level 4  "one large red star at the left on a striped background"  (+ count, position)

Templates and synonyms vary the surface form so that text is not trivially constant; synonym sets of
different shapes are disjoint, so two captions with different content never coincide.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hype.synth.rng import Rng
from hype.synth.scenes import Scene

LEVELS: tuple[int, ...] = (0, 1, 2, 3, 4)

SHAPE_WORDS: dict[str, tuple[str, ...]] = {
    "circle": ("circle", "disc"),
    "square": ("square", "box"),
    "triangle": ("triangle",),
    "star": ("star",),
    "cross": ("cross", "plus sign"),
    "ring": ("ring", "donut"),
    "diamond": ("diamond", "rhombus"),
    "hexagon": ("hexagon",),
}
_PLURAL = {"box": "boxes", "cross": "crosses", "rhombus": "rhombuses"}
SIZE_WORDS = {"small": ("small", "little", "tiny"), "large": ("large", "big")}
BACKGROUND_WORDS = {
    "white": ("a white background", "a plain white background", "white"),
    "black": ("a black background", "a plain black background", "black"),
    "gradient": ("a gradient background", "a shaded gradient background"),
    "striped": ("a striped background", "a background of stripes", "stripes"),
}
POSITION_WORDS = {
    "left": ("at the left", "on the left", "on the left side"),
    "right": ("at the right", "on the right", "on the right side"),
    "top": ("at the top", "near the top"),
    "bottom": ("at the bottom", "near the bottom"),
    "center": ("in the center", "in the middle"),
}
COUNT_WORDS = {1: ("one", "a single"), 2: ("two", "a pair of"), 3: ("three",), 4: ("four",)}
NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}
GENERIC = ("a picture", "an image", "a photo", "a picture of something", "something")
PREFIXES = (
    "{}",
    "{}",
    "a photo of {}",
    "a picture of {}",
    "an image of {}",
    "a drawing of {}",
    "a rendering of {}",
    "an illustration of {}",
    "there is {}",
    "{} in the picture",
)

# What people attach to web images that says nothing about them.
_BOILERPLATE = (
    "image",
    "photo",
    "picture",
    "img",
    "untitled",
    "thumbnail",
    "click here to buy",
    "click to enlarge",
    "view larger image",
    "free shipping on orders over $50",
    "stock photo",
    "copyright all rights reserved",
    "loading...",
    "product image",
    "no description available",
    "download now",
    "see more",
    "buy now",
    "",
)
_FILENAMES = ("img_{:04d}.jpg", "DSC_{:04d}.JPG", "IMG_{:04d}.png", "photo-{:04d}.jpeg", "image{:04d}")

Pick = Callable[[Sequence[str]], str]


def _first(options: Sequence[str]) -> str:
    return options[0]


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _plural(word: str) -> str:
    return _PLURAL.get(word, word + "s")


def _bg(pick: Pick, background: str) -> str:
    return "on " + pick(BACKGROUND_WORDS[background])


def _phrase(scene: Scene, level: int, pick: Pick) -> str:
    if level == 0:
        return pick(GENERIC)
    objs = scene.objects
    size = pick(SIZE_WORDS[scene.size]) if scene.size else ""
    if scene.kind == "single":
        o = objs[0]
        noun = pick(SHAPE_WORDS[o.shape])
        if level == 1:
            return _a(noun)
        if level == 2:
            return _a(f"{o.color} {noun}")
        bg = _bg(pick, scene.background)
        if level == 3:
            return f"{_a(f'{size} {o.color} {noun}')} {bg}"
        count = pick(COUNT_WORDS[1])
        return f"{count} {size} {o.color} {noun} {pick(POSITION_WORDS[scene.position])} {bg}"
    if scene.kind == "multi":
        o = objs[0]
        nouns = _plural(pick(SHAPE_WORDS[o.shape]))
        if level == 1:
            return pick(("", "some ", "several ")) + nouns
        if level == 2:
            return pick(("", "some ", "several ")) + f"{o.color} {nouns}"
        bg = _bg(pick, scene.background)
        if level == 3:
            return f"{size} {o.color} {nouns} {bg}"
        return f"{pick(COUNT_WORDS[len(objs)])} {size} {o.color} {nouns} {bg}"
    if scene.kind == "mix":
        names = [pick(SHAPE_WORDS[o.shape]) for o in objs]
        if level >= 2:
            names = [f"{o.color} {n}" for o, n in zip(objs, names, strict=True)]
        listed = _and([_a(n) for n in names])
        if level <= 2:
            return listed
        bg = _bg(pick, scene.background)
        if level == 3:
            return f"{listed} {bg}"
        return f"{NUMBER_WORDS[len(objs)]} {size} shapes, {listed}, {bg}"
    raise ValueError(f"scene kind {scene.kind!r} has no captions above level 0")


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def caption(scene: Scene, level: int, rng: Rng) -> str:
    """A caption of `scene` at specificity `level` with a randomly chosen template and synonyms; a crop
    is captioned as the object it shows."""
    if level not in LEVELS:
        raise ValueError(f"caption level must be one of {LEVELS}, got {level}")
    if scene.crop is not None:
        target = scene.objects[scene.crop[0]]
        scene = Scene("single", (target,), scene.background, scene.bg_params, scene.size)
    pick = rng.pick
    text = pick(PREFIXES).format(_phrase(scene, level, pick))
    if level > 0 and scene.kind in ("multi", "mix") and text.startswith("there is "):
        text = "there are " + text[len("there is ") :]
    return _surface(text, rng)


# The scorer set's generic captions: what its generic images show, said generically. Disjoint from the
# pool's underspecified texts (GENERIC, boilerplate, file names), which no scorer may see.
EMPTY_WORDS = (
    "an empty background",
    "a plain background",
    "a background with nothing on it",
    "an empty canvas",
    "just a background",
    "nothing but a background",
)
CROWD_WORDS = (
    "a group of shapes",
    "many shapes",
    "lots of shapes",
    "assorted shapes",
    "a bunch of shapes",
    "various shapes",
)
TINTED_WORDS = ("a colourful background", "a coloured gradient", "a gradient of colours")


def generic_caption(scene: Scene, rng: Rng) -> str:
    """A generic caption of a generic scene: a crowd is "many shapes"; a background-only scene is said to
    be empty (half the time) or named ("a striped background")."""
    if scene.kind == "crowd":
        phrase = rng.pick(CROWD_WORDS)
    elif rng.random() < 0.5:
        phrase = rng.pick(EMPTY_WORDS)
    elif scene.background == "tinted":
        phrase = rng.pick(TINTED_WORDS)
    else:
        phrase = rng.pick(tuple(w for w in BACKGROUND_WORDS[scene.background] if w.startswith("a ")))
    text = rng.pick(PREFIXES).format(phrase)
    if scene.kind == "crowd" and text.startswith("there is "):
        text = "there are " + text[len("there is ") :]
    return _surface(text, rng)


def _surface(text: str, rng: Rng) -> str:
    """Surface variation of a caption: sometimes capitalised, sometimes a final full stop."""
    if rng.random() < 0.3:
        text = text[:1].upper() + text[1:]
    if rng.random() < 0.3:
        text += "."
    return text


def canonical_caption(scene: Scene, level: int) -> str:
    """The caption with the first template and synonyms: two scenes share it iff they share content."""
    return _phrase(scene, level, _first)


def paraphrase(scene: Scene, level: int, rng: Rng, avoid: str, tries: int = 8) -> str:
    """A caption of the same content and level whose text differs from `avoid` when possible."""
    text = avoid
    for _ in range(tries):
        text = caption(scene, level, rng)
        if text != avoid:
            break
    return text


def underspecified_text(rng: Rng) -> str:
    """A text that says nothing about its image: boilerplate, a file name, or a generic word."""
    u = rng.random()
    if u < 0.25:
        return rng.pick(_FILENAMES).format(rng.integers(10000))
    if u < 0.4:
        return f"image {rng.integers(1, 9)} of {rng.integers(9, 30)}"
    if u < 0.55:
        return rng.pick(GENERIC)
    return rng.pick(_BOILERPLATE)
