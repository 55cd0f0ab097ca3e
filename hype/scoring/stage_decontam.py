"""Decontamination stage of `hype score --decontaminate EVAL_DIR`: pool samples whose image is (nearly) an
evaluation image. Files: `hype.scoring.decontam`.

1. The evaluation sets (`eval_sets`): every `wds_*` folder of EVAL_DIR is a task (DataComp's layout,
   README "Laying out the real DataComp evaluation sets"; the synthetic world's `eval/`), its tars under
   `test/` (or directly in it); a folder without `wds_*` folders is one webdataset folder, one task.
2. `EvalEmbedStage` (per evaluation shard, resumable like every stage): the CLIP image features of every
   image, with the pool's CLIP model, decoder and preprocessing (the class-image embed stage, with the
   `.cls` optional) -> `RUN_DIR/decontam_eval/<id>.parquet`.
3. `find_matches` (driver): per task a flat inner-product faiss index of the L2-normalised features (on
   the GPUs where faiss-gpu is installed); the pool's CLIP image features are streamed one shard at a
   time and searched against each task (k = 1): a sample whose nearest image of a task has cosine >=
   `decontam.threshold` is a match -> `RUN_DIR/decontam/matches.parquet` + marker `matches.json`, keyed on
   the pool's embeddings, the evaluation shards' embeddings (their file identity and the CLIP model),
   the tasks and the threshold. Memory: the evaluation features and one pool shard.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from hype.io import read_parquet, storage
from hype.scoring import embed_format
from hype.scoring.decontam import (
    EVAL_STAGE,
    MATCH_SCHEMA,
    DecontamError,
    marker_path,
    matches_path,
)
from hype.scoring.embed import ClassEmbedStage
from hype.scoring.rundir import RunDir, ShardTask, atomic_write_json, completed, fingerprint, write_parquet

SEARCH_ROWS = 1 << 15  # pool rows per faiss search call (bounds the distance block)


@dataclass(frozen=True)
class EvalSet:
    task: str
    shards: list[str]


def task_name(folder: str) -> str:
    """`wds_vtab-cifar100_test` -> `vtab-cifar100` (DataComp's folder names); other names as they are."""
    name = folder.rstrip("/").rsplit("/", 1)[-1]
    if name.startswith("wds_"):
        name = name[4:]
        name = name[:-5] if name.endswith("_test") else name
    return name


def _tars(folder: Any) -> list[str]:
    for where in (storage.join(folder, "test"), folder):
        names = [n for n in storage.list_sizes(where) if n.endswith(".tar")]
        if names:
            return [str(storage.join(where, n)) for n in sorted(names)]
    return []


def eval_sets(eval_dir: str) -> tuple[list[EvalSet], list[str]]:
    """(the evaluation sets with tars, the task folders without any) of `--decontaminate EVAL_DIR`."""
    root = storage.location(eval_dir)
    if not storage.is_dir(root):
        raise DecontamError(
            f"--decontaminate {eval_dir}: no such folder; pass the folder of the evaluation sets (the "
            "wds_<task>_test folders, README 'Laying out the real DataComp evaluation sets') or one "
            "webdataset folder of images"
        )
    folders = [n for n in storage.list_names(root) if n.startswith("wds_") and storage.is_dir(root / n)]
    found = [(task_name(n), _tars(root / n)) for n in folders] or [(task_name(str(root)), _tars(root))]
    sets = [EvalSet(task, tars) for task, tars in found if tars]
    if not sets:
        raise DecontamError(
            f"--decontaminate {eval_dir}: no .tar shards in it"
            + (f" nor in its {len(folders)} wds_* folders (looked in <folder>/test/)" if folders else "")
            + "; pass the folder that holds the evaluation webdatasets"
        )
    return sets, [task for task, tars in found if not tars]


class EvalEmbedStage(ClassEmbedStage):
    """CLIP image features of evaluation images (`.cls` optional: retrieval sets have none)."""

    name = EVAL_STAGE
    label_required = False


def decontaminate(state: Any, pool: Any) -> dict | None:
    """The decontamination step of a `hype score` run (`hype.scoring.runner`), or None when not asked for."""
    from hype.scoring.rundir import make_tasks
    from hype.scoring.runner import ScoreError

    dc = state.cfg.decontam
    if dc.eval_dir is None:
        return None
    try:
        sets, empty = eval_sets(dc.eval_dir)
    except DecontamError as e:
        raise ScoreError(str(e)) from None
    for task in empty:
        state.warn(f"--decontaminate: {task} has no .tar shards; not checked")
    tasks = make_tasks([p for s in sets for p in s.shards])
    task_of = {p: s.task for s in sets for p in s.shards}
    stage = EvalEmbedStage(state.run, clip=pool.clip, **pool.embed_kw, **pool.kw)
    stats = state.map(stage, tasks)
    state.check_failures(EVAL_STAGE, state.plan)
    parts = [(task_of[t.path], t) for t in tasks]
    fp = fingerprint(
        {
            "pool": pool.fingerprint,
            "eval": [
                (task, t.path, s["output"]["digest"]) for (task, t), s in zip(parts, stats, strict=True)
            ],
            "threshold": dc.threshold,
        }
    )
    skipped = sum(int((s.get("counts") or {}).get("skipped", 0)) for s in stats)
    try:
        info = state.timed(
            "decontam",
            lambda: find_matches(
                state.run, pool.tasks, parts, dc.threshold, pool.dims["clip"], fp, eval_dir=dc.eval_dir
            ),
        )
    except DecontamError as e:
        raise ScoreError(str(e)) from None
    return info | {"eval_skipped": skipped}


def find_matches(
    run: RunDir,
    pool_tasks: list[ShardTask],
    eval_parts: list[tuple[str, ShardTask]],
    threshold: float,
    width: int,
    fp: str,
    *,
    eval_dir: str = "",
    progress: Callable[[int], None] | None = None,
) -> dict:
    """Search every pool sample's CLIP image feature against each task's evaluation images; write the
    matches at cosine >= `threshold` and their marker; return the marker (reused when `fp` matches)."""
    marker, out = marker_path(run.root), matches_path(run.root)
    done = completed(marker, fp, out)
    if done is not None:
        return done
    started = time.perf_counter()
    indexes = _task_indexes(run, eval_parts, width)
    gpu = _use_gpu()
    cols: dict[str, list] = {name: [] for name in MATCH_SCHEMA.names}
    pool_rows = 0
    for task in pool_tasks:
        t = read_parquet(run.shard_output("embed", task), columns=["uid", "key", "clip_img"])
        x = normalise(embed_format.fixed_list_to_numpy(t.column("clip_img")))
        pool_rows += len(x)
        if not len(x):
            continue
        for name, (index, shards, keys) in indexes.items():
            sims, ids = _search(index, x)
            rows = np.flatnonzero(sims >= threshold)
            if not len(rows):
                continue
            cols["uid"] += t.column("uid").take(pa.array(rows)).to_pylist()
            cols["shard"] += [task.path] * len(rows)
            cols["key"] += t.column("key").take(pa.array(rows)).to_pylist()
            cols["task"] += [name] * len(rows)
            cols["eval_shard"] += [shards[i] for i in ids[rows]]
            cols["eval_key"] += [keys[i] for i in ids[rows]]
            cols["similarity"].append(sims[rows])
        if progress is not None:
            progress(len(x))
    sims = np.concatenate(cols["similarity"]) if cols["similarity"] else np.zeros(0, np.float32)
    table = pa.table(
        {**{k: v for k, v in cols.items() if k != "similarity"}, "similarity": sims}, MATCH_SCHEMA
    )
    if table.num_rows:  # strongest matches first within each task
        table = table.sort_by([("task", "ascending"), ("similarity", "descending"), ("uid", "ascending")])
    output = write_parquet(out, table)
    per_task = dict.fromkeys(indexes, 0)
    for name in table.column("task").to_pylist():
        per_task[name] += 1
    info = {
        "fingerprint": fp,
        "eval_dir": eval_dir,
        "threshold": threshold,
        "similarity": "cosine of the L2-normalised CLIP image features; the nearest image of each task",
        "pool_samples": pool_rows,
        "flagged_samples": len(set(table.column("uid").to_pylist())),
        "tasks": {
            name: {"eval_images": len(keys), "matches": per_task[name]}
            for name, (_, _, keys) in indexes.items()
        },
        "faiss": "gpu" if gpu else "cpu",
        "output": output,
        "seconds": round(time.perf_counter() - started, 4),
    }
    atomic_write_json(marker, info)
    return info


def normalise(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (float32, contiguous; an all-zero row stays zero)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return np.ascontiguousarray(x / np.where(norms > 0, norms, 1.0), dtype=np.float32)


def _task_indexes(run: RunDir, eval_parts: list[tuple[str, ShardTask]], width: int) -> dict[str, tuple]:
    """task -> (flat inner-product index of its normalised features, eval shard per row, key per row)."""
    feats: dict[str, list[np.ndarray]] = {}
    shards: dict[str, list[str]] = {}
    keys: dict[str, list[str]] = {}
    for name, part in eval_parts:
        t = read_parquet(run.shard_output(EVAL_STAGE, part), columns=["key", "clip_img"])
        x = embed_format.fixed_list_to_numpy(t.column("clip_img")).reshape(t.num_rows, -1)
        if t.num_rows and x.shape[1] != width:
            raise DecontamError(
                f"{part.path}: evaluation features of width {x.shape[1]}, the pool's CLIP features have "
                f"{width}; with --metadata, --clip must be the CLIP model that made the metadata's features"
            )
        feats.setdefault(name, []).append(x)
        shards.setdefault(name, []).extend([part.path] * t.num_rows)
        keys.setdefault(name, []).extend(t.column("key").to_pylist())
    out = {}
    for name in sorted(feats):
        x = normalise(np.concatenate(feats[name]).reshape(-1, width))
        if len(x):
            out[name] = (_flat_ip(x), shards[name], keys[name])
    if not out:
        raise DecontamError(
            "--decontaminate: no evaluation image could be embedded (see RUN_DIR/decontam_eval/*_stats.json)"
        )
    return out


def _use_gpu() -> bool:
    import faiss

    return hasattr(faiss, "index_cpu_to_all_gpus") and getattr(faiss, "get_num_gpus", lambda: 0)() > 0


def _flat_ip(x: np.ndarray):
    import faiss

    index = faiss.IndexFlatIP(x.shape[1])
    if _use_gpu():
        index = faiss.index_cpu_to_all_gpus(index)
    index.add(x)
    return index


def _search(index, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cosine, row) of the nearest indexed image of every row of `x`, in blocks of `SEARCH_ROWS`."""
    sims = np.empty(len(x), np.float32)
    ids = np.empty(len(x), np.int64)
    for start in range(0, len(x), SEARCH_ROWS):
        d, i = index.search(x[start : start + SEARCH_ROWS], 1)
        sims[start : start + len(d)], ids[start : start + len(d)] = d[:, 0], i[:, 0]
    return sims, ids
