"""The task registry: evaluation suites read from `configs/eval/<suite>.yaml`. SPEC §3 "Task list".

A suite is one YAML file listing its tasks (key, display name, type, main metric, group, ...) and how its
aggregates are formed; `datacomp.yaml` mirrors DataComp's `tasklist.yml` and `synthetic.yaml` the
synthetic world's tasks. Everything else in `hype.eval` reads task facts from here, never from constants.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hype.config import list_presets, preset_dir
from hype.eval.metrics import GROUP_EVALUATORS

TASK_TYPES = ("zeroshot_classification", "retrieval", "winogavil", "multi_objective_classification")
SUITE_ALIASES = {"all": "datacomp"}  # `--tasks all` = DataComp's 40 tasks


class TaskConfigError(ValueError):
    """A suite file that cannot be used, or a task selection naming unknown tasks."""


def default_folder(key: str) -> str:
    """DataComp / CLIP_benchmark folder name of a task: `wds_<key with / -> ->_test`."""
    return f"wds_{key.replace('/', '-')}_test"


@dataclass(frozen=True)
class TaskSpec:
    key: str
    name: str
    type: str
    main_metric: str | None
    group: str
    scored: bool
    folders: tuple[str, ...]
    suite: str
    suite_file: str  # the YAML file the task comes from (aggregates are per suite)
    size: int | None = None
    num_classes: int | None = None
    random_score: float | None = None
    metadata_fields: tuple[str, ...] | None = None
    evaluator: str | None = None  # group-metric evaluator over the .npy metadata (metrics.GROUP_EVALUATORS)

    def find(self, data_dir: str | Path) -> Path | None:
        """The task's dataset folder under `data_dir` (first of `folders` that exists), or None."""
        for name in self.folders:
            path = Path(data_dir) / name
            if path.is_dir():
                return path
        return None


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    average_name: str
    aggregates: dict[str, str]  # group -> display name of its mean, in display order
    tasks: tuple[TaskSpec, ...]
    path: Path

    @property
    def scored(self) -> tuple[TaskSpec, ...]:
        return tuple(t for t in self.tasks if t.scored)

    def get(self, key: str) -> TaskSpec | None:
        return next((t for t in self.tasks if t.key == key), None)


def suites_dir() -> Path:
    return preset_dir("eval")


def list_suites() -> list[str]:
    return list_presets("eval")


