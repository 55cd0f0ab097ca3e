"""Chains of `hype` commands run as child processes: what `hype demo` and `bench/quality.py` are made of.

Each step runs the same command a user would type (echoed before it runs), so the demo doubles as a
worked example. A step whose output already exists is skipped, so an interrupted chain resumes; the
commands themselves resume too (training from its last checkpoint, scoring from its finished shards).
Child stdout goes to a per-step log; stderr (progress bars, warnings, errors) goes to the terminal.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from hype.data.uids import array_to_uids, load_subset


class StepError(RuntimeError):
    """A `hype` command failed; the message names the step, the command and its log."""


def fmt_seconds(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s" if s >= 60 else f"{s:.1f}s"


@dataclass
class Runner:
    """Runs `hype` subcommands in child processes, logging each to `logs/NN-name.log`."""

    logs: Path
    progress: bool = True
    echo: bool = True
    timings: dict[str, float] = field(default_factory=dict)

    def hype(self, name: str, *args: str) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{len(self.timings) + 1:02d}-{name}.log"
        cmd = [sys.executable, "-m", "hype.cli", *args]
        if self.echo:
            print("$ hype " + shlex.join(args), flush=True)
        t0 = time.perf_counter()
        with open(log, "w") as out:
            err = None if self.progress else subprocess.STDOUT
            proc = subprocess.run(cmd, stdout=out, stderr=err, check=False)
        self.timings[name] = time.perf_counter() - t0
        if proc.returncode != 0:
            tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
            raise StepError(
                f"step {name!r} failed (exit {proc.returncode}): hype {shlex.join(args)}\nlog: {log}\n{tail}"
            )
        if self.echo:
            print(f"  done in {fmt_seconds(self.timings[name])}  (log: {log})", flush=True)

    def skip(self, name: str, why: str) -> None:
        self.timings[name] = 0.0
        if self.echo:
            print(f"= {name}: {why}, skipped", flush=True)


def train_args(
    preset: str, data: Path, out: Path, *, subset: Path | None = None, overrides: Sequence[str] = ()
) -> list[str]:
    args = ["train", "--config", preset, "--data", str(data), "--out", str(out)]
    if subset is not None:
        args += ["--subset", str(subset)]
    return [*args, "--no-progress", *overrides]


def select_args(scores: Path, frac: float, out: Path, rule: Sequence[str]) -> list[str]:
    return ["select", "--scores", str(scores), "--frac", str(frac), "--out", str(out), *rule]


def eval_args(model: Path, world: Path, out: Path) -> list[str]:
    what = ["--model", str(model), "--data-dir", str(world), "--tasks", "synthetic"]
    return ["eval", *what, "--out", str(out)]


def read_eval(path: Path) -> dict[str, float]:
    """{task key: main metric} from a `hype eval` results file (DataComp's jsonl)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["key"]: float(r["metrics"]["main_metric"]) for r in rows}


def average(metrics: dict[str, float]) -> float:
    """DataComp's headline number: the unweighted mean of the tasks' main metrics."""
    return float(np.mean(list(metrics.values()))) if metrics else float("nan")


def subset_composition(subset: Path, truth: Path) -> dict[str, float]:
    """Share of each noise kind of the synthetic world among the subset's samples (from truth.parquet)."""
    table = pq.read_table(truth, columns=["uid", "noise"]).to_pandas()
    chosen = set(array_to_uids(load_subset(subset)))
    kept = table["uid"].isin(chosen).to_numpy()
    counts = table.loc[kept, "noise"].value_counts()
    total = int(kept.sum())
    return {str(k): float(v) / total for k, v in counts.items()} if total else {}


def format_table(rows: list[dict], tasks: Sequence[str]) -> str:
    """A fixed-width text table: one row per arm, its size, clean share, the average and every task."""
    spread = any(r.get("average_std") is not None for r in rows)
    width = 14 if spread else 11  # "0.289±0.045" needs 11 characters plus a gap
    short = [t.split("/")[-1] for t in tasks]
    head = f"{'subset':<18}{'samples':>8}{'clean':>7}" + "".join(f"{s:>{width}}" for s in ["average", *short])
    lines = [head, "-" * len(head)]
    for r in rows:
        clean = "" if r.get("clean") is None else f"{r['clean']:.2f}"
        cells = [f"{r['name']:<18}", f"{r['samples']:>8,}", f"{clean:>7}"]
        cells.append(_cell(r["average"], r.get("average_std"), width))
        for t in tasks:
            cells.append(_cell(r["metrics"].get(t, float("nan")), (r.get("metrics_std") or {}).get(t), width))
        lines.append("".join(cells))
    return "\n".join(lines)


def _cell(value: float, std: float | None, width: int) -> str:
    text = f"{value:.3f}" if std is None else f"{value:.3f}±{std:.3f}"
    return f"{text:>{width}}"
