"""Shared settings of the training tests (imported as `from train_helpers import ...`, like `reference`)."""

# Every geometry with a CPU-tiny training preset `configs/train/tiny-<name>.yaml`.
TINY_GEOMETRIES = [
    "clip",
    "elliptic",
    "euclidean",
    "euclidean-squared",
    "hyperbolic",
    "hyperbolic-squared",
    "oblique",
    "oblique-multi",
]

# Overrides that shrink a tiny preset's model to one layer at 32 px: seconds per test on a CPU.
MICRO = [
    "model.embed_dim=32",
    "model.vision.image_size=32",
    "model.vision.width=32",
    "model.vision.layers=1",
    "model.vision.head_width=16",
    "model.text.width=32",
    "model.text.heads=2",
    "model.text.layers=1",
    "model.text.context_length=16",
]
