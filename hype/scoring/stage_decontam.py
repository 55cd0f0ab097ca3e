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
   time and searched against each task. With the copy check (default), a pool sample's
   `decontam.candidates` nearest images of a task at cosine >= `decontam.threshold` are candidates: the
   shard's tar is read once for the candidates' images, and consecutive shards' candidates are gathered
   into blocks (`BLOCK_IMAGES`, `BLOCK_PAIRS`) that `hype.scoring.copydetect` checks at once against the
   evaluation images (decoded once, before the pool, into 64 x 64 RGB work images), so that each
   evaluation image's windows are computed once per block; the candidate of highest copy similarity is a
   match when that is >= `decontam.copy_threshold`. Without
   it (`--no-copy-check`), the nearest image at cosine >= the threshold is the match.
   -> `RUN_DIR/decontam/matches.parquet` + marker `matches.json`, keyed on the pool's embeddings, the
   evaluation shards' embeddings (their file identity and the CLIP model), the tasks, the thresholds and
   the copy check's settings. Memory: the evaluation features (4 x d bytes an image), the evaluation work
   images (12,288 bytes an image: 43 MB for the 3,500 images of the synthetic world, ~1.2 GB per 100,000
   evaluation images), one pool shard's features, one block's candidate pairs (~40 bytes each) and pool
   work images (~100 MB), one image's windows.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import pyarrow as pa

from hype.io import read_parquet, storage
from hype.scoring import embed_format
from hype.scoring.context import StageSpec, SummaryView
from hype.scoring.copydetect import (
    WORK_FORMAT,
    WORK_SIDE,
    CopyCheck,
    occurrences,
    pair_similarities,
    tar_work_images,
)
from hype.scoring.decontam import (
    EVAL_STAGE,
    MATCH_SCHEMA,
    DecontamError,
    marker_path,
    matches_path,
)
from hype.scoring.embed import ClassEmbedStage
from hype.scoring.errors import ScoreError
from hype.scoring.pricing import MISSING, ShardReads, add, parquet_get, stream_get
from hype.scoring.rundir import (
    RunDir,
    ShardTask,
    atomic_write_json,
    completed,
    fingerprint,
    make_tasks,
    write_parquet,
)

SEARCH_ROWS = 1 << 15  # pool rows per faiss search call (bounds the distance block)
BLOCK_IMAGES = 8192  # pool work images (48 KiB each) gathered before the copy check runs on them
BLOCK_PAIRS = 1 << 22  # candidate pairs gathered before the copy check runs on them


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
    """The decontamination step of a `hype score` run (`state`: its `RunContext`, `pool`: the embedded
    pool), or None when not asked for."""
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
    search = search_of(dc)
    fp = fingerprint(
        {
            "pool": pool.fingerprint,
            "eval": [
                (task, t.path, s["output"]["digest"]) for (task, t), s in zip(parts, stats, strict=True)
            ],
            "threshold": dc.threshold,
            "search": search.describe(),
        }
    )
    skipped = dict.fromkeys(task_of.values(), 0)  # evaluation samples the embed stage skipped, per task
    for (task, _), s in zip(parts, stats, strict=True):
        skipped[task] += int((s.get("counts") or {}).get("skipped", 0))
    try:
        info = state.timed(
            "decontam",
            lambda: find_matches(
                state.run,
                pool.tasks,
                parts,
                search,
                pool.dims["clip"],
                fp,
                eval_dir=dc.eval_dir,
                skipped=skipped,
            ),
        )
    except DecontamError as e:
        raise ScoreError(str(e)) from None
    for task, n in info.get("tasks_without_usable_images", {}).items():
        state.warn(
            f"--decontaminate: {task} has no image that could be embedded ({n} skipped, reasons in "
            f"RUN_DIR/{EVAL_STAGE}/*_stats.json); not checked"
        )
    for task, t in info["tasks"].items():
        if t.get("repeated_keys"):
            state.warn(
                f"--decontaminate: {task}: {t['repeated_keys']} images share a key with another image of "
                "their shard; each is checked, and its matches name the shared key"
            )
    return info | {"eval_skipped": sum(skipped.values())}


