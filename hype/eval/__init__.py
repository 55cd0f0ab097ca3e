"""The DataComp zero-shot benchmark (and the synthetic world's) for models of every geometry.

Module map: `tasks` the task registry (configs/eval/*.yaml), `readers` evaluation sets on disk,
`zeroshot` geometry-aware classification / retrieval / WinoGAViL scoring, `metrics` DataComp's metric
definitions, `results` the eval_results.jsonl file, `report` aggregates and the summary table, `runner`
the orchestration (`run_eval`), `compare` paired comparisons of rules over seeds. CLI: `hype eval`.
"""

from __future__ import annotations

import importlib
from typing import Any

# Resolved on first use: `hype submit` reads the task list and the aggregates, and importing this package
# must not pull the runner (torch, the models) into it.
_EXPORTS = {
    "EvalError": "hype.eval.runner",
    "RunOptions": "hype.eval.runner",
    "run_eval": "hype.eval.runner",
    "TaskConfigError": "hype.eval.tasks",
    "TaskSpec": "hype.eval.tasks",
    "load_suite": "hype.eval.tasks",
    "select_tasks": "hype.eval.tasks",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hype.eval' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
