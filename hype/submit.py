"""`hype submit`: assemble and validate a DataComp filtering-track submission folder.

Layout (the paths DataComp's `evaluate.py --submit` uploads to the Hugging Face repository, so the folder
can be pushed as is):

    OUT/<scale>_scale/samples/<subset file>    the subset file under its own name, copied byte for byte
    OUT/<scale>_scale/results.jsonl            the evaluation results, copied after validation
    OUT/<scale>_scale/submission.json          method, scale, DataComp's training settings (model named as
                                               DataComp names it: ViT-B-32, ...), per-task main metrics,
                                               the aggregates, and the selection settings from subset.json

Checks, each failing with an error that names the file and the fix: the subset is an array of dtype
`u8,u8` in either layout DataComp's README allows, `.npy` or raw memmap (never unpickled), sorted,
non-empty, with no more unique uids than the scale's pool; with `--scores`, every uid is in the pool's
scores table. The results are checked as DataComp's own code reads them (DESIGN §3 "Results"): every line
is UTF-8 JSON (evaluate.py parses each line, blank ones too) with a `key`, a `dataset` and `metrics`
holding `main_metric`; no task twice; no NaN or Infinity; every key is one of DataComp's tasks
(`configs/eval/datacomp.yaml`, a copy of its tasklist.yml) with DataComp's display name, which evaluate.py
and aggregate_scores.py look results up by; each of the 38 scored tasks is present with main_metric equal
to the task's main metric (ImageNet 1k's acc1 is what the submission reports); the two unscored ones have
a null main_metric (aggregate_scores.py asserts exactly 38 scored lines).

submission.json is written last and is the folder's completion marker (the run contract, `hype.io.runs`):
it records the fingerprint of the subset's sha256, the results' digest, the scores' identity and the
settings. A rerun with the same inputs and settings returns it at once (`skipped`, nothing read or
written, not even the scores check); with anything changed, the folder is replaced only with --overwrite.
"""

from __future__ import annotations

import json
import math
import shutil
from datetime import UTC, datetime
from os import PathLike

import numpy as np

from hype import __version__
from hype.config import read_yaml, resolve_preset
from hype.data.errors import SelectError
from hype.data.uids import UidMultiset, load_uid_file
from hype.eval.report import aggregate
from hype.eval.tasks import Suite, TaskSpec, load_suite
from hype.io import (
    AnyPath,
    atomic_path,
    blake2b128_file,
    open_input,
    read_bytes,
    read_json,
    runs,
    sha256_file,
    storage,
)

SCALES = ("debug", "small", "medium", "large", "xlarge")
# DataComp records the architecture by open_clip's name (scale_configs.py: ViT-B-32 for debug, small and
# medium, ViT-B-16 for large, ViT-L-14 for xlarge); these are hype's configs of the same architectures
# (tests/test_models.py checks them against open_clip).
DATACOMP_MODEL_NAMES = {"clip-vit-b32": "ViT-B-32", "clip-vit-b16": "ViT-B-16", "clip-vit-l14": "ViT-L-14"}


def scale_config(scale: str) -> dict:
    """DataComp's fixed settings of a scale, from `configs/train/datacomp-<scale>.yaml` (the one place the
    repository records them; DataComp fixes samples seen = the pool size of the scale). `model` is the
    architecture as DataComp names it, `model_config` hype's config of it."""
    if scale not in SCALES:
        raise SelectError(f"--scale {scale!r}: DataComp scales are {', '.join(SCALES)}")
    preset = f"datacomp-{scale}"
    try:
        path = resolve_preset("train", preset, "training")
        raw = read_yaml(path)
        cfg = {
            "pool_size": int(raw["samples_seen"]),
            "model_config": str(raw["model"]),
            "batch_size": int(raw["batch_size"]),
            "learning_rate": float(raw["optim"]["lr"]),
        }
    except (OSError, KeyError, TypeError, ValueError) as e:  # ValueError includes ConfigError
        raise SelectError(
            f"training preset {preset}: cannot read the settings of scale {scale} ({e})"
        ) from None
    if cfg["model_config"] not in DATACOMP_MODEL_NAMES:
        raise SelectError(
            f"{path}: model {cfg['model_config']!r} is not an architecture DataComp trains; its scales use "
            f"{', '.join(DATACOMP_MODEL_NAMES)} (DataComp's {', '.join(DATACOMP_MODEL_NAMES.values())})"
        )
    cfg["model"] = DATACOMP_MODEL_NAMES[cfg["model_config"]]
    return cfg