def search_of(dc: Any) -> Search:
    """The `Search` of a `DecontamConfig`: `CopyCheck`'s own (the near-duplicate stage's) at
    `decontam.copy_threshold`, without its second (anisotropic) search: what that adds is jittered
    near-duplicates; here it found no more evaluation copies and flagged ~45% more clean look-alikes
    (bench/RESULTS.md, 2026-11-29 fourth pass). The third search around each side's best window stays: with
    the square windows alone, 10% crops of images with detail everywhere fell under 0.9 (#37 item 5's
    eighth pass, tests/test_copydetect.py)."""
    check = CopyCheck(threshold=dc.copy_threshold, refine_from=None) if dc.copy_check else None
    return Search(dc.threshold, dc.candidates, check)


def find_matches(
    run: RunDir,
    pool_tasks: list[ShardTask],
    eval_parts: list[tuple[str, ShardTask]],
    search: Search,
    width: int,
    fp: str,
    *,
    eval_dir: str = "",
    progress: Callable[[int], None] | None = None,
    skipped: dict[str, int] | None = None,
) -> dict:
    """Search every pool sample's CLIP image feature against each task's evaluation images; with a copy
    check, verify the candidates from pixels; write the matches and their marker; return the marker
    (reused when `fp` matches). `skipped`: evaluation samples the embed stage skipped, per task (a task
    without any embedded image is recorded, not checked)."""
    skipped = skipped or {}
    marker, out = marker_path(run.root), matches_path(run.root)
    done = completed(marker, fp, out)
    if done is not None:
        return done
    started = time.perf_counter()
    indexes = _task_indexes(run, eval_parts, width)
    gpu = _use_gpu()
    check = search.check
    sources = {p.path: p.source for _, p in eval_parts}
    evals = _EvalImages(indexes, sources, check.work_side) if check is not None else None
    setup_s = time.perf_counter() - started  # does not grow with the pool (`hype plan` keeps it fixed)
    found = _Found(indexes)
    block = _Block(check.work_side if check is not None else WORK_SIDE)
    pool_rows = 0
    for task in pool_tasks:
        t = read_parquet(run.shard_output("embed", task), columns=["uid", "key", "clip_img"])
        x = normalise(embed_format.fixed_list_to_numpy(t.column("clip_img")))
        pool_rows += len(x)
        if len(x):
            cands = _candidates(indexes, x, search)
            if evals is None:
                found.add(task, t, cands)
            elif block.add(task, t, cands, found):  # full: check it
                block = block.check(evals, check, found)
        if progress is not None:
            progress(len(x))
    if evals is not None:
        block.check(evals, check, found)
    table = found.table()
    output = write_parquet(out, table)
    per_task = dict.fromkeys(indexes, 0)
    for name in table.column("task").to_pylist():
        per_task[name] += 1
    info = {
        "fingerprint": fp,
        "eval_dir": eval_dir,
        "threshold": search.threshold,
        "similarity": "cosine of the L2-normalised CLIP image features; the nearest image of each task",
        **search.describe(),
        "pool_samples": pool_rows,
        "flagged_samples": len(set(table.column("uid").to_pylist())),
        "tasks": {
            name: {
                "eval_images": len(keys),
                "eval_skipped": skipped.get(name, 0),
                "repeated_keys": _repeated(shards, keys),
                "matches": per_task[name],
            }
            for name, (_, shards, keys) in indexes.items()
        },
        "tasks_without_usable_images": {
            task: skipped.get(task, 0) for task in sorted({task for task, _ in eval_parts} - set(indexes))
        },
        "faiss": "gpu" if gpu else "cpu",
        "output": output,
        "seconds": round(time.perf_counter() - started, 4),
        "eval_setup_seconds": round(setup_s, 4),
    }
    if evals is not None:
        info["copy_check"] |= {
            "candidates_checked": found.checked,
            **found.windowed,
            "pool_images_unreadable": found.unreadable,
            "eval_images_unreadable": evals.unreadable,
            "eval_thumbnail_bytes": evals.nbytes,
        }
    atomic_write_json(marker, info)
    return info


@dataclass(frozen=True)
class Search:
    """How pool samples are matched: CLIP nearest neighbours at cosine >= `threshold`; with `check`, the
    `candidates` nearest of each task are candidates and the pixel copy check decides."""

    threshold: float
    candidates: int = 1
    check: CopyCheck | None = None

    @property
    def k(self) -> int:
        return self.candidates if self.check is not None else 1

    def describe(self) -> dict:
        if self.check is None:
            return {"copy_check": None}
        check = self.check.settings()
        return {"candidates": self.candidates, "copy_check": check, "work_images": WORK_FORMAT}


