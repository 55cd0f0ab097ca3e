"""The scores table: what `hype score` writes and `hype select`, `hype report` and filters read.

A run directory holds it as a partitioned Parquet table, `RUN_DIR/scores/part-*.parquet`, one row per
scored sample (skipped samples are counted in the run's stats, not listed here). Metric columns are the
HYPE terms; the rest are diagnostics that filters and the report use.
"""

from __future__ import annotations

from os import PathLike

import pyarrow as pa

from hype.io import storage
from hype.io.storage import AnyPath

# The five HYPE terms (DESIGN §1), in the order of paper Eq. 1.
METRICS = ("eps_i", "eps_t", "neg_d_l", "cos_theta", "c_in")

SCHEMA = pa.schema(
    [
        pa.field("uid", pa.string(), nullable=False),  # 32 lowercase hex chars
        pa.field("eps_i", pa.float32()),  # image specificity ε_i
        pa.field("eps_t", pa.float32()),  # text specificity ε_t
        pa.field("neg_d_l", pa.float32()),  # -d_L between the MERU image and text embeddings
        pa.field("cos_theta", pa.float32()),  # CLIP cosine similarity
        pa.field("c_in", pa.float32()),  # 10 if in an ImageNet-like cluster (and caption passes), else 0
        pa.field("shard", pa.string()),  # input tar path as given to `hype score`
        pa.field("key", pa.string()),  # sample key inside the tar
        pa.field("text", pa.string()),  # caption
        pa.field("width", pa.int32()),  # original image width (json original_width, else decoded)
        pa.field("height", pa.int32()),  # original image height
    ]
)


def scores_dir(run_dir: str | PathLike | AnyPath) -> AnyPath:
    """Folder of the partitioned scores table inside a run directory (a local path or a URL)."""
    return storage.join(run_dir, "scores")
