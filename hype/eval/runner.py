"""Run an evaluation suite for one model: find each task's data, evaluate, append results, aggregate.

`run_eval` is the library entry point behind `hype eval`. Tasks already in the results file are skipped
(DataComp's resume rule), missing datasets are reported and skipped (or fatal with `strict`), a task that
fails is reported and the run goes on; the returned summary is machine-readable and `report.format_table`
renders it for humans.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hype.data.imageprep import Preprocess
from hype.eval import metrics as M
from hype.eval import readers as R
from hype.eval.report import aggregate, main_metric
from hype.eval.results import append_result, check_identity, read_results, result_line
from hype.eval.tasks import TaskSpec, load_suite
from hype.eval.zeroshot import (
    EncodeOptions,
    class_embeddings,
    run_classification,
    run_retrieval,
    run_winogavil,
)
from hype.io import AnyPath, storage


class EvalError(ValueError):
    """A run that cannot start or, with `strict`, cannot be complete; the message says what to fix."""


@dataclass
class RunOptions:
    batch_size: int = 64
    device: str | torch.device | None = None  # default: cuda if available, else cpu
    workers: int | None = None  # DataLoader decode processes; default: see default_workers
    amp: bool = False
    strict: bool = False
    progress: bool = True


def default_workers(device: torch.device) -> int:
    """Decode processes: up to 8 beside a GPU; on CPU only the cores torch's threads leave free, since
    decoding on a core the model also uses slows both (inline decoding is then faster)."""
    cores = os.cpu_count() or 1
    if device.type == "cpu":
        return max(0, min(8, cores - torch.get_num_threads()))
    return max(1, min(8, cores))


def resolve_data_dir(data_dir: str | Path) -> AnyPath:
    """The folder holding the task folders; a synthetic world's root resolves to its `eval/`."""
    path = storage.location(data_dir)
    if not storage.is_dir(path):
        raise EvalError(f"--data-dir {path}: not a folder; point it at the folder holding wds_<task>_test/")
    if not _task_folders(path, "wds_*") and storage.is_dir(path / "eval"):
        return path / "eval"
    return path


def _task_folders(data_dir: AnyPath, pattern: str) -> bool:
    """Whether folders matching `pattern` hold files (one listing on object storage)."""
    return bool(storage.glob(f"{data_dir}/{pattern}/*"))


def locate(task: TaskSpec, data_dir: AnyPath) -> tuple[AnyPath | None, str | None]:
    """The task's folder and None, or None and why it is not usable."""
    folder = task.find(data_dir)
    if folder is None:
        return None, f"no folder {' or '.join(str(data_dir / f) for f in task.folders)}"
    if task.type != "winogavil":
        try:
            R.shard_paths(folder)
        except R.TaskDataError as e:
            return None, str(e)
    elif not storage.is_file(folder / "items.jsonl"):
        return None, f"{folder / 'items.jsonl'} missing"
    return folder, None


