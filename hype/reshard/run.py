"""`reshard`: write the samples of a DataComp subset as training shards, the way DataComp's resharder does.

Output layout (what DataComp's `resharder.py` writes, so DataComp/open_clip training reads it as is):
`OUT/{k:08d}.tar` holding, for every pool sample whose `json["uid"]` is in the subset, one copy per
occurrence of the uid in the subset, keyed `<uid>-<j>` (the canonical uid, `hype.data.uids.normalize_uid`;
j = 0, 1, ... numbered across the whole pool, so a uid found twice gives distinct keys), with the sample's
members copied byte for byte in suffix order (`.jpg`, `.json`, `.txt`; the `.json` is not modified, as in
DataComp without `--inject-blur-metadata`), at most `--shard-size` samples per tar; `OUT/{k:08d}_stats.json`
(`{"successes": n, "count": n}`, plus the run contract's `fingerprint` and `state`, `hype.io.runs`) written
after its tar (the completion marker); `OUT/meta.json` last, with the fingerprint of the whole job.

Unlike DataComp's resharder, the output is deterministic (input shards in order, samples in tar order,
copies together), every output shard is full but the last, and a run can resume:

1. index: each input tar is indexed (headers and `.json` members only, see `index.py`); results are kept
   in `OUT/.reshard/index/` keyed on the tar's path, size and mtime, so a rerun skips indexed tars;
2. write: output shard k holds copies [k*N, (k+1)*N) of the concatenated selection; a shard whose
   `_stats.json` records its fingerprint (the subset's uids, the identity of the input tars it copies
   from, its place in the selection) is skipped, so a changed input tar redoes the shards it feeds; each
   new tar is read back and its keys and uids compared with the plan, and checked against webdataset's
   rule (no key twice in a row), before its `_stats.json` is written;
3. verify: the per-shard counts add up to the planned total, and `meta.json` records the subset, the
   counts, the uids of the subset missing from the pool and the skipped samples, plus the two keys
   DataComp's `train.py` reads (`output_shard_count`, `output_shard_format`).

The subset file may be an `.npy` or DataComp's raw memmap layout (`hype.data.uids.load_uid_file`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from os import PathLike
from pathlib import Path

import numpy as np

from hype import __version__
from hype.data.errors import SelectError
from hype.data.samples import SkipStats, iter_tar_samples
from hype.data.shards import ShardError, expand_shards
from hype.data.uids import UidMultiset, load_uid_file, normalize_uid
from hype.executor import Executor, MapResult, PoolExecutor, Progress, Resources, Stage
from hype.io import (
    blake2b128_bytes,
    is_temp_name,
    load_npy,
    open_input,
    read_json,
    save_npy,
    sha1_bytes,
    sha256_file,
    storage,
    write_json,
)
from hype.io.runs import (
    absolute,
    fingerprint,
    input_identity,
    is_done,
    legacy_fingerprint,
    write_marker,
)
from hype.io.storage import AnyPath
from hype.io.tar import write_tar
from hype.reshard.index import INDEX_FORMAT, index_tar

STATE = ".reshard"
META = "meta.json"
# Output names, as DataComp's resharder's --output-shard-format / --output-shard-stats-format defaults.
SHARD_FORMAT = "{:08d}.tar"
STATS_FORMAT = "{:08d}_stats.json"


def _tar_id(path: str) -> str:
    return sha1_bytes(absolute(path).encode())[:20]


def _load_subset(state_dir: str) -> UidMultiset:
    """The subset's unique uids, memory-mapped from OUT/.reshard (workers share the page cache)."""

    def load(name: str) -> np.ndarray:
        return load_npy(storage.join(state_dir, f"subset_{name}.npy"), mmap=True)

    return UidMultiset.from_unique(load("hi"), load("lo"), load("counts"))


def _saved_index(tar: str, index_path: str) -> dict | None:
    """The index saved by an earlier run, if it is of this very tar (path, size, mtime or ETag) and in this
    hype's format."""
    saved = read_json(index_path)  # None when missing or unreadable: index again
    if not saved:
        return None
    st = storage.info(tar)
    same = [saved.get(k) for k in ("format", "tar", "size", "mtime_ns")]
    if same == [INDEX_FORMAT, tar, st["size"], st["version"]]:
        return saved
    return None


def _index_job(tar: str, index_path: str, subset: UidMultiset) -> dict:
    """Index one input tar and save the index; returns it as a dict."""
    index = index_tar(tar, subset).to_json()
    write_json(index_path, index, ensure_ascii=False)
    return index


class _ReshardStage(Stage):
    """A pass of `reshard` on any executor: picklable settings (absolute paths, so that a worker on
    another node finds them), CPU work only."""

    def resources(self) -> Resources:
        return Resources(gpus=0.0)  # no GPU even where the executor's setting would give one