@dataclass
class _Cands:
    """Candidate pairs of one pool shard, one entry per pair: the pool row, the task (its position among
    the task indexes), the row in that task's index, the cosine, the copy similarity (NaN until checked)."""

    row: np.ndarray
    task: np.ndarray
    eval_row: np.ndarray
    cosine: np.ndarray
    copy: np.ndarray

    def take(self, keep: np.ndarray) -> _Cands:
        return _Cands(*(getattr(self, f.name)[keep] for f in fields(self)))


def _candidates(indexes: dict[str, tuple], x: np.ndarray, search: Search) -> _Cands:
    """The `search.k` nearest images of each task at cosine >= the threshold, of every row of `x`."""
    parts = []
    for n, (index, _, _) in enumerate(indexes.values()):
        sims, ids = _search(index, x, min(search.k, index.ntotal))
        r, j = np.nonzero((sims >= search.threshold) & (ids >= 0))
        parts.append((r, np.full(len(r), n), ids[r, j], sims[r, j]))
    row, task, eval_row, cosine = (np.concatenate(c) for c in zip(*parts, strict=True))
    nan = np.full(len(row), np.nan, np.float32)
    return _Cands(row, task, eval_row.astype(np.int64), cosine.astype(np.float32), nan)


class _Block:
    """Pool shards whose candidates wait for the copy check, checked together: each evaluation image's
    windows are then computed once per block instead of once per pool shard (they dominated the check's
    time). Holds at most ~`BLOCK_IMAGES` pool work images (`side` px: 48 KiB each at 128) and ~`BLOCK_PAIRS`
    candidate pairs beyond one shard's own; the evaluation side is `_EvalImages`, held once."""

    def __init__(self, side: int) -> None:
        self.side = side
        self.shards: list[tuple[ShardTask, pa.Table, _Cands, np.ndarray]] = []
        self.images: list[np.ndarray] = []
        self.pairs = 0

    def add(self, task: ShardTask, t: pa.Table, cands: _Cands, found: _Found) -> bool:
        """Queue one pool shard's candidates, with its candidates' work images (the shard's tar is read
        once, for those images only; an unreadable image matches nothing). True when the block is full."""
        if len(cands.row):
            names = occurrences(t.column("key").to_pylist())
            wanted = {names[r] for r in np.unique(cands.row).tolist()}
            images, unreadable = tar_work_images(task.source, wanted, self.side)
            found.unreadable += unreadable
            slot = {name: len(self.images) + i for i, name in enumerate(images)}
            self.images += images.values()
            pool_slot = np.array([slot.get(names[r], -1) for r in cands.row.tolist()], dtype=np.int64)
            cands = cands.take(pool_slot >= 0)
            # keep only the candidates' uid and key (not the shard's features): memory grows with pairs
            rows = np.unique(cands.row)
            t = t.select(["uid", "key"]).take(pa.array(rows))
            cands.row = np.searchsorted(rows, cands.row)
            self.shards.append((task, t, cands, pool_slot[pool_slot >= 0]))
            self.pairs += len(cands.row)
        return len(self.images) >= BLOCK_IMAGES or self.pairs >= BLOCK_PAIRS

    def check(self, evals: _EvalImages, check: CopyCheck, found: _Found) -> _Block:
        """Of each (pool sample, task)'s candidates the one of highest copy similarity, when that is >= the
        check's threshold, added to `found` shard by shard; returns an empty block."""
        if self.pairs:
            slots = np.concatenate([s[3] for s in self.shards])
            cands = [s[2] for s in self.shards]
            evals_at = np.concatenate([evals.offsets[c.task] + c.eval_row for c in cands])
            pairs = np.stack([slots, evals_at], axis=1)
            t0 = time.perf_counter()
            sims = pair_similarities(np.stack(self.images), evals.works, pairs, check)
            found.count_block(slots, evals_at, time.perf_counter() - t0)
            found.checked += self.pairs
            bounds = np.cumsum([len(c.row) for c in cands])[:-1]
            for (task, t, c, _), copy in zip(self.shards, np.split(sims, bounds), strict=True):
                c.copy = copy
                found.add(task, t, _best(c, check.threshold))
        return _Block(self.side)


