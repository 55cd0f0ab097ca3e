"""`hype submit`: assemble and validate a DataComp filtering-track submission folder.

Layout (the paths DataComp's `evaluate.py --submit` uploads to the Hugging Face repository, so the folder
can be pushed as is):

    OUT/<scale>_scale/samples/<subset file>    the subset file under its own name, copied byte for byte
    OUT/<scale>_scale/results.jsonl            the evaluation results, copied after validation
    OUT/<scale>_scale/submission.json          method, scale, training settings, per-task main metrics,
                                               and the selection settings from subset.json

Checks, each failing with an error that names the problem: the subset is an array of dtype `u8,u8` in
either layout DataComp's README allows, `.npy` or raw memmap (never unpickled), sorted, non-empty, with
no more unique uids than the scale's pool; with `--scores`, every uid is in the pool's scores table; every
results line is a JSON object with a `key`, a `dataset` and `metrics` holding a numeric or null
`main_metric`, and no task appears twice.
"""

from __future__ import annotations

import json
import math
import shutil
from datetime import UTC, datetime
from os import PathLike
from pathlib import Path

import numpy as np

from hype import __version__
from hype.config import preset_dir, read_yaml
from hype.data.errors import SelectError
from hype.data.uids import UidMultiset, load_uid_file
from hype.io import atomic_path, file_digest, read_json, write_json

SCALES = ("debug", "small", "medium", "large", "xlarge")


def scale_config(scale: str) -> dict:
    """DataComp's fixed settings of a scale, from `configs/train/datacomp-<scale>.yaml` (the one place the
    repository records them; DataComp fixes samples seen = the pool size of the scale)."""
    if scale not in SCALES:
        raise SelectError(f"--scale {scale!r}: DataComp scales are {', '.join(SCALES)}")
    path = preset_dir("train") / f"datacomp-{scale}.yaml"
    try:
        raw = read_yaml(path)
        cfg = {
            "pool_size": int(raw["samples_seen"]),
            "model": str(raw["model"]),
            "batch_size": int(raw["batch_size"]),
            "learning_rate": float(raw["optim"]["lr"]),
        }
    except (OSError, KeyError, TypeError, ValueError) as e:  # ValueError includes ConfigError
        raise SelectError(f"{path}: cannot read the settings of scale {scale} ({e})") from None
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
    from hype.select.table import ScoresTable

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
    """The lines of an eval_results.jsonl, validated (DataComp's format, DESIGN §3 "Results")."""
    path = Path(path)
    if not path.is_file():
        raise SelectError(f"--eval-results {path}: no such file; run hype eval (or DataComp's evaluate.py)")
    lines: list[dict] = []
    seen: dict[str, int] = {}
    text = path.read_text(encoding="utf-8", errors="strict")
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except json.JSONDecodeError as e:
            raise SelectError(
                f"{path}: line {number} is not valid JSON ({e.msg}); fix or remove it"
            ) from None
        where = f"{path}: line {number}"
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
        if mm is not None and (
            isinstance(mm, bool) or not isinstance(mm, (int, float)) or not math.isfinite(mm)
        ):
            raise SelectError(f"{where}: main_metric {mm!r} is not a finite number or null")
        if line["key"] in seen:
            raise SelectError(
                f"{where}: task {line['key']!r} already appears on line {seen[line['key']]}; keep one line "
                "per task"
            )
        seen[line["key"]] = number
        lines.append(line)
    if not lines:
        raise SelectError(f"{path}: no results in the file; evaluate the model first")
    return lines


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
    cfg = scale_config(scale)
    subset = Path(subset)
    arr, facts = check_subset(subset, cfg["pool_size"])
    pool_check = check_in_scores(arr, scores, workers, progress) if scores is not None else None
    results = check_results(eval_results)
    folder = Path(out) / f"{scale}_scale"
    if folder.exists() and any(folder.iterdir()):
        if not overwrite:
            raise SelectError(
                f"--out {out}: {folder} already holds a submission; pass --overwrite or another --out"
            )
        shutil.rmtree(folder)
    selection = read_json(subset.with_suffix(".json"))
    scored = [r["metrics"]["main_metric"] for r in results if r["metrics"]["main_metric"] is not None]
    meta = {
        "method_name": method_name or _default_name(selection),
        "track": "filtering",
        "scale": scale,
        "model": cfg["model"],
        "batch_size": cfg["batch_size"],
        "learning_rate": cfg["learning_rate"],
        "train_num_samples": cfg["pool_size"],
        "dataset_size": facts["rows"],
        "subset": {"file": f"samples/{subset.name}", "sha256": file_digest(subset), **facts},
        "pool_check": pool_check,
        "results": {
            "tasks": len(results),
            "scored_tasks": len(scored),
            "average": sum(scored) / len(scored) if scored else None,
            "main_metrics": {r["dataset"]: r["metrics"]["main_metric"] for r in results},
        },
        "selection": _selection_settings(selection),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "hype_version": __version__,
    }
    (folder / "samples").mkdir(parents=True, exist_ok=True)
    _copy(subset, folder / "samples" / subset.name)
    _copy(Path(eval_results), folder / "results.jsonl")
    write_json(folder / "submission.json", meta, sort_keys=False)
    meta["folder"] = str(folder)
    return meta


def _default_name(selection: dict | None) -> str:
    preset = (selection or {}).get("preset")
    return "hype" if preset in (None, "hype") else f"hype ({preset})"


def _copy(src: Path, dst: Path) -> None:
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)


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