class _IndexStage(_ReshardStage):
    """Pass 1: one input tar per task `(tar, index file)`; a saved index of the same tar is reused."""

    name = "index"

    def __init__(self, state_dir: str):
        self.state_dir = state_dir

    def done(self, task: tuple[str, str]) -> dict | None:
        return _saved_index(*task)

    def label(self, task: tuple[str, str]) -> str:
        return task[0]

    def setup(self) -> None:
        self.subset = _load_subset(self.state_dir)

    def run(self, task: tuple[str, str]) -> dict:
        return _index_job(*task, self.subset)


class _WriteStage(_ReshardStage):
    """Pass 2: one output shard per task `(k, pieces, fingerprint)`; done when its `_stats.json` records
    the fingerprint."""

    name = "write"

    def __init__(self, out: str):
        self.out = out

    def done(self, task: tuple[int, list, str]) -> dict | None:
        return is_done(storage.join(self.out, STATS_FORMAT.format(task[0])), task[2])

    def label(self, task: tuple[int, list, str]) -> str:
        return str(storage.join(self.out, SHARD_FORMAT.format(task[0])))

    def run(self, task: tuple[int, list, str]) -> dict:
        return _write_job(self.out, *task)


def _copies(index: dict, first_j: dict[int, int]) -> Iterator[tuple[str, int, list]]:
    """(uid, j, members) for every copy the shard contributes, in output order; `first_j` maps a matched
    entry to the number of its first copy when that is not 0 (`_first_copy_numbers`)."""
    for e, (uid, count, members) in enumerate(index["matched"]):
        j0 = first_j.get(e, 0)
        for j in range(j0, j0 + count):
            yield uid, j, members


def _first_copy_numbers(idx: np.ndarray, counts: np.ndarray, numbered: np.ndarray) -> dict[int, int]:
    """{matched entry: number j of its first copy} for the entries of one input tar whose first copy is
    not j = 0, updating `numbered` (copies of each subset uid numbered so far, in pool order). A uid found
    twice (inside one tar or in two) gets keys `<uid>-0..` then the next free numbers: webdataset refuses a
    tar in which a key repeats ("duplicate file name in tar file")."""
    if len(np.unique(idx)) == len(idx):
        first = numbered[idx]  # a copy (fancy indexing)
        numbered[idx] += counts[idx]
    else:  # a uid repeated inside this tar (rare): entry by entry
        first = np.empty(len(idx), dtype=np.int64)
        for e, u in enumerate(idx):
            first[e] = numbered[u]
            numbered[u] += counts[u]
    return {int(e): int(first[e]) for e in np.flatnonzero(first)}


def _write_job(out: str, k: int, pieces: list[tuple[str, int, int, dict[int, int]]], fp: str) -> dict:
    """Write output shard k from `pieces` = [(index file, first copy, end copy, first copy numbers)], read
    it back, then write its `_stats.json` with DataComp's fields and the shard's fingerprint `fp`.
    Returns {"count"}."""
    tar_path = storage.join(out, SHARD_FORMAT.format(k))
    expected: list[tuple[str, str]] = []  # (key, uid) in order

    def members() -> Iterator[tuple[str, bytes]]:
        for index_file, start, end, first_j in pieces:
            index = read_json(index_file)
            if index is None:
                raise SelectError(f"{index_file}: the index of pass 1 is unreadable; rerun hype reshard")
            with open_input(index["tar"], stream=True) as f:  # forward seeks: served from read-ahead
                for pos, (uid, j, mems) in enumerate(_copies(index, first_j)):
                    if pos < start:
                        continue
                    if pos >= end:
                        break
                    key = f"{uid}-{j}"
                    expected.append((key, uid))
                    for ext, off, size in mems:
                        f.seek(off)
                        data = f.read(size)
                        if len(data) != size:
                            raise SelectError(
                                f"{index['tar']}: member {key}.{ext} is truncated; the tar changed after "
                                "indexing: rerun hype reshard"
                            )
                        yield f"{key}.{ext}", data

    write_tar(tar_path, members())
    # Read back: the tar must hold exactly the planned samples, in order, with their uids.
    stats = SkipStats()
    got = []
    for sample in iter_tar_samples(str(tar_path), stats):
        meta = sample.meta() or {}
        got.append((sample.key, normalize_uid(meta.get("uid"))))
    if got != expected or stats.counts:
        raise SelectError(
            f"{tar_path}: read back {len(got)} samples, expected {len(expected)} (or keys/uids differ); "
            "the output disk may be full or failing; delete the file and rerun"
        )
    # webdataset's rule, stricter than the reader's: a key may not repeat in consecutive members (its
    # group_by_keys raises "duplicate file name in tar file"); the reader splits them into two samples.
    clash = next((a for (a, _), (b, _) in zip(got, got[1:], strict=False) if a == b), None)
    if clash is not None:
        raise SelectError(f"{tar_path}: key {clash} written twice in a row, which webdataset refuses")
    write_marker(storage.join(out, STATS_FORMAT.format(k)), fp, successes=len(expected), count=len(expected))
    return {"count": len(expected)}


