"""Shared settings of the training tests (imported as `from train_helpers import ...`, like `reference`)."""

from pathlib import Path

import numpy as np
import pandas as pd

from hype.table.schema import METRICS

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


def clean_scores(world: Path, cos: np.ndarray | None = None) -> pd.DataFrame:
    """A scores table (`test_select_helpers.write_scores`) of a world's clean shards for soft-cap sampling:
    cos_theta ranks the samples (`cos`, default evenly from -1 to 1), the other metrics are 0."""
    df = pd.read_parquet(world / "clean" / "truth.parquet", columns=["uid"])
    for col in METRICS:
        df[col] = np.float32(0)
    df["cos_theta"] = (np.linspace(-1, 1, len(df)) if cos is None else cos).astype(np.float32)
    df["shard"] = df["key"] = df["text"] = ""
    df["width"] = df["height"] = np.int32(32)
    return df
