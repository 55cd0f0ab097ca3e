"""The task registry: evaluation suites read from `configs/eval/<suite>.yaml`. DESIGN §3 "Task list".

A suite is one YAML file listing its tasks (key, display name, type, main metric, group, ...) and how its
aggregates are formed; `datacomp.yaml` mirrors DataComp's `tasklist.yml` and `synthetic.yaml` the
synthetic world's tasks. Everything else in `hype.eval` reads task facts from here, never from constants.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hype.config import ConfigError, build, list_presets, preset_path, read_yaml
from hype.eval.metrics import GROUP_EVALUATORS
from hype.io import AnyPath, storage

TASK_TYPES = ("zeroshot_classification", "retrieval", "winogavil", "multi_objective_classification")
SUITE_ALIASES = {"all": "datacomp"}  # `--tasks all` = DataComp's 40 tasks


class TaskConfigError(ConfigError):
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

    def find(self, data_dir: str | Path | AnyPath) -> AnyPath | None:
        """The task's dataset folder under `data_dir` (first of `folders` that exists), or None."""
        for name in self.folders:
            path = storage.join(data_dir, name)
            if storage.is_dir(path):
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


def list_suites() -> list[str]:
    return list_presets("eval")


def load_suite(name_or_path: str | Path) -> Suite:
    """A suite by name (`datacomp`, `synthetic`, or `all` for datacomp) or by YAML path."""
    text = str(name_or_path)
    path = Path(text)
    if not (path.suffix in (".yaml", ".yml") or path.is_file()):
        found = preset_path("eval", SUITE_ALIASES.get(text, text))
        if found is None:
            raise TaskConfigError(
                "", f"unknown evaluation suite {text!r}; available: {', '.join(['all'] + list_suites())}"
            )
        path = found
    if not path.is_file():
        raise TaskConfigError("", "suite file not found", str(path))
    try:
        return _parse_suite(read_yaml(path), path)
    except ConfigError as e:
        raise TaskConfigError(e.key, e.message, e.source) from None


# --- the schema of a suite file (built by hype.config; TaskSpec / Suite are what the rest reads) --------


@dataclass(frozen=True)
class _Metadata:
    fields: tuple[str, ...]
    evaluator: str

    def __post_init__(self) -> None:
        if self.evaluator not in GROUP_EVALUATORS:
            raise ConfigError("evaluator", f"must be one of {', '.join(GROUP_EVALUATORS)}")
        missing = [f for f in GROUP_EVALUATORS[self.evaluator] if f not in self.fields]
        if missing:
            raise ConfigError("fields", f"evaluator {self.evaluator!r} needs metadata fields {missing}")


@dataclass(frozen=True)
class _Task:
    key: str
    name: str
    type: str
    main_metric: str | None  # required; null = unscored
    group: str
    scored: bool | None = None  # default: whether there is a main_metric
    folder: str | None = None
    folders: tuple[str, ...] | None = None
    metadata: _Metadata | None = None
    size: int | None = None
    num_classes: int | None = None
    random_score: float | None = None

    def __post_init__(self) -> None:
        # Task-level messages name the field themselves (`task a: type must be one of ...`).
        if self.type not in TASK_TYPES:
            raise ConfigError("", f"type must be one of {', '.join(TASK_TYPES)}; got {self.type!r}")
        if self.scored is None:
            object.__setattr__(self, "scored", self.main_metric is not None)
        if self.scored and self.main_metric is None:
            raise ConfigError("", "a scored task needs a main_metric")
        if self.folder is not None and self.folders is not None:
            raise ConfigError("", "give `folder` or `folders`, not both")
        if self.type == "multi_objective_classification" and self.metadata is None:
            raise ConfigError(
                "", "multi_objective_classification needs `metadata` (its labels live in the .npy)"
            )


@dataclass(frozen=True)
class _SuiteFile:
    tasks: list[Any]
    suite: str | None = None  # default: the file's stem
    description: str = ""
    average: str = "Average"
    aggregates: dict[str, str] | None = None  # group -> display name of its mean, in display order

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ConfigError("tasks", "must list at least one task")


def _parse_suite(raw: dict, path: Path) -> Suite:
    source = str(path)
    suite = build(_SuiteFile, raw, source=source)
    name = suite.suite or path.stem
    aggregates = suite.aggregates or {}
    tasks: list[TaskSpec] = []
    for i, entry in enumerate(suite.tasks):
        label = entry.get("key", f"#{i}") if isinstance(entry, dict) else f"#{i}"
        task = build(_Task, entry, f"task {label}", source=source)
        tasks.append(
            TaskSpec(
                key=task.key,
                name=task.name,
                type=task.type,
                main_metric=task.main_metric,
                group=task.group,
                scored=task.scored,
                folders=task.folders or (task.folder or default_folder(task.key),),
                suite=name,
                suite_file=source,
                size=task.size,
                num_classes=task.num_classes,
                random_score=task.random_score,
                metadata_fields=task.metadata.fields if task.metadata else None,
                evaluator=task.metadata.evaluator if task.metadata else None,
            )
        )
    keys = [t.key for t in tasks]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        raise ConfigError("tasks", f"duplicate task keys: {', '.join(dupes)}", source)
    unknown_groups = sorted(set(aggregates) - {t.group for t in tasks})
    if unknown_groups:
        raise ConfigError("aggregates", f"names groups that no task has: {', '.join(unknown_groups)}", source)
    return Suite(
        name=name,
        description=suite.description,
        average_name=suite.average,
        aggregates=aggregates,
        tasks=tuple(tasks),
        path=path,
    )


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
            "",
            f"unknown task(s): {'; '.join(hints)}. Use `all`, a suite ({', '.join(sorted(names))}) or "
            "task keys such as imagenet1k,vtab/cifar100,synth/shape",
        )
    if not chosen:
        raise TaskConfigError("", "no tasks selected; pass --tasks all, synthetic or a list of task keys")
    return chosen
