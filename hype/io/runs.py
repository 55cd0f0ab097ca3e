"""THE run contract: how the steps (download, score, select, reshard, train, eval, submit, synth, and
`hype run`'s workflow) write an output that a rerun can trust, skip, or redo.

A step's unit of work is a *stage*: an output (a file or a folder) plus its completion marker.

- Output location. Local outputs and inputs are named by their absolute path, URLs (`s3://...`) as given
  (`absolute`): a fingerprint, a shard id, a plan records them so, and workers find them from any folder.
  A path with `~` is expanded; symlinks are resolved, so `./x`, `x/` and a link to x are one output.
  Records that name another location (a run's config.yaml, subset.json's scores table) hold it so too:
  a record means the same thing read from any folder.
- Atomic writes (`hype.io.files`): every file is written whole or not at all, locally a temporary name
  in its folder, fsynced and renamed; in a bucket a local temporary uploaded under the final name.
- Fingerprint (`fingerprint`): ONE digest algorithm, `RUN_DIGEST` = blake2b-128, of a JSON description
  (keys sorted) of everything the output depends on: the identity of its inputs, the digests of the
  upstream outputs it reads, and the settings that change its bytes. Settings that do not change the
  output (threads, workers, executor, progress) stay out of it, so changing them never redoes work. The
  same object gives the same fingerprint in every process and on every machine. Changing the algorithm
  would redo every finished output everywhere: it is recorded in `RUN_DIGEST` and tested against
  markers written by earlier versions.
- Input identity (`input_identity`): what identifies an input file's content without reading it. A local
  file: absolute path, size and modification time (`{"path", "size", "mtime_ns"}`: kind "size+mtime");
  an object in a bucket: URL, size and the ETag (or version id) the store gives (`{"path", "size",
  "etag"}`: kind "etag"); a missing file `{"path", "missing": true}`, which differs from any file that
  appears later. `identity_kind` names the kind. An output whose content must be proven (a model file,
  a subset, an upstream output) is named by `blake2b128_file` (`hype.io.digests`) instead: the digest of
  its bytes.
- Completion marker (`Marker`): a JSON file written LAST, atomically, after all of the stage's data, with
  `state` ("done"; "running" while a step that cannot be split is under way), `fingerprint`, and the
  stage's stats. An output counts as done only when its marker says done with the fingerprint the rerun
  computes now (`Marker.done`, `is_done`): a rerun with unchanged inputs and settings skips it, a rerun
  with a changed input or setting redoes what depends on the change, and a step killed at any moment is
  redone (no marker, or `running`), never trusted half-written. Where redoing would replace a finished
  output that cannot be split (a synthetic world, a submission, a training recipe, another model's eval
  results, a reshard of another subset), the rerun is refused instead, until --overwrite or another
  --out. A marker with no `state` (scoring's per-shard `_stats.json`) means done: it is only ever
  written last.
- Formats owned by other tools keep their names and fields: img2dataset's `_stats.json`, DataComp's
  `{k:08d}_stats.json` and `meta.json`, webdataset tars. Where hype marks them, it adds its fields
  (`fingerprint`) and never removes theirs.
- The lock (`output_lock`, `lock_at`, `LockError`; `hype.io.lock`): every command holds its output's lock
  for its whole run, so two commands never write one output at once; a second one is refused, holder
  named. A step takes it from here.

Where each step keeps its markers (and what its fingerprint covers):
- `hype score`: RUN_DIR/<stage>/<shard>_stats.json and <output>.json (`hype.scoring.rundir`): per shard and
  stage, the input's identity, upstream digests, settings;
- `hype select`: OUT's subset.json beside subset.npy (the scores table's identity: its parts' sizes and
  versions and its run's summary.json; the uid and metadata files it reads; every option but --workers);
- `hype reshard`: OUT/{k:08d}_stats.json per output tar (DataComp's fields kept: the subset's uids, the
  identity of the input tars it copies from, its place) and OUT/meta.json (the whole job);
- `hype download`: OUT/_hype/summary.json (the metadata files' identity, the settings that change a shard;
  img2dataset's own `_stats.json` per shard are its markers, as it writes them);
- `hype synth`: OUT/world.json (the settings and the generator version);
- `hype train`: OUT/summary.json, done once the final model is published (the recipe); checkpoints keep
  their own commit marker (the state file, written after the weights) for resuming;
- `hype eval`: <results>.model.json (the model's identity; tasks already in the results file are skipped);
- `hype submit`: OUT/<scale>_scale/submission.json (subset, results, scores table, settings);
- `hype run`: OUT/.hype/steps/<step>.json (the step's command line and its inputs' fingerprints),
  written before the step's folder is made: `hype run` replaces a step's output only when it is there.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from os import PathLike
from typing import Any

from hype.io import storage
from hype.io.digests import blake2b128_bytes, sha256_bytes
from hype.io.files import read_json, write_json
from hype.io.lock import FileLock, LockError, ObjectLock, lock_at, output_lock
from hype.io.storage import AnyPath

__all__ = [
    "DONE",
    "RUN_DIGEST",
    "RUNNING",
    "FileLock",
    "LockError",
    "Marker",
    "ObjectLock",
    "absolute",
    "fingerprint",
    "identity_kind",
    "input_identity",
    "is_done",
    "legacy_fingerprint",
    "legacy_identity",
    "lock_at",
    "output_lock",
    "write_marker",
]

RUN_DIGEST = "blake2b-128"  # recorded in markers' fingerprints: changing it would redo every finished output
DONE, RUNNING = "done", "running"


def fingerprint(obj: Any) -> str:
    """`RUN_DIGEST` of a JSON-able description of everything an output depends on (keys sorted; objects
    JSON cannot hold are written as `str()`)."""
    text = json.dumps(obj, sort_keys=True, default=str)
    return blake2b128_bytes(text.encode())


# Markers written before the run contract (hype 0.1.0 until commit b8e72ca), which readers still accept so
# that finished work is not redone; no other pre-contract marker is read:
# - `hype reshard`'s meta.json: `job_sha256`, the `legacy_fingerprint` of its job (keys sorted);
# - `hype run`'s .hype/steps/<step>.json: `fingerprint`, the `legacy_fingerprint` of {argv, inputs} (keys in
#   order; the inputs are the steps' legacy fingerprints);
# - `hype eval`'s <results>.model.json: the model identity itself, with no fingerprint (`legacy_identity`).


def legacy_fingerprint(obj: Any, *, sort_keys: bool) -> str:
    """The fingerprint a hype before the run contract recorded: sha256 of `obj`'s JSON."""
    return sha256_bytes(json.dumps(obj, sort_keys=sort_keys).encode())