def _best(cands: _Cands, threshold: float) -> _Cands:
    """Of each (pool row, task)'s checked candidates the one of highest copy similarity, if >= threshold."""
    order = np.lexsort((-cands.copy, cands.task, cands.row))
    row, tsk = cands.row[order], cands.task[order]
    first = np.r_[True, (row[1:] != row[:-1]) | (tsk[1:] != tsk[:-1])]
    best = order[first]
    return cands.take(best[cands.copy[best] >= threshold])


class _EvalImages:
    """Every evaluation image as a work image of `side` px (held once: images x side^2 x 3 bytes),
    row-aligned with the task indexes."""

    def __init__(self, indexes: dict[str, tuple], sources: dict[str, str], side: int):
        offsets: list[int] = []  # first row of each task
        works: list[np.ndarray] = []
        self.unreadable = 0
        for _, shards, keys in indexes.values():
            offsets.append(len(works))
            by_shard: dict[str, list[str]] = {}
            for shard, key in zip(shards, keys, strict=True):
                by_shard.setdefault(shard, []).append(key)
            images = {}
            for shard, shard_keys in by_shard.items():
                names = occurrences(shard_keys)
                got, bad = tar_work_images(sources[shard], set(names), side)
                self.unreadable += bad
                images[shard] = iter([got.get(name) for name in names])  # the shard's rows, in row order
            blank = np.zeros((side, side, 3), np.uint8)  # a flat image matches nothing
            works += [w if (w := next(images[s])) is not None else blank for s in shards]
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.works = np.stack(works) if works else np.zeros((0, side, side, 3), np.uint8)
        self.nbytes = int(self.works.nbytes)


class _Found:
    """The matches of all pool shards, collected as columns."""

    def __init__(self, indexes: dict[str, tuple]) -> None:
        self.indexes = indexes
        self.cols: dict[str, list] = {name: [] for name in MATCH_SCHEMA.names}
        self.checked = 0
        self.unreadable = 0
        # what the copy check's time grows with (`hype plan` scales each): the images whose windows it
        # computed (once per block: the pool's grow with the pool, the evaluation's are at most all of them)
        self.windowed = {
            "blocks": 0,
            "pool_images_windowed": 0,
            "eval_images_windowed": 0,
            "check_seconds": 0.0,
        }

    def count_block(self, pool_slots: np.ndarray, eval_rows: np.ndarray, seconds: float) -> None:
        w = self.windowed
        w["blocks"] += 1
        w["pool_images_windowed"] += len(np.unique(pool_slots))
        w["eval_images_windowed"] += len(np.unique(eval_rows))
        w["check_seconds"] = round(w["check_seconds"] + seconds, 4)

    def add(self, task: ShardTask, t: pa.Table, cands: _Cands) -> None:
        if not len(cands.row):
            return
        indexes = self.indexes
        rows, names = pa.array(cands.row), list(indexes)
        picked = [(names[n], j) for n, j in zip(cands.task.tolist(), cands.eval_row.tolist(), strict=True)]
        self.cols["uid"] += t.column("uid").take(rows).to_pylist()
        self.cols["shard"] += [task.path] * len(cands.row)
        self.cols["key"] += t.column("key").take(rows).to_pylist()
        self.cols["task"] += [name for name, _ in picked]
        self.cols["eval_shard"] += [indexes[name][1][j] for name, j in picked]
        self.cols["eval_key"] += [indexes[name][2][j] for name, j in picked]
        self.cols["similarity"].append(cands.cosine)
        self.cols["copy_similarity"].append(cands.copy)

    def table(self) -> pa.Table:
        cols = {}
        for name in MATCH_SCHEMA.names:
            v = self.cols[name]
            if name in ("similarity", "copy_similarity"):
                v = np.concatenate(v) if v else np.zeros(0, np.float32)
            cols[name] = v
        table = pa.table(cols, MATCH_SCHEMA)
        if table.num_rows:  # strongest matches first within each task
            table = table.sort_by([("task", "ascending"), ("similarity", "descending"), ("uid", "ascending")])
        return table


