"""Benchmark: `hype plan`'s estimate against the wall time of the `hype score` run it plans.

Runs `hype plan --json ARGS` and then `hype score ARGS --out OUT` (a fresh folder), each as its own
process, back to back on the same machine (and so under about the same load), and prints per stage the
estimate next to what the run's summary.json measured, the totals and their ratio (target: within ±25%),
and a RESULTS line. The score run is timed from its process start to its exit: what a user waits.

    python bench/plan_accuracy.py --name demo --out /tmp/run -- --pool DEMO/pool \\
        --meru DEMO/meru/model.safetensors --clip DEMO/clip/model.safetensors \\
        --class-images DEMO/world/eval/reference/train --config tiny --num-clusters 48 \\
        reference.n_top=1000 reference.m=1000 --executor ray
    (DEMO: a `hype run demo out=DEMO --until score` folder; on a GPU node add --device cuda)

`--plan-only` makes the plan alone; `--measured-wall S` compares a new plan with the run already in --out
(its summary.json) that took S seconds, instead of scoring again.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

HYPE = [sys.executable, "-c", "from hype.cli import main; main()"]


def run_plan(args: list[str], probe_samples: int | None) -> tuple[dict, float]:
    extra = ["--probe-samples", str(probe_samples)] if probe_samples else []
    t0 = time.perf_counter()
    out = subprocess.run(
        [*HYPE, "plan", *args, *extra, "--json"], capture_output=True, text=True, check=False
    )
    seconds = time.perf_counter() - t0
    if out.returncode:
        sys.exit(f"hype plan failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout), seconds


def run_score(args: list[str], out: Path) -> tuple[dict, float]:
    if out.exists():
        shutil.rmtree(out)
    t0 = time.perf_counter()
    res = subprocess.run([*HYPE, "score", *args, "--out", str(out), "--no-progress"], check=False)
    seconds = time.perf_counter() - t0
    if res.returncode:
        sys.exit(f"hype score failed (exit {res.returncode})")
    return json.loads((out / "summary.json").read_text()), seconds


def compare(plan: dict, summary: dict, wall: float) -> dict:
    est: dict[str, float] = {}
    for r in plan["stages"]:
        key = r["run_stage"]  # the summary stage the row estimates
        est[key] = est.get(key, 0.0) + r["estimate_s"]
    measured = {k: float(v.get("seconds", 0.0)) for k, v in summary["stages"].items()}
    measured["other"] = wall - sum(measured.values())
    rows = {
        k: {"estimate_s": round(est.get(k, 0.0), 1), "measured_s": round(measured.get(k, 0.0), 1)}
        for k in sorted(set(est) | set(measured))
    }
    total = plan["total"]["seconds"]
    worst = max(rows, key=lambda k: abs(rows[k]["estimate_s"] - rows[k]["measured_s"]))
    return {
        "estimate_s": total,
        "measured_s": round(wall, 1),
        "ratio": round(total / wall, 3),
        "within_25pct": abs(total / wall - 1) <= 0.25,
        "largest_error": worst,
        "stages": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="run")
    ap.add_argument("--out", type=Path, required=True, help="the score run's folder (replaced)")
    ap.add_argument("--probe-samples", type=int)
    ap.add_argument("--plan-only", action="store_true")
    ap.add_argument("--plan-json", type=Path, help="a plan already made (skips hype plan)")
    ap.add_argument("--measured-wall", type=float, help="the wall time of the run already in --out")
    ap.add_argument("score_args", nargs=argparse.REMAINDER, help="-- then hype score's arguments, no --out")
    a = ap.parse_args()
    args = a.score_args[1:] if a.score_args[:1] == ["--"] else a.score_args
    if a.plan_json:
        plan, plan_s = json.loads(a.plan_json.read_text()), 0.0
    else:
        plan, plan_s = run_plan([*args, "--out", str(a.out)], a.probe_samples)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        (a.out.parent / f"{a.name}.plan.json").write_text(json.dumps(plan, indent=2))
    print(f"plan ({plan_s:.1f} s): {plan['total']['seconds']:.1f} s estimated", flush=True)
    if a.plan_only:
        return
    loads = {"plan_end": os.getloadavg()}
    if a.measured_wall:
        summary, wall = json.loads((a.out / "summary.json").read_text()), a.measured_wall
    else:
        summary, wall = run_score(args, a.out)
        loads["run_end"] = os.getloadavg()
        (a.out.parent / f"{a.name}.measured.json").write_text(json.dumps({"wall_s": wall}))
    result = compare(plan, summary, wall) | {"plan_s": round(plan_s, 1), "name": a.name}
    result["load_average_1_5_15"] = {k: [round(x, 1) for x in v] for k, v in loads.items()}
    result["probe_load"] = plan["probe"].get("load")
    print(json.dumps(result, indent=2))
    date = datetime.now(UTC).strftime("%Y-%m-%d")
    print(
        f"RESULTS: plan accuracy {a.name}: {plan['pool']['samples']:,} samples, {plan['device']}, "
        f"{plan['executor']['kind']} x{plan['executor']['workers']}: estimate {result['estimate_s']:.0f} s, "
        f"measured {result['measured_s']:.0f} s, ratio {result['ratio']:.2f} "
        f"({'within' if result['within_25pct'] else 'outside'} ±25%; largest stage error: "
        f"{result['largest_error']}); probe {plan['probe']['samples']} samples, plan took {plan_s:.0f} s; "
        f"load average (1 min) {_loads(result)} "
        f"({platform.node()}, {date})"
    )


def _loads(result: dict) -> str:
    probe = result.get("probe_load") or {}
    seen = [probe.get("start"), probe.get("end"), *(v[0] for v in result["load_average_1_5_15"].values())]
    return "–".join(f"{x:.1f}" for x in seen if x is not None)


if __name__ == "__main__":
    main()
