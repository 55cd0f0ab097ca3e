"""`eval_results.jsonl`: DataComp's results file, one line per finished task. DESIGN §3 "Results".

Each line is `{"key": <task key>, "dataset": <display name>, "metrics": {..., "main_metric": ...}}`.
Lines are appended one at a time and fsynced, so a crash loses at most the task in progress; a
half-written last line (no newline, not JSON) is cut off before the next append. Results of tasks this
project does not know (e.g. from DataComp's own evaluate.py) are kept and ignored. On object storage,
which cannot append, each finished task rewrites the whole (small) file in one upload, with the same
guarantee: the object holds every finished task or every one but the last.

Next to it, `<file>.model.json` records which model produced the results (`{"model": identity}` with its
fingerprint, the run contract's `hype.io.runs`), so that a rerun with another model cannot silently mix two
models' numbers in one file; a rerun with the same model skips the tasks the file holds.
"""

from __future__ import annotations

import json
import math
from os import PathLike
from typing import Any

from hype.io import AnyPath, read_bytes, storage, sync, write_bytes
from hype.io.runs import Marker, fingerprint, legacy_identity


class ResultsFileError(ValueError):
    """A results file that cannot be extended safely; the message names the file and the fix."""


def read_results(path: str | PathLike, *, repair: bool = False) -> dict[str, dict]:
    """Finished tasks in `path` as key -> line (a later line for the same key wins).

    A last line without a newline that is not valid JSON is the trace of an interrupted write: it is
    ignored, and with `repair=True` cut from the file. Any other invalid line is an error.
    """
    path = storage.location(path)
    if not storage.exists(path):
        return {}
    data = read_bytes(path)
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    results: dict[str, dict] = {}
    for number, raw in enumerate(lines, 1):
        if raw.strip():
            _add(results, _parse(raw, path, number), path, number)
    if tail.strip():
        try:
            _add(results, _parse(tail, path, len(lines) + 1), path, len(lines) + 1)
            if repair:  # complete JSON, only the newline is missing
                _append(path, b"\n", data)
        except ResultsFileError:
            if repair:
                _truncate(path, len(data) - len(tail))
    return results


def _append(path: AnyPath, text: bytes, before: bytes | None = None) -> None:
    """Add `text` at the end of `path` (`before`: its current bytes, when already read)."""
    if storage.is_url(path):  # no append on object stores: one upload of the whole file
        if before is None:
            before = read_bytes(path) if storage.exists(path) else b""
        write_bytes(path, before + text)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        f.write(text)
        sync(f)


def _truncate(path: AnyPath, size: int) -> None:
    if storage.is_url(path):
        write_bytes(path, read_bytes(path)[:size])
        return
    with open(path, "r+b") as f:
        f.truncate(size)
        sync(f)


def _parse(raw: bytes, path: AnyPath, number: int) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ResultsFileError(
            f"{path}: line {number} is not valid JSON; remove that line (its task is then evaluated again)"
        ) from None


def _add(results: dict, line: Any, path: AnyPath, number: int) -> None:
    if not (
        isinstance(line, dict) and isinstance(line.get("key"), str) and isinstance(line.get("metrics"), dict)
    ):
        raise ResultsFileError(
            f'{path}: line {number} is not a result ({{"key", "dataset", "metrics"}}); remove that line'
        )
    results[line["key"]] = line


def append_result(path: str | PathLike, line: dict) -> None:
    """Append one result line and make it durable before returning."""
    text = json.dumps(_json_safe(line), allow_nan=False) + "\n"
    _append(storage.location(path), text.encode("utf-8"))


def _json_safe(value: Any) -> Any:
    # NaN / inf are not JSON; a metric that cannot be computed is null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def result_line(key: str, dataset: str, metrics: dict, main_metric: str | None) -> dict:
    """A DataComp result line: `main_metric` is the value of the task's main metric (None if unscored)."""
    metrics = dict(metrics)
    metrics["main_metric"] = metrics.get(main_metric) if main_metric else None
    return {"key": key, "dataset": dataset, "metrics": metrics}


def identity_path(path: str | PathLike) -> AnyPath:
    path = storage.location(path)
    return path.with_name(path.name + ".model.json")


def check_identity(path: str | PathLike, identity: dict) -> None:
    """Record the model behind `path`'s results, or refuse when they belong to another model.

    Results without a record (e.g. written by DataComp's evaluate.py) are adopted by this model."""
    side = identity_path(path)
    marker = Marker(side)
    fp = fingerprint(identity)
    if storage.exists(side):
        stored = legacy_identity(marker.read())
        if (stored or {}).get("fingerprint") != fp:
            model = (stored or {}).get("model")
            raise ResultsFileError(
                f"{path} holds results of another model ({side}: {json.dumps(model)}; this run: "
                f"{json.dumps(identity)}). Write to a new --out, or delete both files to start over"
            )
        return
    marker.write(fp, model=identity)
