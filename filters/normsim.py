"""`normsim`: NormSim (Wang et al., NeurIPS 2024, "CLIPLoss and Norm-Based Data Selection Methods for
Multimodal Contrastive Learning"): how close an image is to a target set, the p-norm of its similarities to
the target's image embeddings,

    normsim_p(i) = || (x_i·t)_{t∈T} ||_p   (p = 2: (Σ_t (x_i·t)²)^½;  p = inf: max_t |x_i·t|)

x_i: the pool's unit CLIP image embeddings (`RUN_DIR/embed/` clip_img); T: `target=`, a folder (or file) of
precomputed unit features of the run's CLIP, `.npy` (rows x d float) or `.parquet` (a `clip_img` column, e.g.
another run's embed/ tables), streamed a block at a time. Never the evaluation images: a target inside the
run's `decontam.eval_dir` (or holding it) is refused. Exact as `hype.filters.embeddings` says; blocks have a
fixed size, so the sum's order is the same on any machine.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from hype.config import ConfigError, parse_yaml
from hype.filters.embeddings import PoolEmbeddings, PoolRule, grid_unit, on_grid
from hype.io import NPY_ERRORS, StorageError, read_bytes, read_parquet, storage
from hype.scoring.embed_format import fixed_list_to_numpy
from hype.select.errors import SelectError
from hype.select.rules import RULES

BLOCK = 4096  # target rows per block: fixed, so the float64 sums run in one order everywhere
CHUNK_BYTES = 32 << 20  # one block of similarities (pool rows x BLOCK), float64


@RULES.register
class NormSim(PoolRule):
    name: ClassVar[str] = "normsim"
    summary: ClassVar[str] = "NormSim: p-norm of an image's CLIP similarities to a target set's images"
    PARAMS: ClassVar = {
        "target": (
            str,
            "",
            "folder or file of target CLIP image features (.npy rows x d, or .parquet clip_img)",
        ),
        "p": (str, "inf", "2 | inf: the norm over the target set"),
        "max_gb": (float, 16.0, "refuse a pool whose image embeddings (as read and on the grid) exceed this"),
    }

    def __init__(self, **params: Any):
        super().__init__(**params)
        if self.params["p"] not in ("2", "inf"):
            raise SelectError(f"rule 'normsim': p={self.params['p']!r}; use p=2 or p=inf")
        if not self.params["target"]:
            raise SelectError(
                "rule 'normsim' needs a target: normsim:target=FOLDER of .npy/.parquet features"
            )

    def attach(self, table) -> None:
        for folder in table.folders:  # before anything is read
            refuse_evaluation_images(self.params["target"], folder.parent)
        super().attach(table)

    def pool_values(self, table, pool: PoolEmbeddings) -> np.ndarray:
        x = pool.arrays["clip_img"]
        values, rows = norm_sim(x, target_blocks(self.params["target"], x.shape[1]), self.params["p"])
        self.found = {"target_rows": rows}
        return values


def norm_sim(x: np.ndarray, blocks: Iterator[np.ndarray], p: str) -> tuple[np.ndarray, int]:
    """(NormSim_p of each row of unit `x` against the target rows of `blocks`, the target's row count)."""
    qx, unit = on_grid(x), grid_unit(x.shape[1])
    acc, rows = np.zeros(len(x)), 0
    step = max(1, CHUNK_BYTES // (8 * BLOCK))  # pool rows per similarity block
    for block in blocks:
        qb = on_grid(block)
        for s in range(0, len(x), step):
            sims = (qx[s : s + step] @ qb.T) * unit  # exact dot products, one rounding
            if p == "2":
                acc[s : s + step] += np.add.reduce(sims * sims, axis=1)
            else:
                acc[s : s + step] = np.maximum(acc[s : s + step], np.abs(sims).max(axis=1))
        rows += len(block)
    if rows == 0:
        raise SelectError("rule 'normsim': the target has no rows")
    return (np.sqrt(acc) if p == "2" else acc), rows


def target_blocks(target: str, dim: int) -> Iterator[np.ndarray]:
    """The target's unit feature rows, BLOCK at a time, files in name order (a local .npy memory-mapped:
    one block in memory); each file checked, every problem one line."""
    files = (
        [target]
        if storage.is_file(target)
        else sorted(f for f in storage.glob(f"{target.rstrip('/')}/*") if f.endswith((".npy", ".parquet")))
    )
    if not files:
        raise SelectError(f"rule 'normsim': no .npy or .parquet features in {target}; pass their folder")
    for f in files:
        feats = _read_features(f)
        if feats.ndim != 2 or feats.shape[1] != dim or feats.dtype.kind != "f":
            raise SelectError(
                f"rule 'normsim': {f} holds {feats.dtype} features of shape {feats.shape}, not rows of the "
                f"run's CLIP width {dim}; embed the target with the CLIP that scored the run"
            )
        for s in range(0, len(feats), BLOCK):
            block = np.asarray(feats[s : s + BLOCK], np.float64)
            if not np.isfinite(block).all():
                raise SelectError(f"rule 'normsim': {f} has NaN or inf in rows {s}..{s + len(block) - 1}")
            yield block / np.maximum(np.linalg.norm(block, axis=1, keepdims=True), 1e-12)  # unit, as the pool


def _read_features(path: str) -> np.ndarray:
    try:
        if path.endswith(".parquet"):
            return fixed_list_to_numpy(read_parquet(path, columns=["clip_img"]).column("clip_img"))
        if not storage.is_url(path):
            return np.load(path, mmap_mode="r", allow_pickle=False)  # data, never code
        return np.load(io.BytesIO(read_bytes(path)), allow_pickle=False)
    except (*NPY_ERRORS, OSError, StorageError, KeyError) as e:
        raise SelectError(
            f"rule 'normsim': {path} is not a .npy array or a Parquet file with a clip_img column ({e})"
        ) from None
    except Exception as e:  # pyarrow's errors (a damaged or foreign Parquet file)
        raise SelectError(
            f"rule 'normsim': {path} is not a readable Parquet file ({type(e).__name__})"
        ) from None


def refuse_evaluation_images(target: str, run_dir: Path) -> None:
    """A target that is, holds or lies inside the run's evaluation images (decontam.eval_dir) is refused:
    selecting toward the evaluation set would leak it into training."""
    try:
        config = parse_yaml(read_bytes(f"{run_dir}/config.yaml"), f"{run_dir}/config.yaml") or {}
    except (OSError, StorageError, ConfigError):
        return  # no recorded config: nothing to compare with
    eval_dir = ((config.get("decontam") or {}).get("eval_dir")) if isinstance(config, dict) else None
    if not eval_dir:
        return
    t, e = Path(str(target)).resolve(), Path(str(eval_dir)).resolve()
    if t == e or e in t.parents or t in e.parents:
        raise SelectError(
            f"rule 'normsim': target {target} overlaps the run's evaluation images ({eval_dir}); "
            "use a target set disjoint from the evaluation tasks (e.g. ImageNet-1k train features)"
        )
