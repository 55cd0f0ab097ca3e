"""Decontamination's files and reading: where `hype score --decontaminate` writes its matches, and how the
`decontaminate` filter and `hype report` read them (NumPy and Arrow only: no model, no faiss).

    RUN_DIR/decontam_eval/<id>.parquet (+ _stats.json)   CLIP image features of the evaluation images
    RUN_DIR/decontam/matches.parquet (+ matches.json)     one row per (pool sample, task) whose best
                                                         evaluation image has cosine >= the threshold

A row of matches.parquet: `uid`, `shard` and `key` of the pool sample, `task`, `eval_shard` and `eval_key`
of the matched evaluation image of that task, `similarity` (cosine of the L2-normalised CLIP image
features) and `copy_similarity` (the pixel copy check's, `hype.scoring.copydetect`; NaN when the run
matched on CLIP features only). With the copy check the matched image is the candidate (one of the
`decontam.candidates` nearest at cosine >= the threshold) with the highest copy similarity, kept when that
is >= `decontam.copy_threshold`; without it, the nearest image at cosine >= the threshold. The marker
matches.json records the thresholds and the copy check's settings, the evaluation sets (images per task),
the counts per task and the fingerprint (the pool's embeddings, the evaluation shards' embeddings, the
tasks, the thresholds, the copy check's settings).
"""

from __future__ import annotations

from dataclasses import dataclass
from os import PathLike

import numpy as np
import pyarrow as pa

from hype.data.uids import UidMultiset, to_structured, uids_to_pairs
from hype.io import read_json, read_parquet, storage
from hype.io.storage import AnyPath

MATCHES_DIR = "decontam"
EVAL_STAGE = "decontam_eval"  # the per-shard stage embedding the evaluation images
MATCH_COLUMNS = ("uid", "shard", "key", "task", "eval_shard", "eval_key", "similarity", "copy_similarity")
MATCH_SCHEMA = pa.schema(
    [
        ("uid", pa.string()),
        ("shard", pa.string()),
        ("key", pa.string()),
        ("task", pa.string()),
        ("eval_shard", pa.string()),
        ("eval_key", pa.string()),
        ("similarity", pa.float32()),
        ("copy_similarity", pa.float32()),
    ]
)


class DecontamError(ValueError):
    """Evaluation sets or matches that cannot be used; the message names the path and the fix."""


def matches_path(run_dir: str | PathLike | AnyPath) -> AnyPath:
    return storage.join(run_dir, MATCHES_DIR, "matches.parquet")


def marker_path(run_dir: str | PathLike | AnyPath) -> AnyPath:
    return storage.join(run_dir, MATCHES_DIR, "matches.json")


@dataclass(frozen=True)
class Matches:
    """The matches of a run at or above `threshold` (a few rows per contaminated sample)."""

    table: pa.Table
    threshold: float  # applied here
    recorded: float  # the run recorded matches at or above this
    marker: dict

    def flagged(self) -> UidMultiset:
        """The distinct flagged uids, for lookups by (hi, lo)."""
        uids = pa.compute.unique(self.table.column("uid")).to_pylist()
        hi, lo = uids_to_pairs(uids)
        order = np.lexsort((lo, hi))
        return UidMultiset(to_structured(hi[order], lo[order]))

    def per_task(self) -> dict[str, int]:
        """Flagged pool samples per task (a sample near images of two tasks counts in both)."""
        tasks = self.table.column("task").to_pylist()
        names, counts = np.unique(np.array(tasks, dtype=object), return_counts=True) if tasks else ([], [])
        return {str(n): int(c) for n, c in zip(names, counts, strict=True)}


def read_matches(run_dir: str | PathLike | AnyPath, threshold: float | None = None) -> Matches | None:
    """The run's matches at `threshold` (None: the run's own), or None when the run was not decontaminated.
    A threshold below the recorded one cannot be answered from the file: `DecontamError`."""
    path, marker = matches_path(run_dir), read_json(marker_path(run_dir))
    if marker is None or not storage.is_file(path):
        return None
    recorded = float(marker["threshold"])
    if threshold is None:
        threshold = recorded
    if threshold < recorded:
        raise DecontamError(
            f"{path}: matches were recorded at cosine >= {recorded}; threshold {threshold} needs a rescore "
            f"with `hype score ... --decontaminate EVAL_DIR decontam.threshold={threshold}`"
        )
    table = read_parquet(path)
    if "copy_similarity" not in table.column_names:  # written before the copy check: CLIP only
        table = table.append_column("copy_similarity", pa.nulls(table.num_rows, pa.float32()))
    table = table.select(list(MATCH_COLUMNS))
    sims = table.column("similarity").to_numpy(zero_copy_only=False)
    table = table.filter(pa.array(sims >= threshold))
    return Matches(table, float(threshold), recorded, marker)