def run_eval(
    model,
    tasks: list[TaskSpec],
    data_dir: str | Path,
    out: str | Path,
    options: RunOptions | None = None,
    *,
    identity: dict | None = None,
) -> dict:
    """Evaluate `model` on `tasks`, appending one line per finished task to `out` (eval_results.jsonl).
    `data_dir` and `out` may be URLs (`hype.io.storage`)."""
    opts = options or RunOptions()
    start = time.perf_counter()
    data_dir, out = resolve_data_dir(data_dir), storage.location(out)
    storage.check_reachable(out)  # a missing bucket: before the first task, not after it
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    workers = default_workers(device) if opts.workers is None else opts.workers
    if identity is not None:  # before touching the results file: it may belong to another model
        check_identity(out, identity)
    results = read_results(out, repair=True)

    located = {t.key: locate(t, data_dir) for t in tasks if t.key not in results}
    missing = [{"key": k, "reason": why} for k, (folder, why) in located.items() if folder is None]
    if missing and opts.strict:
        listing = "\n".join(f"  {m['key']}: {m['reason']}" for m in missing)
        raise EvalError(f"--strict: {len(missing)} dataset(s) missing under {data_dir}:\n{listing}")

    model = model.to(device).eval()
    encode = EncodeOptions(device=device, batch_size=opts.batch_size, amp=opts.amp)
    rows, failed = [], []
    for task in tasks:
        row = {"key": task.key, "dataset": task.name, "main_metric_name": task.main_metric}
        rows.append(row)
        if task.key in results:
            row.update(status="cached", metrics=results[task.key]["metrics"])
            row["main_metric"] = main_metric(results[task.key])
            continue
        folder, why = located[task.key]
        if folder is None:
            row.update(status="missing", reason=why)
            continue
        t0 = time.perf_counter()
        try:
            metrics, stats = evaluate_task(model, task, folder, encode, workers, opts.progress)
        except (R.TaskDataError, ValueError, OSError) as e:
            if opts.strict:
                raise EvalError(f"{task.key} ({folder}): {e}") from e
            failed.append({"key": task.key, "error": str(e)})
            row.update(status="failed", error=str(e))
            continue
        seconds = time.perf_counter() - t0
        line = result_line(task.key, task.name, metrics, task.main_metric)
        append_result(out, line)
        results[task.key] = line
        row.update(
            status="done",
            metrics=line["metrics"],
            main_metric=main_metric(line),
            seconds=round(seconds, 3),
            images_per_s=round(stats.num_samples / seconds, 1) if seconds > 0 else None,
            skip_examples=stats.examples,
        )

    counts = {s: sum(r["status"] == s for r in rows) for s in ("done", "cached", "missing", "failed")}
    hint = None
    if tasks and counts["missing"] == len(tasks) and _task_folders(data_dir, "wds_synth-*_test"):
        hint = (
            f"none of the selected datasets is in {data_dir}; its synthetic tasks run with --tasks synthetic"
        )
    suites = {t.suite: t.suite_file for t in tasks}
    return {
        "out": str(out),
        "data_dir": str(data_dir),
        "device": str(device),
        "model": identity,
        "tasks": rows,
        "aggregates": {name: aggregate(load_suite(path), results) for name, path in suites.items()},
        "missing": missing,
        "failed": failed,
        "counts": counts,
        "hint": hint,
        "elapsed_s": round(time.perf_counter() - start, 3),
    }


def _bar(task: TaskSpec, folder: AnyPath, enabled: bool):
    from tqdm import tqdm

    total, unit = task.size, "img"
    if task.type == "winogavil":
        unit = "item"
    elif total is None and enabled:
        total = R.count_samples(R.shard_paths(folder))
    return tqdm(
        total=total, desc=task.name, unit=unit, file=sys.stderr, disable=not enabled, dynamic_ncols=True
    )


def evaluate_task(
    model, task: TaskSpec, folder: AnyPath, encode: EncodeOptions, workers: int, progress: bool = True
) -> tuple[dict, R.ReadStats]:
    """Metrics of one task (without main_metric, with the reader's counts) and what was skipped."""
    evaluate = _EVALUATORS.get(task.type)
    if evaluate is None:  # the registry validates types; this guards one added there but not here
        raise ValueError(f"task type {task.type!r} has no evaluator")
    loader_args = dict(
        transform=Preprocess.of(model),
        batch_size=encode.batch_size,
        workers=workers,
        pin_memory=encode.device.type == "cuda",
    )
    with _bar(task, folder, progress) as bar:
        metrics, stats = evaluate(model, task, folder, encode, loader_args, bar)
    metrics.update(stats.as_metrics())
    return metrics, stats


def _classification(model, task, folder, encode, loader_args, bar):
    classnames, templates = R.read_classnames(folder), R.read_templates(folder)
    k = min(5, len(classnames))
    head = class_embeddings(model, classnames, templates, encode)
    fields = _needed_fields(task)
    loader = R.wds_loader(folder, spec=R.WdsSpec(label=True, metadata_fields=fields), **loader_args)
    out = run_classification(model, loader, [head], [k], encode, bar)
    _need_samples(out.stats, folder)
    bad = (out.labels < 0) | (out.labels >= len(classnames))
    if bad.any():
        raise R.TaskDataError(
            f"{folder}: {int(bad.sum())} labels outside 0..{len(classnames) - 1} "
            f"(e.g. {int(out.labels[bad][0])}); classnames.txt does not match the .cls files"
        )
    metrics = M.classification_metrics(out.topk[0], out.labels, len(classnames))
    if task.evaluator:
        metrics.update(M.GROUP_METRIC_FNS[task.evaluator](out.topk[0], out.labels, out.meta, fields))
    return metrics, out.stats


