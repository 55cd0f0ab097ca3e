"""A curator's labels on a sample of the synthetic pool, from its truth table (for `hype fit`).

A curator looks at a few hundred samples of the pool and marks each keep or drop; in the synthetic world
the truth table knows the answer: a clean sample is kept, every noise kind (misaligned, underspecified
image or text, near-duplicate) dropped. The sample is drawn from the pool only, never from `eval/`.
"""

from __future__ import annotations

from os import PathLike
from pathlib import Path

import numpy as np
import pyarrow as pa

from hype.io import read_parquet, write_parquet


def curator_labels(world: str | PathLike, out: str | PathLike, rows: int = 300, seed: int = 0) -> Path:
    """Write `rows` pool samples drawn at random (by `seed`) as a Parquet of uid, keep (1 clean, 0 noise)."""
    truth = read_parquet(Path(world) / "truth.parquet", ["uid", "noise"])
    rng = np.random.default_rng([seed, 0x1ABE15])
    pick = np.sort(rng.choice(truth.num_rows, size=min(rows, truth.num_rows), replace=False))
    sample = truth.take(pa.array(pick))
    keep = np.array(sample.column("noise").to_pylist()) == "clean"
    return write_parquet(out, pa.table({"uid": sample.column("uid"), "keep": pa.array(keep.astype(np.int8))}))
