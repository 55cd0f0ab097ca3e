"""Reference stage: the paper's two-step selection of S_i and S_t, streamed over the embed outputs.

HYPE §3.3, exactly as `hype.scoring.reference.select_references` does it in memory (tested equal):
1. `select_top_pairs` (driver): the N pairs with the highest cos θ across all shards, by a running
   top-N over the cos θ column (ties: pool order), then their MERU image and text embeddings, in rank
   order -> `RUN_DIR/reference/top_n.safetensors`.
2. `CandidateStage` (per shard, any executor): the mean L_e of every image against the N texts and of
   every text against the N images -> `RUN_DIR/reference/<shard id>.parquet` (img_score, txt_score).
3. `select_top_m` (driver): a running top-M over those scores for images and for texts, then their
   embeddings -> S_i, S_t as tangent vectors in `RUN_DIR/reference.safetensors` (ReferenceSet.save).

Memory stays bounded by N, M and one shard. Duplicate uids (all but the first) take no part. N and M
are reduced with a warning when the pool is smaller. None of this runs when a run grows: its S_i/S_t stay
as they were chosen (`hype.scoring.grow`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save

from hype.geometry import lorentz
from hype.io import blake2b128_file, read_bytes, read_parquet
from hype.scoring import embed_format
from hype.scoring.dedup import keep_mask
from hype.scoring.reference import ReferenceSet, load_reference
from hype.scoring.rundir import (
    RunDir,
    ShardTask,
    atomic_write_bytes,
    atomic_write_json,
    completed,
    read_json,
)
from hype.scoring.stage_specificity import MeanEnergyStage
from hype.scoring.topk import RunningTopK, order_id, split_order_id

log = logging.getLogger(__name__)


def _gather(
    run: RunDir, tasks: list[ShardTask], ids: np.ndarray, columns: list[str]
) -> dict[str, np.ndarray]:
    """Embeddings of the rows `ids` (global order ids), in the order of `ids`."""
    by_index = {t.index: t for t in tasks}
    shard, row = split_order_id(ids)
    out: dict[str, np.ndarray] = {}
    for s in np.unique(shard):
        sel = np.nonzero(shard == s)[0]
        table = read_parquet(run.shard_output("embed", by_index[int(s)]), columns=columns)
        for c in columns:
            block = embed_format.fixed_list_to_numpy(table.column(c))[row[sel]]
            if c not in out:
                out[c] = np.empty((len(ids), block.shape[1]), dtype=np.float32)
            out[c][sel] = block
    return out


def select_top_pairs(
    run: RunDir,
    tasks: list[ShardTask],
    drops: dict[int, np.ndarray],
    n_top: int,
    fp: str,
    warn: Callable[[str], None],
) -> dict:
    """Step 1: the top-N pairs by cos θ and their MERU embeddings (reused when current)."""
    marker = run.marker_of(run.top_n)
    done = completed(marker, fp, run.top_n)
    if done is not None:
        return done
    started = time.perf_counter()
    top = RunningTopK(n_top)
    pool = 0
    for task in tasks:
        cos = read_parquet(run.shard_output("embed", task), columns=["cos_theta"]).column(0).to_numpy()
        keep = keep_mask(len(cos), drops.get(task.index))
        pool += int(keep.sum())
        rows = np.nonzero(keep)[0]
        top.add(cos[rows].astype(np.float32), order_id(task.index, rows))
    if pool == 0:
        raise ValueError("no sample was embedded: nothing to select references from (see the embed stats)")
    if n_top > pool:
        warn(f"pool of {pool} samples: reference N reduced from {n_top} to {pool}")
    emb = _gather(run, tasks, top.ids, ["meru_img", "meru_txt"])
    tensors = {
        "img": torch.from_numpy(emb["meru_img"]),
        "txt": torch.from_numpy(emb["meru_txt"]),
        "ids": torch.from_numpy(top.ids),
    }
    atomic_write_bytes(run.top_n, save(tensors))
    info = {
        "fingerprint": fp,
        "output": {"file": run.top_n.name, "bytes": run.top_n.stat().st_size},
        "digest": blake2b128_file(run.top_n),
        "n_top": len(top),
        "pool": pool,
        "seconds": round(time.perf_counter() - started, 4),
    }
    atomic_write_json(marker, info)
    return info


class CandidateStage(MeanEnergyStage):
    """Step 2, per shard: mean L_e of each image (text) against the N top texts (images)."""

    name = "reference"
    columns = ("img_score", "txt_score")
    sets_key = "top_n"

    def __init__(self, run: RunDir, *, top_n_digest: str, **kw):
        super().__init__(run, sets_digest=top_n_digest, **kw)

    def load_sets(self) -> tuple[torch.Tensor, torch.Tensor]:
        data = safetensors_load(read_bytes(self.run_dir.top_n))  # a local file or an object in a bucket
        return data["img"], data["txt"]


def select_top_m(
    run: RunDir,
    tasks: list[ShardTask],
    drops: dict[int, np.ndarray],
    m: int,
    meta: dict,
    fp: str,
    warn: Callable[[str], None],
) -> dict:
    """Step 3: S_i and S_t, the M images and texts with the highest mean L_e; saved as tangent vectors."""
    marker = run.reference_marker
    done = completed(marker, fp, run.reference)
    if done is not None:
        return done
    started = time.perf_counter()
    top_img, top_txt = RunningTopK(m), RunningTopK(m)
    pool = 0
    for task in tasks:
        t = read_parquet(run.shard_output("reference", task))
        rows = np.nonzero(keep_mask(t.num_rows, drops.get(task.index)))[0]
        pool += len(rows)
        ids = order_id(task.index, rows)
        top_img.add(t.column("img_score").to_numpy()[rows], ids)
        top_txt.add(t.column("txt_score").to_numpy()[rows], ids)
    if m > pool:
        warn(f"pool of {pool} samples: reference M reduced from {m} to {pool}")
    curv = meta["curv"]
    img = _gather(run, tasks, top_img.ids, ["meru_img"])["meru_img"]
    txt = _gather(run, tasks, top_txt.ids, ["meru_txt"])["meru_txt"]
    refs = ReferenceSet(
        lorentz.log_map0(torch.from_numpy(img), curv).float(),
        lorentz.log_map0(torch.from_numpy(txt), curv).float(),
        meta | {"m": len(top_img), "pool": pool, "source": "selected", "streaming": True},
    )
    refs.save(run.reference)
    info = {
        "fingerprint": fp,
        "output": {"file": run.reference.name, "bytes": run.reference.stat().st_size},
        "digest": blake2b128_file(run.reference),
        "source": "selected",
        "meta": refs.meta,
        "seconds": round(time.perf_counter() - started, 4),
    }
    atomic_write_json(marker, info)
    return info


def copy_reference_file(run: RunDir, path: str, dim: int, fp: str) -> dict:
    """A user-supplied reference file (`--reference`): validated, then copied into the run directory."""
    marker = run.reference_marker
    done = completed(marker, fp, run.reference)
    if done is not None:
        return done
    started = time.perf_counter()
    refs = load_reference(path, dim=dim)
    if str(path).endswith(".safetensors"):
        atomic_write_bytes(run.reference, read_bytes(path))
    else:
        refs.save(run.reference)
    info = {
        "fingerprint": fp,
        "output": {"file": run.reference.name, "bytes": run.reference.stat().st_size},
        "digest": blake2b128_file(run.reference),
        "source": str(path),
        "meta": {"m_img": refs.img.shape[0], "m_txt": refs.txt.shape[0]},
        "seconds": round(time.perf_counter() - started, 4),
    }
    atomic_write_json(marker, info)
    return info


def reference_info(run: RunDir) -> dict | None:
    return read_json(run.reference_marker)