def legacy_identity(stored: dict | None) -> dict | None:
    """An identity marker (`{"fingerprint", "model"}`) as read; one written before the run contract (the
    identity itself) as the marker the contract would have written for it."""
    if stored is not None and "fingerprint" not in stored:
        return {"model": stored, "fingerprint": fingerprint(stored)}
    return stored


def absolute(path: str | PathLike | AnyPath) -> str:
    """The absolute-path/URL rule: a URL as given, a local path absolute (`~` expanded, symlinks resolved)."""
    return str(path) if storage.is_url(path) else storage.absolute(path)  # str: also of a bucket's UPath


def input_identity(path: str | PathLike | AnyPath) -> dict:
    """What identifies an input file's content cheaply (see the module docstring): absolute path or URL,
    size, and the modification time (local, kind "size+mtime") or the store's ETag/version (a bucket, kind
    "etag": it changes whenever the object is rewritten)."""
    full = absolute(path)
    if storage.is_url(full):
        try:
            info = storage.info(full)
        except FileNotFoundError:  # read as missing; when it is back, its identity differs
            return {"path": full, "missing": True}
        return {"path": full, "size": info["size"], "etag": info.get("etag")}
    try:
        st = os.stat(full)
    except FileNotFoundError:
        return {"path": full, "missing": True}
    return {"path": full, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def identity_kind(identity: dict) -> str:
    """The kind of an `input_identity`: "size+mtime", "etag" or "missing"."""
    if identity.get("missing"):
        return "missing"
    return "etag" if "etag" in identity else "size+mtime"


@dataclass(frozen=True)
class Marker:
    """The completion marker of one stage's output, a JSON file (see the module docstring)."""

    path: str | PathLike | AnyPath

    def read(self) -> dict | None:
        """The marker's content; None when it is missing or unreadable (a marker cut short is absent)."""
        return read_json(self.path)

    def done(self, expected: str) -> dict | None:
        """The marker's content when it records `expected` as its fingerprint and says done, else None."""
        record = self.read()
        if record is None or record.get("fingerprint") != expected:
            return None
        return record if record.get("state", DONE) == DONE else None

    def write(self, fp: str, state: str = DONE, **stats: Any) -> dict:
        """Write the marker atomically (call it after the stage's last byte of data); returns it."""
        record = {**stats, "state": state, "fingerprint": fp}  # in this order: the step's fields first
        write_json(self.path, record, sort_keys=False, default=str, ensure_ascii=False)
        return record

    def begin(self, fp: str, **fields: Any) -> dict:
        """Mark a step that cannot be split as under way: a rerun redoes it unless it then says done."""
        return self.write(fp, RUNNING, **fields)

    def clear(self) -> None:
        storage.remove(self.path)


def is_done(path: str | PathLike | AnyPath, expected: str) -> dict | None:
    """`Marker(path).done(expected)`: the marker when the output it marks is finished with `expected`."""
    return Marker(path).done(expected)


def write_marker(path: str | PathLike | AnyPath, fp: str, **stats: Any) -> dict:
    """`Marker(path).write(fp, **stats)`: mark an output finished with fingerprint `fp`."""
    return Marker(path).write(fp, **stats)