def check_subset(path: str | PathLike, pool_size: int) -> tuple[np.ndarray, dict]:
    """Load and validate a subset file the way DataComp reads it (`.npy` or raw memmap, see
    `hype.data.uids.load_subset`); returns the array and facts about it."""
    arr = load_uid_file(path, "--subset")
    unique = len(UidMultiset(arr))
    if unique > pool_size:
        raise SelectError(
            f"--subset {path}: {unique:,} unique uids, more than the {pool_size:,} samples of the scale's "
            "pool; "
            "check --scale"
        )
    return arr, {"rows": int(len(arr)), "unique": unique, "duplicates": int(len(arr) - unique)}


def check_in_scores(
    arr: np.ndarray, run_dir: str | PathLike, workers: int = 2, progress: bool = True
) -> dict:
    """Every uid of the subset must be a row of the scores table (i.e. a sample of this pool)."""
    from hype.data.uids import pairs_to_arrow
    from hype.table.reader import ScoresTable

    table = ScoresTable(run_dir)
    table.require(["uid"])
    ms = UidMultiset(arr)
    found = np.zeros(len(ms), dtype=bool)
    for batch in table.iter_batches(["uid"], workers=workers, progress="checking uids" if progress else None):
        idx = ms.find(*batch.uid_pairs())
        found[idx[idx >= 0]] = True
    missing = np.flatnonzero(~found)
    if len(missing):
        examples = pairs_to_arrow(ms.hi[missing[:3]], ms.lo[missing[:3]]).to_pylist()
        raise SelectError(
            f"{len(missing):,} of the subset's {len(ms):,} unique uids are not in the scores of {run_dir} "
            f"(e.g. {', '.join(examples)}); submit a subset of this pool, or drop --scores to skip the check"
        )
    return {"scores": str(run_dir), "pool_rows": table.num_rows, "all_uids_in_pool": True}


def check_results(path: str | PathLike) -> list[dict]:
    """The lines of an eval_results.jsonl, validated as DataComp reads them (module docstring)."""
    path = storage.location(path)
    if not storage.is_file(path):
        raise SelectError(f"--eval-results {path}: no such file; run hype eval (or DataComp's evaluate.py)")
    numbered = _read_lines(path)
    if not numbered:
        raise SelectError(f"{path}: no results in the file; evaluate the model first")
    _check_tasks(path, numbered, load_suite("datacomp"))
    return [line for _, line in numbered]


def _read_lines(path: AnyPath) -> list[tuple[int, dict]]:
    """(line number, line) for each result line, each checked for DataComp's format on its own."""
    try:
        text = read_bytes(path).decode("utf-8", errors="strict")
    except UnicodeDecodeError as e:
        raise SelectError(
            f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); write it with hype eval"
        ) from None
    lines: list[tuple[int, dict]] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        where = f"{path}: line {number}"
        if not raw.strip():
            # evaluate.py json-loads every line of a cached results file: a blank one stops it.
            raise SelectError(f"{where} is empty; DataComp's evaluate.py parses every line, remove it")
        try:
            line = json.loads(raw)
        except json.JSONDecodeError as e:
            raise SelectError(f"{where} is not valid JSON ({e.msg}); fix or remove it") from None
        _check_line(where, line)
        if line["key"] in seen:
            raise SelectError(
                f"{where}: task {line['key']!r} already appears on line {seen[line['key']]}; keep one line "
                "per task"
            )
        seen[line["key"]] = number
        lines.append((number, line))
    return lines