def normalise(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (float32, contiguous; an all-zero row stays zero)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return np.ascontiguousarray(x / np.where(norms > 0, norms, 1.0), dtype=np.float32)


def _task_indexes(run: RunDir, eval_parts: list[tuple[str, ShardTask]], width: int) -> dict[str, tuple]:
    """task -> (flat inner-product index of its normalised features, eval shard per row, key per row) of
    the tasks with at least one embedded image."""
    feats: dict[str, list[np.ndarray]] = {}
    shards: dict[str, list[str]] = {}
    keys: dict[str, list[str]] = {}
    for name, part in eval_parts:
        t = read_parquet(run.shard_output(EVAL_STAGE, part), columns=["key", "clip_img"])
        if not t.num_rows:  # no usable image in this shard (its skips are counted in its _stats.json)
            continue
        x = embed_format.fixed_list_to_numpy(t.column("clip_img")).reshape(t.num_rows, -1)
        if x.shape[1] != width:
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
        out[name] = (_flat_ip(x), shards[name], keys[name])
    if not out:
        raise DecontamError(
            "--decontaminate: no evaluation image could be embedded (see RUN_DIR/decontam_eval/*_stats.json)"
        )
    return out


def _repeated(shards: list[str], keys: list[str]) -> int:
    """Images of a task whose key another image of the same shard has too (each is checked on its own:
    `occurrences`; the matches name it by the shared key)."""
    return sum(n for n in Counter(zip(shards, keys, strict=True)).values() if n > 1)


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


def _search(index, x: np.ndarray, k: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(n, k) cosines and rows of the `k` nearest indexed images of every row of `x`, nearest first, in
    blocks of `SEARCH_ROWS`."""
    sims = np.empty((len(x), k), np.float32)
    ids = np.empty((len(x), k), np.int64)
    for start in range(0, len(x), SEARCH_ROWS):
        d, i = index.search(x[start : start + SEARCH_ROWS], k)
        sims[start : start + len(d)], ids[start : start + len(d)] = d, i
    return sims, ids


# --- the stage in a `hype score` run -----------------------------------------------------------------


def copy_check_seconds(copy_check: dict, eval_images: int, lin: float, cost: dict | None) -> float:
    """The run's copy-check seconds from the probe's (`copy_check`: the matches marker's, with the images
    windowed and the pairs of its blocks; `eval_images`: the evaluation set's size; `lin`: pool / probe
    samples; `cost`: `_time_copy_check`'s seconds per image and per pair, whose ratio
    splits the probe's time). The pool images windowed and the pairs grow with the pool; the evaluation
    images windowed do not: each block windows those its pairs hit, at most all of them, so of the E
    evaluation images a run's block of p' pairs hits E (1 - (1 - u/E)^(p'/p)) when a probe's block of p
    pairs hit u (hits drawn independently); the run's blocks close as `_Block` closes them."""
    seconds = float(copy_check.get("check_seconds") or 0.0)
    blocks_p = int(copy_check.get("blocks") or 0)
    if not blocks_p:  # an older marker, or nothing checked: the whole check as the pool grows
        return seconds * lin
    pool_p, pairs_p = int(copy_check["pool_images_windowed"]), int(copy_check["candidates_checked"])
    eval_p = int(copy_check["eval_images_windowed"])
    pool_r, pairs_r = pool_p * lin, pairs_p * lin
    blocks_r = max(1, math.ceil(pool_r / BLOCK_IMAGES), math.ceil(pairs_r / BLOCK_PAIRS))
    hit = min(1.0, eval_p / blocks_p / max(1, eval_images))
    eval_r = blocks_r * eval_images * (1 - (1 - hit) ** ((pairs_r / blocks_r) / max(1, pairs_p / blocks_p)))
    ratio = (cost or {}).get("pair_s", 0.0) / (cost or {}).get("image_s", 1.0)
    work_p = pool_p + eval_p + ratio * pairs_p
    return seconds * (pool_r + eval_r + ratio * pairs_r) / max(work_p, 1e-9)


def _run(ctx: Any, settings: Any, inputs: dict) -> dict | None:
    return decontaminate(ctx, inputs["embed"])


COPY_CALIBRATION_IMAGES = 32  # work images a side the copy check is timed on
COPY_CALIBRATION_PAIRS = 16  # pairs per image of the second timing (the first: one)


def _time_copy_check(cfg: Any) -> dict | None:
    """The decontamination copy check (`pair_similarities`, the real code) timed apart on random work
    images: each image paired once, then COPY_CALIBRATION_PAIRS times (interleaved, the median of three):
    seconds per image windowed and per pair. None without the copy check."""
    check = search_of(cfg.decontam).check
    if cfg.decontam.eval_dir is None or check is None:
        return None
    n = COPY_CALIBRATION_IMAGES
    side = check.work_side
    a, b = np.random.default_rng(0).integers(0, 256, (2, n, side, side, 3), dtype=np.uint8)
    times: dict[int, list[float]] = {1: [], COPY_CALIBRATION_PAIRS: []}
    for _ in range(3):
        for k in times:
            i = np.repeat(np.arange(n), k)
            t0 = time.perf_counter()
            pair_similarities(a, b, np.stack([i, (i + np.tile(np.arange(k), n)) % n], axis=1), check)
            times[k].append(time.perf_counter() - t0)
    one, many = (float(np.median(t)) for t in times.values())
    pair_s = max(0.0, (many - one) / (n * (COPY_CALIBRATION_PAIRS - 1)))
    return {"image_s": max(1e-9, (one - n * pair_s) / (2 * n)), "pair_s": pair_s}


def calibrate(cal: Any) -> None:
    cal.probe.copy_check = _time_copy_check(cal.cfg)


def plan(est: Any) -> None:
    """The evaluation images embedded (fixed: the evaluation set does not grow with the pool), then the
    search: loading the evaluation set is fixed, the search linear in samples, the copy check as
    `copy_check_seconds`."""
    est.map(
        "decontam_eval", "decontam eval", "fixed", reads=ShardReads(tar=True), in_bytes=0, fixed_only=True
    )
    probe, marker = est.probe, est.probe.markers.get("decontam") or {}
    seconds, nbytes = est.seconds("decontam"), probe.folder_bytes.get("decontam", 0)
    setup = min(seconds, float(marker.get("eval_setup_seconds") or 0.0))
    cc = marker.get("copy_check") or {}
    check = min(seconds - setup, float(cc.get("check_seconds") or 0.0))
    evals = sum(int(t.get("eval_images", 0)) for t in (marker.get("tasks") or {}).values())
    run_check = copy_check_seconds(cc, evals, est.lin, probe.copy_check) if check else 0.0
    req = _requests(est, marker)
    est.driver(
        "decontam search",
        seconds,
        est.lin,
        "samples",
        nbytes * est.lin,
        req,
        fixed=setup,
        apart=(check, run_check),
        run_stage="decontam",
    )


def _requests(est: Any, marker: dict) -> dict:
    """The search: its marker looked for, each pool shard's CLIP features searched, the matches and their
    marker written; the evaluation folders listed (each task's and its split's), each evaluation part's
    features read; with the copy check, each evaluation tar and each pool shard's tar read once more (an
    upper bound: a shard without candidates is not read)."""
    fit = est.fit(EVAL_STAGE)
    tasks = len(marker.get("tasks") or {}) or fit.shards
    req = add(
        add(MISSING, {"get": est.S * parquet_get(est.embed_bytes), "put": 2}),
        {"get": fit.shards * parquet_get(fit.out_bytes / max(1, fit.shards)), "pool_list": 2 + 2 * tasks},
    )
    if "candidates_checked" in (marker.get("copy_check") or {}):
        req = add(req, {"pool_get": fit.shards * stream_get(0) + est.S * stream_get(est.tar_bytes)})
    return req


def _summary(view: SummaryView) -> dict:
    info = view.outputs.get("decontam")
    if info is None:
        return {}
    # --decontaminate: matches per task (RUN_DIR/decontam/matches.json)
    return {"decontam": {k: v for k, v in info.items() if k not in ("fingerprint", "output")}}


# the evaluation images embedded (per shard), then matched (driver)
STAGE = StageSpec(
    "decontam",
    _run,
    lambda c: c.decontam,
    reads=("embed",),
    driver=True,
    when=lambda c: c.decontam.eval_dir is not None,
    plan=plan,
    summary=_summary,
    markers=(("decontam", "decontam/matches.json"),),
    calibrate=calibrate,
)
