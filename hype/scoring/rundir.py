"""THE run-directory layout of `hype score`, shard ids, atomic writes and completion markers.

    RUN_DIR/
      config.yaml                       resolved config of the latest run, local locations absolute:
                                        `hype score --config RUN_DIR/config.yaml` rescores RUN_DIR (the
                                        folder it is in, also for a copy) from any folder
      plan.json                         the input shards: index, path as given, shard id, source (absolute
                                        path or URL); the --pool(s) they came from; `frozen` once grown
      card.json                         written when complete (hype.scoring.card): digests of the models,
                                        reference sets, centroids, targets; the record of what a grow keeps
      summary.json                      status (running | complete | failed), counts, skips, timings;
                                        scores/ is THE table only while it says complete
      embed/<id>.parquet                per-shard embeddings and pair scores (see hype.scoring.embed_format)
      embed/<id>_stats.json             completion marker + metrics of that shard
      dedup/duplicates.parquet (+ .json)        rows whose uid already appeared in an earlier shard
      reference/top_n.safetensors (+ .json)     the N pairs with the highest cos θ (selection step 1)
      reference/<id>.parquet, <id>_stats.json   mean L_e of each image/text against them (step 2)
      reference.safetensors (+ reference.json)  S_i and S_t (tangent vectors), selected or copied
      specificity/<id>.parquet, <id>_stats.json ε_i, ε_t
      classes/<id>.parquet, <id>_stats.json     CLIP features of --class-images
      captions/<id>.parquet, <id>_stats.json    DataComp's caption filter (c_IN, k-means training rows)
      clusters/centroids.npy, targets.npy (+ model.json)   k-means centroids and c_IN targets
      clusters/<id>.parquet, <id>_stats.json    nearest centroid, caption filter, c_IN
      metadata/index.npy (+ index.json)         uid -> (metadata file, row, cos θ) with --metadata
      decontam_eval/<id>.parquet, <id>_stats.json   CLIP features of the --decontaminate evaluation images
      decontam/matches.parquet (+ matches.json)     pool samples near an evaluation image (decontam.py)
      scores/part-<index:08d>.parquet           THE scores table (hype.table.schema)
      neardup_pixels/<id>.parquet, <id>_stats.json  --neardup with the pixel partition, per shard: each
                                                  scored row's work image and pixel descriptor (its tar read)
      neardup_split/<id>.parquet, <id>_stats.json   --neardup, per shard: cluster, HYPE score, feature,
                                                  work image and pixel descriptor (copy check)
      neardup/group-<g>.parquet (+ .edges.parquet, _stats.json)  per group of clusters: members, forest
      neardup/groups.parquet, edges.parquet (+ groups.json)  near-duplicate groups (stage_neardup)
      merge/<id>_stats.json                     completion markers of the score parts
      card.json                                 the score card: digests of what the scores depend on and
                                                a checksummed sample of them (hype verify; scoring/card.py)

A shard id is `<tar stem>-<8 hex of blake2b(absolute tar path)>`: readable, unique per input path, and
stable across reruns, so resume state is keyed on the input tar path (DESIGN §4.1).

RUN_DIR may be a local folder or a URL (`s3://bucket/runs/x`, `hype.io.storage`). Every file is written whole
or not at all (`hype.io`: locally a temporary name in its folder, fsynced and renamed; in a bucket a local
temporary uploaded under the final name once complete), and a stage's `_stats.json` (or `.json`) marker is
written after its data: the run contract of every hype step (`hype.io.runs`). A marker records a fingerprint
of everything the output depends on (input file identity, upstream output digests, the settings that change
results); an output counts as done only when its marker's fingerprint matches, so a rerun skips finished work
and redoes exactly what changed. Resume reads one listing per stage folder (`ShardStage.done_all`), then only
the markers that exist: no request per missing file.

Nothing lost, nothing let in:
- An embed output holds the rows its input justifies: the input's identity is taken before the read and
  checked after it (changed meanwhile, or read as missing while it is there: the shard fails this attempt
  and is read again), and a shard whose read ended early (missing, unreadable: also what a failing store
  looks like) is read again by every rerun.
- An output is reused only at the size its marker records; a scores part (what `hype select` reads) also
  only at the digest it records, so a rerun reads the parts back (about one selection's reading) and
  rewrites one damaged in place. Parquet pages carry CRC32s, which `hype select` verifies as it reads.
- summary.json says `running` before a run changes anything and `failed` when it stops short; `hype
  select` reads scores/ only when it says `complete`. Inputs are opened first (the pool, the models, a
  grow's frozen parts, --centroids): one refused there leaves the run directory as it was, so a complete
  run stays complete.

Pools that grow (`hype.scoring.grow`): a complete run given a --pool with shards that are not in plan.json
keeps its old shards (old order and indices, so old part names) and appends the new ones. Its reference
sets, centroids and targets (as card.json records them) are kept, not selected or trained again, so every
old shard's markers still match and only new shards are computed; a merge part is keyed on its own
shard's dropped rows (which only earlier shards decide), not on the pool's duplicate list. The result
equals a from-scratch run over all shards given the same reference and centroids. A grow whose models,
--reference, --centroids or class set differ from the frozen ones, or whose pool drops some old shards,
is refused before anything changes; plan.json's `frozen` keeps every later run of the folder frozen.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

import pyarrow as pa

import hype.io as hype_io
from hype.io import blake2b32_bytes, blake2b128_bytes, blake2b128_file, is_temp_name, storage
from hype.io import read_json as read_json  # re-exported: the stages read markers with it
from hype.io.runs import (  # the run contract (hype.io.runs): this module is its layout for `hype score`
    FileLock,
    ObjectLock,
    absolute,
    input_identity,
    is_done,
    lock_at,
)
from hype.io.runs import (
    fingerprint as fingerprint,  # re-exported for the stages
)
from hype.io.storage import AnyPath
from hype.table.schema import scores_dir

SHARD_STAGES = ("embed", "reference", "specificity", "classes", "captions", "clusters", "merge")
SHARD_STAGES += ("neardup_pixels", "neardup_split", "neardup")  # near-duplicates (hype.scoring.stage_neardup)
STAGE_NAME = re.compile(r"[a-z0-9_]+")  # a stage's folder: a plain name, never a path
file_identity = input_identity  # an input's identity in the stages' fingerprints (hype.io.runs)
# Parquet writer settings are fixed here so that identical tables give identical bytes. zstd with no
# dictionary except for the one low-cardinality column, and float columns byte-stream-split: a uid (32 hex
# chars) takes ~17.5 bytes instead of ~33 with snappy, a float32 score ~3.3 instead of ~6 (a dictionary
# tried on floats and then abandoned costs bytes), embeddings 18% less: a selection reads ~46% fewer
# bytes (bench/parquet_writer.py; bench/RESULTS.md "Run-directory Parquet").
# Every page carries a CRC32 (a few bytes per page), so readers that verify it (`hype select`) notice a
# file damaged in place instead of ranking its garbage.
_PARQUET_OPTS = {
    "compression": "zstd",
    "row_group_size": 1 << 20,
    "write_statistics": True,
    "write_page_checksum": True,
}
_DICTIONARY_COLUMNS = ("shard",)  # the input tar's path: one value per shard


def parquet_options(schema: pa.Schema) -> dict[str, Any]:
    """pyarrow.parquet.write_table options for a run-directory table of `schema`."""
    floats: list[str] = []
    for f in schema:
        t = f.type
        if pa.types.is_floating(t):
            floats.append(f.name)
        elif (pa.types.is_fixed_size_list(t) or pa.types.is_list(t)) and pa.types.is_floating(t.value_type):
            floats.append(f"{f.name}.list.element")  # the leaf column's path in the Parquet schema
    dictionary = [n for n in _DICTIONARY_COLUMNS if n in schema.names]
    return {**_PARQUET_OPTS, "use_dictionary": dictionary, "use_byte_stream_split": floats}


class RunDirError(RuntimeError):
    """A run directory that cannot be used (unwritable; a locked one raises `hype.io.lock.LockError`)."""


@dataclass(frozen=True)
class ShardTask:
    """One input shard: the unit of work, retry, resume and metrics (DESIGN §4.1)."""

    index: int  # position in the pool's shard list (shard order)
    path: str  # the tar as given (stored in the scores table's `shard` column)
    shard_id: str
    source: str = ""  # absolute path or URL: what workers read, whatever their working directory

    def __post_init__(self) -> None:
        if not self.source:
            object.__setattr__(self, "source", absolute(self.path))


def shard_id(path: str | PathLike) -> str:
    """`<stem>-<8 hex>` from the absolute path (or the URL) of an input tar."""
    full = absolute(path)
    name = full.rstrip("/").rsplit("/", 1)[-1]
    digest = blake2b32_bytes(full.encode())
    stem = name[: -len(".tar")] if name.endswith(".tar") else name.rsplit(".", 1)[0]
    return f"{stem}-{digest}"


def make_tasks(paths: Iterable[str]) -> list[ShardTask]:
    return [ShardTask(i, p, shard_id(p), absolute(p)) for i, p in enumerate(paths)]


def plan_tasks(plan: Mapping) -> list[ShardTask]:
    """The shards a run's `plan.json` (read) lists, in shard order: the run's shards, whatever other outputs
    its folders still hold from shards it no longer has."""
    return [
        ShardTask(int(s["index"]), s["path"], s["id"], s.get("source") or "") for s in plan.get("shards", [])
    ]


# --- atomic writes (hype.io), in the run directory's JSON and Parquet style -----------------------


def atomic_write_bytes(path: str | PathLike, data: bytes) -> AnyPath:
    """Write `data` to a temporary file next to `path`, fsync it and rename it over `path`."""
    return hype_io.write_bytes(path, data)


def atomic_write_json(path: str | PathLike, obj: Any) -> Path:
    return hype_io.write_json(path, obj, default=str)


def parquet_bytes(table: pa.Table) -> bytes:
    """`table` as Parquet with the run directory's fixed writer settings (every stage output, the scores
    table's parts included)."""
    return hype_io.parquet_bytes(table, **parquet_options(table.schema))