def reshard(
    pool: str | PathLike,
    subset: str | PathLike,
    out: str | PathLike,
    *,
    shard_size: int = 10000,
    workers: int = 4,
    overwrite: bool = False,
    progress: bool = True,
    executor: Executor | None = None,
) -> dict:
    """Reshard `pool` (folder / pattern / tar, see `hype.data.shards`) to the samples of `subset`.

    Both passes run on `executor` when given (e.g. `pipelines.ray_executor`, built by the caller, who
    closes it), else on a pool of `workers` local processes; the output is the same bytes either way."""
    start = time.perf_counter()
    if shard_size < 1:
        raise SelectError(f"--shard-size must be >= 1, got {shard_size}")
    if workers < 1:
        raise SelectError(f"--workers must be >= 1, got {workers}")
    try:
        shards = expand_shards(pool)
    except ShardError as e:
        raise SelectError(f"--pool: {e}") from None
    subset_path = storage.location(subset)
    arr = load_uid_file(subset_path, "--subset")  # .npy or DataComp's raw memmap layout
    out = storage.location(out)
    if not storage.is_url(out):  # absolute: a worker may run in another folder, or on another node
        out = Path(absolute(out))
    subset_sha = sha256_file(subset_path)  # what meta.json shows a user (sha256sum)
    inputs = [absolute(p) for p in shards.paths]
    job = {"subset_sha256": subset_sha, "inputs": inputs, "shard_size": shard_size}
    identities = [input_identity(t) for t in inputs]
    job_fp = fingerprint({**job, "identities": identities})  # a changed input tar redoes the job
    meta_path = out / META
    finished = read_json(meta_path)
    if finished is not None and _finished_job(finished, job, job_fp) and not overwrite:
        if "output_shard_count" not in finished:  # finished by a hype that did not write DataComp's fields
            finished.update(_datacomp_fields(finished["output_shards"]))
            write_json(meta_path, finished, ensure_ascii=False)
        finished["resumed"] = "already complete"  # the same job finished before: nothing to do
        return finished
    _prepare_out(out, job, overwrite, finished)

    state = out / STATE
    storage.makedirs(state / "index")
    ms = UidMultiset(arr)
    # The subset as the shards see it (its uids and their repeats), whatever file layout held it.
    uids_fp = fingerprint([blake2b128_bytes(a.tobytes()) for a in (ms.hi, ms.lo, ms.counts)])
    save_npy(state / "subset_hi.npy", ms.hi)
    save_npy(state / "subset_lo.npy", ms.lo)
    save_npy(state / "subset_counts.npy", ms.counts)
    index_files = [str(state / "index" / f"{_tar_id(t)}.json") for t in inputs]

    # -- pass 1: index every input tar
    found = np.zeros(len(ms), dtype=bool)
    duplicates = 0
    skipped = SkipStats()
    copies: list[int] = []
    first_js: list[dict[int, int]] = []
    numbered = np.zeros(len(ms), dtype=np.int64)
    samples_seen = matched = 0
    index_tasks = list(zip(inputs, index_files, strict=True))
    indexes = _run(_IndexStage(str(state)), index_tasks, executor or _local(workers), progress)
    for index in indexes.results:
        idx = np.asarray(index["found"], dtype=np.int64)
        duplicates += int(found[idx].sum()) + (len(idx) - len(np.unique(idx)))
        found[idx] = True
        first_js.append(_first_copy_numbers(idx, ms.counts, numbered))
        skipped.merge(index["skipped"])
        copies.append(sum(m[1] for m in index["matched"]))
        samples_seen += index["samples"]
        matched += len(index["matched"])

    # -- pass 2: plan and write output shards
    total = int(sum(copies))
    if total == 0:
        raise SelectError(
            f"none of the {len(ms)} uids of {subset_path} is in the {len(inputs)} pool shard(s) of {pool}; "
            "check that the subset was selected from this pool"
        )
    bounds = np.concatenate([[0], np.cumsum(copies)])
    n_out = -(-total // shard_size)
    plans = []
    for k in range(n_out):
        lo_pos, hi_pos = k * shard_size, min((k + 1) * shard_size, total)
        first = int(np.searchsorted(bounds, lo_pos, "right")) - 1
        pieces, feeds = [], []  # feeds: what the shard's bytes depend on (its fingerprint)
        i = first
        while i < len(inputs) and bounds[i] < hi_pos:
            s, e = max(lo_pos, bounds[i]) - bounds[i], min(hi_pos, bounds[i + 1]) - bounds[i]
            if e > s:
                pieces.append((index_files[i], int(s), int(e), first_js[i]))
                feeds.append([identities[i], int(s), int(e), first_js[i]])
            i += 1
        plans.append((k, pieces, fingerprint({"subset": uids_fp, "k": k, "copies": feeds})))
    writes = _run(_WriteStage(str(out)), plans, executor or _local(workers), progress)

    # -- verify the whole output against the plan
    written = 0
    for k in range(n_out):
        written += int((read_json(out / STATS_FORMAT.format(k)) or {}).get("successes", 0))
    tars = [n[: -len(".tar")] for n in storage.list_sizes(out) if n.endswith(".tar")]
    stray = sorted(f"{n}.tar" for n in tars if not n.isdigit() or int(n) >= n_out)
    if written != total or stray:
        raise SelectError(
            f"{out}: the output shards hold {written} samples, expected {total}"
            + (f"; stray shards {', '.join(stray[:3])}" if stray else "")
            + "; rerun with --overwrite"
        )
    unique_found = int(found.sum())
    meta = {
        "subset": str(subset_path),
        "subset_sha256": subset_sha,
        "subset_rows": int(len(arr)),
        "subset_unique": len(ms),
        "pool": str(pool),
        "input_shards": len(inputs),
        "empty_input_shards": list(shards.empty),
        "input_samples": samples_seen,
        "matched_samples": matched,
        "output_samples": total,
        "output_shards": n_out,
        **_datacomp_fields(n_out),
        "shard_size": shard_size,
        "missing_uids": len(ms) - unique_found,
        "missing_rows": int(len(arr) - ms.counts[found].sum()),
        "duplicate_pool_uids": duplicates,
        "skipped": skipped.to_dict(),
        "executor": "local" if executor is None else executor.name,
        "shards_written": writes.ran,
        "shards_resumed": writes.reused,
        "verified": True,
        "seconds": round(time.perf_counter() - start, 3),
        "hype_version": __version__,
        "job": job,  # a rerun of the same job whose input tars changed resumes in this folder
    }
    meta = write_marker(meta_path, job_fp, **meta)  # last: the whole job is done
    storage.remove_tree(state)
    return meta


def _finished_job(meta: dict, job: dict, job_fp: str) -> bool:
    """Whether meta.json marks this job finished: its fingerprint (`hype.io.runs`), or, written by a hype
    before the run contract, the sha256 of the same job (its inputs' identities were not recorded then)."""
    if "fingerprint" in meta:
        return meta["fingerprint"] == job_fp
    return meta.get("job_sha256") == legacy_fingerprint(job, sort_keys=True)


def _datacomp_fields(n_out: int) -> dict:
    """The meta.json keys DataComp's train.py reads when this folder is under its --data_dir: it trains on
    `{first..last}.tar` built from them (and raises KeyError without them). Values as its resharder writes."""
    return {"output_shard_count": n_out, "output_shard_format": SHARD_FORMAT}


def _prepare_out(out: AnyPath, job: dict, overwrite: bool, finished: dict | None) -> None:
    """Refuse to mix two different jobs in one folder; remember this job so that a rerun resumes it (also
    one that finished, `finished` its meta.json, and whose input tars changed since)."""
    job_file = out / STATE / "job.json"
    if storage.list_names(out):
        if overwrite or job not in (read_json(job_file), (finished or {}).get("job")):
            if not overwrite:
                raise SelectError(
                    f"--out {out} is not empty and holds no unfinished reshard of this subset and pool (with "
                    "this --shard-size); pass --overwrite to replace its shards, or choose another --out"
                )
            _clear(out)
    storage.remove(out / META)  # the folder is about to change: it is complete again when meta.json is back
    storage.makedirs(out / STATE)
    write_json(job_file, job, ensure_ascii=False)


def _clear(out: AnyPath) -> None:
    # --overwrite removes only what a reshard writes, never unrelated files.
    for name in storage.list_names(out):
        if name == STATE:
            storage.remove_tree(out / name)
        elif name == META or (name.endswith((".tar", "_stats.json")) and name[:8].isdigit()):
            storage.remove(out / name)
        elif is_temp_name(name):
            storage.remove(out / name)


def _local(workers: int) -> PoolExecutor:
    """`workers` processes (1: this process); the first failure stops a pass."""
    return PoolExecutor(workers, retries=0, fail_fast=True)


def _run(stage: Stage, tasks: list, executor: Executor, progress: bool) -> MapResult:
    """Run a pass on `executor`; a task that failed (after the executor's retries) is raised."""
    bar = Progress(stage.name, enabled=progress, unit=" shards", lazy=True)  # after the fork
    result = executor.map(stage, tasks, progress=bar)
    result.raise_first_failure()
    return result
