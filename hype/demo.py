"""`hype demo`: the whole product on the synthetic world, offline, in minutes on a laptop CPU.

The demo is the workflow configs/workflows/demo.yaml (`hype run demo`): generate the world -> serve its
pool on loopback -> `hype download` it -> train tiny MERU and CLIP scorers on the clean set -> `hype score`
on a local Ray cluster -> `hype select` HYPE, CLIP-score and random subsets of the same size -> train a
tiny CLIP on each at equal samples seen -> `hype eval` -> `hype report` -> a results table (results.md /
results.json in the output folder). `hype demo`'s options are that file's variables.

Every step is a `hype` command (echoed as it runs); a rerun skips finished steps.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from hype.workflow import fmt_seconds, load_workflow

WORKFLOW = "demo"  # configs/workflows/demo.yaml


@dataclass
class DemoConfig:
    out: Path
    size: int = 2000  # pool samples
    clean_size: int = 2000  # clean set the scorers train on
    eval_size: int = 500  # images per synthetic evaluation task
    seed: int = 0
    frac: float = 0.2
    scorer_samples: int = 6400  # samples seen by each scorer (tiny MERU, tiny CLIP)
    subset_samples: int = 4800  # samples seen by each subset's tiny CLIP (equal for every arm)
    num_clusters: int = 48  # k-means K for c_IN (see demo.yaml)
    executor: str = "ray"
    progress: bool = True

    def check(self) -> None:
        if self.size < 200:
            raise ValueError(f"--size must be at least 200 (got {self.size}): the subsets would be empty")
        if not 0 < self.frac <= 1:
            raise ValueError(f"--frac must be in (0, 1], got {self.frac}")
        for name in ("clean_size", "eval_size", "scorer_samples", "subset_samples", "num_clusters"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name.replace('_', '-')} must be positive, got {getattr(self, name)}")

    def overrides(self) -> list[str]:
        """The workflow's `key=value` overrides for these settings."""
        names = ("size", "clean_size", "eval_size", "seed", "frac", "scorer_samples", "subset_samples")
        values = [f"{n}={getattr(self, n)}" for n in (*names, "num_clusters")]
        # Reference sets half the pool (demo.yaml says why).
        return [f"out={self.out}", *values, f"references={max(1, self.size // 2)}"]


def run_demo(cfg: DemoConfig) -> dict:
    """Run (or resume) the demo in `cfg.out`; returns the results (written to results.json) with the
    printed table, the elapsed time and each step's seconds."""
    cfg.check()
    wf = load_workflow(WORKFLOW, cfg.overrides())
    t0 = time.perf_counter()
    outcomes = wf.run(executor=cfg.executor, progress=cfg.progress)
    result = json.loads((wf.out / "results.json").read_text())
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)
    result["step_seconds"] = {o.name: round(o.seconds, 1) for o in outcomes}
    result["results"] = str(wf.out / "results.md")
    return result


def summary_text(result: dict) -> str:
    return (
        f"{result['table']}\n\n"
        f"clean = share of the subset that is clean in the world's truth table (the rest is noise).\n"
        f"report   {result['report']}\n"
        f"results  {result['results']} (and results.json)\n"
        f"time     {fmt_seconds(result['elapsed_s'])}"
    )