def write_parquet(path: str | PathLike, table: pa.Table) -> dict:
    """Write a table atomically; return `{"file", "rows", "bytes", "digest"}` for the stage's marker."""
    data = parquet_bytes(table)
    written = atomic_write_bytes(path, data)
    return {
        "file": written.name,
        "rows": table.num_rows,
        "bytes": len(data),
        "digest": blake2b128_bytes(data),
    }


# --- the layout -----------------------------------------------------------------------------------


class RunDir:
    """Paths of one run directory (see the module docstring)."""

    def __init__(self, root: str | PathLike, stages: tuple[str, ...] = ()):
        self._given = root if isinstance(root, (str, Path)) else str(root)
        self.remote = storage.is_url(self._given)
        # The per-shard output folders: the built-in stages' and those of the stages a run declares (a
        # registered stage's folder is created, cleaned and carded like theirs), each a plain name.
        for name in stages:
            if not STAGE_NAME.fullmatch(name):
                raise RunDirError(f"stage folder {name!r}: a stage's name is lowercase letters, digits, _")
        self.stage_folders = (*SHARD_STAGES, *(s for s in dict.fromkeys(stages) if s not in SHARD_STAGES))

    def __reduce__(self):  # small and picklable, no credentials: travels to Ray actors
        return (RunDir, (str(self._given), self.stage_folders[len(SHARD_STAGES) :]))

    @property
    def root(self) -> AnyPath:
        # Built on use, not when unpickled: a worker configures its storage options after it has
        # received the stage (`hype.executor.start_stage`).
        return storage.location(self._given)

    # files
    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def reference(self) -> Path:
        return self.root / "reference.safetensors"

    @property
    def reference_marker(self) -> Path:
        return self.root / "reference.json"

    @property
    def top_n(self) -> Path:
        return self.root / "reference" / "top_n.safetensors"

    @property
    def duplicates(self) -> Path:
        return self.root / "dedup" / "duplicates.parquet"

    @property
    def centroids(self) -> Path:
        return self.root / "clusters" / "centroids.npy"

    @property
    def targets(self) -> Path:
        return self.root / "clusters" / "targets.npy"

    @property
    def clusters_marker(self) -> Path:
        return self.root / "clusters" / "model.json"

    @property
    def metadata_index(self) -> Path:
        return self.root / "metadata" / "index.npy"

    @property
    def scores(self) -> Path:
        return scores_dir(self.root)

    def marker_of(self, artifact: AnyPath) -> AnyPath:
        """`x.parquet` / `x.safetensors` / `x.npy` -> `x.json`."""
        return artifact.with_suffix(".json")

    # per-shard outputs
    def shard_output(self, stage: str, task: ShardTask) -> Path:
        if stage == "merge":
            return self.scores / f"part-{task.index:08d}.parquet"
        return self.root / stage / f"{task.shard_id}.parquet"

    def shard_stats(self, stage: str, task: ShardTask) -> Path:
        return self.root / stage / f"{task.shard_id}_stats.json"

    def debug_dir(self) -> Path:
        return self.root / "debug"

    # lifecycle
    def create(self) -> None:
        root = self.root
        try:
            if self.remote:  # no folders in a bucket: check now that it exists and takes writes
                storage.check_reachable(root)
                return
            root.mkdir(parents=True, exist_ok=True)
            for stage in self.stage_folders:
                (root / stage).mkdir(exist_ok=True)
            for sub in ("scores", "dedup", "metadata"):
                (root / sub).mkdir(exist_ok=True)
        except storage.StorageError:
            raise
        except OSError as e:
            raise RunDirError(f"{self._given}: cannot create the run directory ({e})") from e

    def listing(self, folder: AnyPath) -> dict[str, int]:
        """{str(path): size} of the files in one folder of the run (one listing)."""
        return {str(folder / name): size for name, size in storage.list_sizes(folder).items()}

    def remove_stale_temporaries(self) -> int:
        """Delete temporary files left by a killed run (call only while holding the lock). A bucket has
        none: its temporaries are local files, and an upload that did not complete leaves no object."""
        if self.remote:
            return 0
        n = 0
        folders = (*self.stage_folders, "scores", "dedup", "metadata")
        for folder in (self.root, *(self.root / d for d in folders)):
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            for entry in entries:
                if is_temp_name(entry.name):
                    Path(entry.path).unlink(missing_ok=True)
                    n += 1
        return n

    def lock(self) -> FileLock | ObjectLock:
        """The run's lock (`hype.io.lock`, the one every command takes on its output), kept inside the
        run directory: two `hype score` drivers never write one run directory at once."""
        return lock_at(self.root / ".lock", str(self._given), "score", what="run directory")


def completed(
    marker: AnyPath,
    expected_fingerprint: str,
    output: AnyPath | None = None,
    sizes: Mapping | None = None,
    *,
    verify: bool = False,
) -> dict | None:
    """The marker's content when it records `expected_fingerprint` and its output file is intact: of the
    size the marker records, and with `verify` of the digest it records (the file is read).
    `sizes`: listings of the folders holding both ({str(path): size}), which save a request per missing
    marker and per output size."""
    if sizes is not None and str(marker) not in sizes:
        return None
    stats = is_done(marker, expected_fingerprint)
    if stats is None:
        return None
    if output is not None:
        want = (stats.get("output") or {}).get("bytes")
        try:
            have = sizes.get(str(output)) if sizes is not None else storage.size(output)
        except OSError:
            return None
        if want is None or have != want:
            return None
        if verify and blake2b128_file(output) != stats["output"].get("digest"):
            return None  # damaged in place (same size): redone
    return stats