def load_suite(name_or_path: str | Path) -> Suite:
    """A suite by name (`datacomp`, `synthetic`, or `all` for datacomp) or by YAML path."""
    text = str(name_or_path)
    path = Path(text)
    if not (path.suffix in (".yaml", ".yml") or path.is_file()):
        name = SUITE_ALIASES.get(text, text)
        path = suites_dir() / f"{name}.yaml"
        if not path.is_file():
            raise TaskConfigError(
                f"unknown evaluation suite {text!r} (looked in {path.parent}); "
                f"available: {', '.join(['all'] + list_suites())}"
            )
    if not path.is_file():
        raise TaskConfigError(f"suite file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise TaskConfigError(f"{path}: not valid YAML ({e})") from None
    return _parse_suite(raw, path)


def _parse_suite(raw: Any, path: Path) -> Suite:
    def fail(msg: str) -> TaskConfigError:
        return TaskConfigError(f"{path}: {msg}")

    if not isinstance(raw, dict) or not isinstance(raw.get("tasks"), list) or not raw["tasks"]:
        raise fail("expected a mapping with a non-empty `tasks` list")
    name = str(raw.get("suite") or path.stem)
    aggregates = raw.get("aggregates") or {}
    if not isinstance(aggregates, dict):
        raise fail("`aggregates` must map a group name to its display name")
    tasks: list[TaskSpec] = []
    for i, entry in enumerate(raw["tasks"]):
        try:
            tasks.append(_parse_task(entry, name, str(path)))
        except (KeyError, TypeError, ValueError) as e:
            label = entry.get("key", f"#{i}") if isinstance(entry, dict) else f"#{i}"
            msg = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            raise fail(f"task {label}: {msg}") from None
    keys = [t.key for t in tasks]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        raise fail(f"duplicate task keys: {', '.join(dupes)}")
    unknown_groups = sorted(set(aggregates) - {t.group for t in tasks})
    if unknown_groups:
        raise fail(f"aggregates name groups that no task has: {', '.join(unknown_groups)}")
    return Suite(
        name=name,
        description=str(raw.get("description", "")),
        average_name=str(raw.get("average", "Average")),
        aggregates={str(k): str(v) for k, v in aggregates.items()},
        tasks=tuple(tasks),
        path=path,
    )


def _parse_task(entry: Any, suite: str, suite_file: str) -> TaskSpec:
    if not isinstance(entry, dict):
        raise TypeError("each task must be a mapping")
    key, name, type_ = str(entry["key"]), str(entry["name"]), str(entry["type"])
    if type_ not in TASK_TYPES:
        raise ValueError(f"type must be one of {', '.join(TASK_TYPES)}; got {type_!r}")
    main_metric = entry["main_metric"]
    scored = bool(entry.get("scored", main_metric is not None))
    if scored and main_metric is None:
        raise ValueError("a scored task needs a main_metric")
    if "folder" in entry and "folders" in entry:
        raise ValueError("give `folder` or `folders`, not both")
    folders = entry.get("folders") or [entry.get("folder") or default_folder(key)]
    metadata = entry.get("metadata")
    fields = evaluator = None
    if metadata is not None:
        fields = tuple(str(f) for f in metadata["fields"])
        evaluator = str(metadata["evaluator"])
        if evaluator not in GROUP_EVALUATORS:
            raise ValueError(f"metadata.evaluator must be one of {', '.join(GROUP_EVALUATORS)}")
        missing = [f for f in GROUP_EVALUATORS[evaluator] if f not in fields]
        if missing:
            raise ValueError(f"evaluator {evaluator!r} needs metadata fields {missing}")
    if type_ == "multi_objective_classification" and evaluator is None:
        raise ValueError("multi_objective_classification needs `metadata` (its labels live in the .npy)")
    return TaskSpec(
        key=key,
        name=name,
        type=type_,
        main_metric=None if main_metric is None else str(main_metric),
        group=str(entry["group"]),
        scored=scored,
        folders=tuple(str(f) for f in folders),
        suite=suite,
        suite_file=suite_file,
        size=_opt(entry, "size", int),
        num_classes=_opt(entry, "num_classes", int),
        random_score=_opt(entry, "random_score", float),
        metadata_fields=fields,
        evaluator=evaluator,
    )


def _opt(entry: dict, name: str, cast):
    value = entry.get(name)
    return None if value is None else cast(value)


def select_tasks(selection: str) -> list[TaskSpec]:
    """`all` (DataComp's 40), a suite name or YAML path, or comma-separated task keys of any suite."""
    selection = selection.strip()
    names = set(SUITE_ALIASES) | set(list_suites())
    if selection in names or selection.endswith((".yaml", ".yml")):
        return list(load_suite(selection).tasks)
    known: dict[str, TaskSpec] = {}
    for suite in list_suites():
        for t in load_suite(suite).tasks:
            known.setdefault(t.key, t)
    chosen, unknown = [], []
    for key in (k.strip() for k in selection.split(",")):
        if not key:
            continue
        if key in known:
            if known[key] not in chosen:
                chosen.append(known[key])
        else:
            unknown.append(key)
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, list(known), n=3)
            hints.append(f"{key!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
        raise TaskConfigError(
            f"unknown task(s): {'; '.join(hints)}. Use `all`, a suite ({', '.join(sorted(names))}) or "
            "task keys such as imagenet1k,vtab/cifar100,synth/shape"
        )
    if not chosen:
        raise TaskConfigError("no tasks selected; pass --tasks all, synthetic or a list of task keys")
    return chosen