def _check_line(where: str, line: object) -> None:
    if not isinstance(line, dict):
        raise SelectError(f"{where} is not a JSON object")
    for field, typ in (("key", str), ("dataset", str), ("metrics", dict)):
        if not isinstance(line.get(field), typ):
            raise SelectError(
                f"{where}: missing or bad {field!r} (expected {typ.__name__}); lines look like "
                '{"key": ..., "dataset": ..., "metrics": {..., "main_metric": ...}}'
            )
    if "main_metric" not in line["metrics"]:
        raise SelectError(f"{where}: metrics has no 'main_metric' (use null for unscored tasks)")
    mm = line["metrics"]["main_metric"]
    if mm is not None and not _is_number(mm):
        raise SelectError(f"{where}: main_metric {mm!r} is not a finite number or null")
    for name, value in line["metrics"].items():
        if _has_non_finite(value):
            # Python's json writes NaN / Infinity; they are not JSON, and hype eval writes null instead.
            raise SelectError(
                f"{where}: metrics[{name!r}] is NaN or infinite, which is not JSON; write null for a metric "
                "that cannot be computed"
            )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _has_non_finite(value: object) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_has_non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_non_finite(v) for v in value)
    return False


def _check_tasks(path: AnyPath, numbered: list[tuple[int, dict]], suite: Suite) -> None:
    """Every line is a DataComp task under DataComp's name and main metric; every scored task is there."""
    tasks = {t.key: t for t in suite.tasks}
    synthetic = {t.key for t in load_suite("synthetic").tasks}
    if not any(line["key"] in tasks for _, line in numbered):
        keys = [line["key"] for _, line in numbered]
        raise SelectError(_not_datacomp(path, keys, synthetic, len(suite.scored)))
    for number, line in numbered:
        where = f"{path}: line {number}"
        task = tasks.get(line["key"])
        if task is None:
            kind = "a synthetic-world task" if line["key"] in synthetic else "not a task"
            raise SelectError(
                f"{where}: {line['key']!r} is {kind} of DataComp's {len(tasks)}-task benchmark; "
                "aggregate_scores.py counts every scored line, so remove it"
            )
        if line["dataset"] != task.name:
            raise SelectError(
                f"{where}: task {task.key!r} is named {line['dataset']!r}; DataComp names it {task.name!r} "
                'and evaluate.py and aggregate_scores.py look results up by that name: fix its "dataset"'
            )
        _check_main_metric(where, task, line["metrics"])
    present = {line["key"] for _, line in numbered}
    missing = [t for t in suite.scored if t.key not in present]
    if missing:
        lead = "".join(
            f"no {t.name!r} line (key {t.key}), whose {t.main_metric} DataComp's submission reports; "
            for t in missing
            if t.group == "imagenet"
        )
        raise SelectError(
            f"{path}: {lead}missing {len(missing)} of DataComp's {len(suite.scored)} scored tasks: "
            f"{', '.join(f'{t.name} ({t.key})' for t in missing)}. aggregate_scores.py needs all of them: "
            f"run hype eval --tasks all --out {path} (it keeps the finished tasks)"
        )


def _check_main_metric(where: str, task: TaskSpec, metrics: dict) -> None:
    value = metrics["main_metric"]
    if not task.scored:
        if value is not None:
            raise SelectError(
                f"{where}: {task.name} has no main metric in DataComp, but main_metric is {value!r}; "
                "aggregate_scores.py would count it as a scored task: set it to null"
            )
        return
    if value is None:
        raise SelectError(
            f"{where}: {task.name} has no score (main_metric null) and aggregate_scores.py needs every "
            "scored task: delete the line and evaluate it again with hype eval"
        )
    named = metrics.get(task.main_metric)
    if not _is_number(named) or not math.isclose(value, named, rel_tol=1e-9, abs_tol=0.0):
        raise SelectError(
            f"{where}: main_metric {value!r} is not metrics[{task.main_metric!r}] ({named!r}), the main "
            f"metric DataComp reads for {task.name}; delete the line and evaluate it again with hype eval"
        )


def _not_datacomp(path: AnyPath, keys: list[str], synthetic: set[str], scored: int) -> str:
    shown = ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")
    if all(k in synthetic for k in keys):
        return (
            f"{path}: these are synthetic-world results; DataComp needs the {scored}-task benchmark (the "
            f"file holds only hype synth's tasks: {shown}). Evaluate the model trained at a DataComp scale "
            "with hype eval --tasks all --data-dir <DataComp's evaluation sets>"
        )
    return (
        f"{path}: no line of the file is a DataComp task (keys {shown}); DataComp needs its {scored}-task "
        "benchmark: evaluate with hype eval --tasks all"
    )


