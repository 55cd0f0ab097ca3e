"""The DataComp zero-shot benchmark (and the synthetic world's) for models of every geometry.

Module map: `tasks` the task registry (configs/eval/*.yaml), `readers` evaluation sets on disk,
`zeroshot` geometry-aware classification / retrieval / WinoGAViL scoring, `metrics` DataComp's metric
definitions, `results` the eval_results.jsonl file, `report` aggregates and the summary table, `runner`
the orchestration (`run_eval`). CLI: `hype eval`.
"""

from hype.eval.runner import EvalError, RunOptions, run_eval
from hype.eval.tasks import TaskConfigError, TaskSpec, load_suite, select_tasks

__all__ = ["EvalError", "RunOptions", "TaskConfigError", "TaskSpec", "load_suite", "run_eval", "select_tasks"]
