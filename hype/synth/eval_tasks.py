"""Evaluation tasks in the DataComp / CLIP_benchmark webdataset layout, and the labelled reference set.

Each task is a folder `wds_<task with / -> ->_test/` with `classnames.txt`,
`zeroshot_classification_templates.txt` and `test/{0..}.tar` + `test/nshards.txt`. Classification
samples are `<key>.webp` + `<key>.cls`; the retrieval task has `<key>.webp` + `<key>.txt` (one reference
caption per line). Labels are balanced (class = i mod C, shuffled) and every image is a clean, specific
scene drawn from the task's own RNG stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hype.synth import captions as cap
from hype.synth.render import encode_eval, encode_jpeg, render
from hype.synth.rng import Rng
from hype.synth.scenes import BACKGROUNDS, COLOR_NAMES, POSITIONS, SHAPES, Scene, sample_scene

EVAL_SIZE_PX = 64
OBJECT_CLASSES: tuple[str, ...] = tuple(f"{c} {s}" for c in COLOR_NAMES for s in SHAPES)
RETRIEVAL_LEVELS = (4, 4, 4, 3, 3)


@dataclass(frozen=True)
class Task:
    name: str
    classnames: tuple[str, ...]
    templates: tuple[str, ...]
    scene: Callable[[Rng, int], Scene]

    @property
    def folder(self) -> str:
        return task_folder(self.name)


def task_folder(name: str) -> str:
    return f"wds_{name.replace('/', '-')}_test"


def _objects(rng: Rng, label: int) -> Scene:
    color, shape = OBJECT_CLASSES[label].split(" ")
    return sample_scene(rng, "single", shape=shape, color=color)


def _position(rng: Rng, label: int) -> Scene:
    # Mostly small objects: a large one at the left also covers the centre.
    size = "small" if rng.random() < 0.7 else "large"
    return sample_scene(rng, "single", position=POSITIONS[label], size=size)


_OBJECT_TEMPLATES = (
    "a photo of a {c}.",
    "a {c}.",
    "a picture of a {c}.",
    "an image of a {c}.",
    "a drawing of a {c}.",
    "a rendering of a {c}.",
)

TASKS: tuple[Task, ...] = (
    Task("synth/objects", OBJECT_CLASSES, _OBJECT_TEMPLATES, _objects),
    Task(
        "synth/shape",
        SHAPES,
        _OBJECT_TEMPLATES,
        lambda rng, y: sample_scene(rng, "single", shape=SHAPES[y]),
    ),
    Task(
        "synth/color",
        COLOR_NAMES,
        ("a photo of a {c} shape.", "a {c} shape.", "a {c} object.", "something {c}."),
        lambda rng, y: sample_scene(rng, "single", color=COLOR_NAMES[y]),
    ),
    Task(
        "synth/count",
        ("one shape", "two shapes", "three shapes", "four shapes"),
        ("a photo of {c}.", "{c}.", "a picture of {c}.", "an image of {c}."),
        lambda rng, y: sample_scene(rng, count=y + 1),
    ),
    Task(
        "synth/background",
        BACKGROUNDS,
        ("a shape on a {c} background.", "a photo of a shape on a {c} background.", "a {c} background."),
        lambda rng, y: sample_scene(rng, background=BACKGROUNDS[y]),
    ),
    Task(
        "synth/position",
        ("at the left", "at the right", "at the top", "at the bottom", "in the center"),
        ("a shape {c}.", "a photo of a shape {c}.", "a picture of something {c}."),
        _position,
    ),
)
RETRIEVAL_TASK = "synth/retrieval"
TASK_NAMES: tuple[str, ...] = tuple(t.name for t in TASKS) + (RETRIEVAL_TASK,)


@dataclass(frozen=True)
class EvalItem:
    """One sample of a webdataset eval tar: an image of `scene` plus a `<key>.<label_ext>` label member."""

    key: str
    scene: Scene
    label_ext: str
    label: str


def _balanced_labels(rng: Rng, n: int, n_classes: int) -> np.ndarray:
    return (np.arange(n) % n_classes)[rng.permutation(n)]


def plan_classification(task: Task, n: int, rng: Rng) -> list[EvalItem]:
    """`n` samples with balanced labels: `<key>.<img>` + `<key>.cls` (class index as text)."""
    return [
        EvalItem(f"s{i:07d}", task.scene(rng, int(y)), "cls", str(int(y)))
        for i, y in enumerate(_balanced_labels(rng, n, len(task.classnames)))
    ]


def plan_retrieval(n: int, rng: Rng) -> list[EvalItem]:
    """`n` scenes, each with `<key>.txt` holding several distinct reference captions, one per line."""
    items = []
    for i in range(n):
        scene = sample_scene(rng)
        texts: list[str] = []
        for level in RETRIEVAL_LEVELS:
            text = cap.caption(scene, level, rng)
            for _ in range(8):  # prefer different phrasings over repeats
                if text not in texts:
                    break
                text = cap.caption(scene, level, rng)
            texts.append(text)
        items.append(EvalItem(f"s{i:07d}", scene, "txt", "\n".join(texts)))
    return items


def plan_reference(per_class: int, rng: Rng) -> list[EvalItem]:
    """ImageNet-like labelled set: iconic (large, centred) single objects of every `synth/objects` class."""
    items = []
    for i, y in enumerate(_balanced_labels(rng, per_class * len(OBJECT_CLASSES), len(OBJECT_CLASSES))):
        color, shape = OBJECT_CLASSES[int(y)].split(" ")
        scene = sample_scene(rng, "single", shape=shape, color=color, size="large", position="center")
        items.append(EvalItem(f"s{i:07d}", scene, "cls", str(int(y))))
    return items


def render_items(items: list[EvalItem], image_ext: str) -> list[tuple[str, bytes]]:
    """Tar members of `items`: images encoded as `image_ext` ("jpg" or the eval format), then labels."""
    members = []
    for it in items:
        img = render(it.scene, EVAL_SIZE_PX, EVAL_SIZE_PX)
        data = encode_jpeg(img, 90) if image_ext == "jpg" else encode_eval(img)
        members += [(f"{it.key}.{image_ext}", data), (f"{it.key}.{it.label_ext}", it.label.encode("utf-8"))]
    return members