def _multi_objective(model, task, folder, encode, loader_args, bar):
    objectives = _objectives(folder, M.FAIRFACE_OBJECTIVES)
    heads = [class_embeddings(model, names, templates, encode) for names, templates in objectives]
    fields = _needed_fields(task)
    loader = R.wds_loader(folder, spec=R.WdsSpec(label=False, metadata_fields=fields), **loader_args)
    out = run_classification(model, loader, heads, [1] * len(heads), encode, bar)
    _need_samples(out.stats, folder)
    preds = np.stack([t[:, 0] for t in out.topk], axis=1)
    return M.GROUP_METRIC_FNS[task.evaluator](preds, None, out.meta, fields), out.stats


def _retrieval(model, task, folder, encode, loader_args, bar):
    loader = R.wds_loader(folder, spec=R.WdsSpec(label=False, captions=True), **loader_args)
    out = run_retrieval(model, loader, encode, max(M.RETRIEVAL_KS), bar)
    _need_samples(out.stats, folder)
    return M.retrieval_metrics(out.images_per_text, out.texts_per_image, out.text_to_image), out.stats


def _winogavil(model, task, folder, encode, loader_args, bar):
    items, item_stats = R.read_winogavil(folder)
    loader = R.wino_loader(
        items, loader_args["transform"], batch_size=loader_args["batch_size"], workers=loader_args["workers"]
    )
    out = run_winogavil(model, loader, encode, bar)
    out.stats.merge(item_stats)
    _need_samples(out.stats, folder)
    return M.winogavil_metrics(out.scores, out.num_candidates), out.stats


_EVALUATORS = {
    "zeroshot_classification": _classification,
    "multi_objective_classification": _multi_objective,
    "retrieval": _retrieval,
    "winogavil": _winogavil,
}


def _needed_fields(task: TaskSpec) -> tuple[str, ...] | None:
    """The leading .npy fields the task's evaluator reads (positions as in DataComp / WILDS), or None
    when it reads none (iWildCam's metrics need no metadata, so its .npy is not required)."""
    if task.evaluator is None or task.metadata_fields is None:
        return None
    used = [task.metadata_fields.index(f) for f in M.GROUP_EVALUATORS[task.evaluator]]
    return task.metadata_fields[: max(used) + 1] if used else None


def _need_samples(stats: R.ReadStats, folder: AnyPath) -> None:
    if stats.num_samples == 0:
        why = "; ".join(stats.examples[:3]) or "the shards hold no samples"
        raise R.TaskDataError(f"{folder}: no usable samples ({why})")


def _objectives(folder: AnyPath, objectives: tuple[str, ...]) -> list[tuple[list[str], list[str]]]:
    """Per objective, its class names and templates from "<objective>:<text>" lines (FairFace/UTKFace)."""
    names = _split_objectives(R.read_classnames(folder), folder / "classnames.txt")
    templates = _split_objectives(
        R.read_lines(folder / "zeroshot_classification_templates.txt", "prompt templates"),
        folder / "zeroshot_classification_templates.txt",
    )
    missing = [o for o in objectives if o not in names or o not in templates]
    if missing:
        raise R.TaskDataError(
            f"{folder}: no classnames/templates for objective(s) {missing}; lines must read "
            f"'<objective>:<text>' for each of {', '.join(objectives)}"
        )
    return [(names[o], templates[o]) for o in objectives]


def _split_objectives(lines: list[str], path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in lines:
        if not line:
            continue
        if ":" not in line:
            raise R.TaskDataError(f"{path}: line {line!r} is not '<objective>:<text>'")
        objective, text = line.split(":", 1)
        out.setdefault(objective, []).append(text)
    return out