def make_submission(
    scale: str,
    subset: str | PathLike,
    eval_results: str | PathLike,
    out: str | PathLike,
    *,
    method_name: str | None = None,
    scores: str | PathLike | None = None,
    overwrite: bool = False,
    workers: int = 2,
    progress: bool = True,
) -> dict:
    """Check the subset and the results (module docstring) and write OUT/<scale>_scale; returns the
    contents of submission.json plus `folder`. Nothing is written when a check fails. Each path may be a
    URL (`hype.io.storage`)."""
    cfg = scale_config(scale)
    storage.check_reachable(out)  # a missing bucket or refused credentials: before the checks, not after
    subset = storage.location(subset)
    arr, facts = check_subset(subset, cfg["pool_size"])
    results = check_results(eval_results)
    folder = storage.join(out, f"{scale}_scale")
    subset_sha = sha256_file(subset)  # what submission.json shows (sha256sum)
    selection = read_json(subset.with_suffix(".json"))
    inputs = {
        "scale": scale,
        "method_name": method_name,
        "subset": subset_sha,
        "selection": selection,
        "results": blake2b128_file(eval_results),
        "scores": None if scores is None else _scores_identity(scores),
    }
    marker = runs.Marker(folder / "submission.json")
    fp = runs.fingerprint(inputs)
    if not overwrite and (finished := marker.done(fp)) is not None:
        return {**finished, "folder": str(folder), "skipped": True}  # made before from the same inputs
    pool_check = check_in_scores(arr, scores, workers, progress) if scores is not None else None
    suite = load_suite("datacomp")
    if _holds_files(folder):
        if not overwrite:
            raise SelectError(
                f"--out {out}: {folder} already holds a submission; pass --overwrite or another --out"
            )
        storage.remove_tree(folder)
    aggregates = {row["name"]: row["value"] for row in aggregate(suite, {r["key"]: r for r in results})}
    meta = {
        "method_name": method_name or _default_name(selection),
        "track": "filtering",
        "scale": scale,
        "model": cfg["model"],
        "model_config": cfg["model_config"],
        "batch_size": cfg["batch_size"],
        "learning_rate": cfg["learning_rate"],
        "train_num_samples": cfg["pool_size"],
        "dataset_size": facts["rows"],
        "subset": {"file": f"samples/{subset.name}", "sha256": subset_sha, **facts},
        "pool_check": pool_check,
        "results": {
            "tasks": len(results),
            "scored_tasks": len(suite.scored),
            "average": aggregates[suite.average_name],
            "aggregates": aggregates,  # as aggregate_scores.py computes them
            "main_metrics": {r["dataset"]: r["metrics"]["main_metric"] for r in results},
        },
        "selection": _selection_settings(selection),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "hype_version": __version__,
    }
    storage.makedirs(folder / "samples")
    _copy(subset, folder / "samples" / subset.name)
    _copy(eval_results, folder / "results.jsonl")
    meta = marker.write(fp, **meta)  # last: the folder is complete
    meta["folder"] = str(folder)
    return meta


def _scores_identity(run_dir: str | PathLike) -> list[dict]:
    """The identity of every file of the scores table (the pool the subset is checked against)."""
    from hype.table.reader import ScoresTable

    return [runs.input_identity(f) for f in ScoresTable(run_dir).files]


def _default_name(selection: dict | None) -> str:
    preset = (selection or {}).get("preset")
    return "hype" if preset in (None, "hype") else f"hype ({preset})"


def _holds_files(folder: AnyPath) -> bool:
    if storage.is_url(folder):
        return storage.is_dir(folder)  # a prefix is a folder only while objects are under it
    return folder.is_dir() and any(folder.iterdir())


def _copy(src: str | PathLike | AnyPath, dst: AnyPath) -> None:
    """Byte for byte, between any two of local disk and object storage."""
    with atomic_path(dst) as tmp, open_input(src, stream=True) as f, open(tmp, "wb") as g:
        shutil.copyfileobj(f, g, 1 << 20)


def _selection_settings(s: dict | None) -> dict | None:
    """The parts of `hype select`'s subset.json that say how the subset was made."""
    if s is None:
        return None
    keys = (
        "preset",
        "rank",
        "filters",
        "union",
        "target",
        "cut",
        "pool_rows",
        "selected_rows",
        "subset_rows",
    )
    return {k: s[k] for k in keys if k in s}
