"""Benchmark: what the Ray executor adds to a `hype score` run on one machine, and where it goes.

The same `hype score` (a demo-sized pool, the demo's tiny scorers) twice, each a fresh process into a fresh
folder, back to back: `--executor local`, then `--executor ray` (a local Ray instance started by the run).
Per run it prints the wall time a user waits (process start to exit), the run's own time (summary.json),
the time before the run starts (imports, config, `ray.init`: timed in the child by wrapping the executor's
constructor) and each stage's time. Ray's extra is then split into the start of Ray, the first stage's pool
of actors (process start, imports, model loads: in the embed stage's time) and the rest, with the ratio
ray / local of the wall time.

    python bench/ray_startup.py --demo DEMO [--repeats 2]
    (DEMO: a `hype run demo out=DEMO --until clip` folder; the demo's default sizes or the tests' small ones)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The child: `hype score` in this process, with the executor's constructor timed (from the process start).
CHILD = """
import json, os, sys, time
t0 = time.monotonic()
from hype.cli import main
import hype.pipelines.ray_executor as R
marks = {"imports_done": time.monotonic() - t0}
init = R.RayExecutor.__init__
def timed(self, *a, **k):
    marks["executor_init_start"] = time.monotonic() - t0
    init(self, *a, **k)
    marks["executor_init_end"] = time.monotonic() - t0
R.RayExecutor.__init__ = timed
sys.argv = ["hype", *sys.argv[2:]]
try:
    main(standalone_mode=False)
finally:
    with open(os.environ["HYPE_BENCH_MARKS"], "w") as f:
        json.dump(marks, f)
"""


def score(demo: Path, out: Path, executor: str) -> dict:
    args = [
        "score", "--pool", str(demo / "pool"), "--meru", str(demo / "meru" / "model.safetensors"),
        "--clip", str(demo / "clip" / "model.safetensors"),
        "--class-images", str(demo / "world" / "eval" / "reference" / "train"), "--config", "tiny",
        "--out", str(out), "--executor", executor, "--no-progress",
    ]  # fmt: skip
    marks_file = out.with_suffix(".marks.json")
    env = {**os.environ, "HYPE_BENCH_MARKS": str(marks_file)}
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-c", CHILD, "--", *args], cwd=REPO, env=env, capture_output=True, text=True
    )
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"hype score --executor {executor} failed:\n{p.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    marks = json.loads(marks_file.read_text())
    stages = {name: s["seconds"] for name, s in summary["stages"].items()}
    first = "embed"  # the first stage a score run gives its executor: the one that starts Ray's actors
    return {
        "executor": executor,
        "wall_s": round(wall, 2),
        "run_s": summary["seconds"],
        "imports_s": round(marks["imports_done"], 2),
        "ray_init_s": round(marks["executor_init_end"] - marks["executor_init_start"], 2)
        if "executor_init_start" in marks
        else 0.0,
        "first_stage": first,
        "stages_s": stages,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", type=Path, required=True, help="a `hype run demo --until clip` folder")
    ap.add_argument("--repeats", type=int, default=1, help="pairs of runs (local, ray) back to back")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hype-ray-startup-"))
    runs = []
    try:
        for i in range(args.repeats):
            for executor in ("local", "ray"):
                r = score(args.demo, work / f"{executor}-{i}", executor)
                runs.append(r)
                print(
                    f"{executor:>5}: wall {r['wall_s']:6.1f} s  run {r['run_s']:6.1f} s  imports "
                    f"{r['imports_s']:4.1f} s  ray.init {r['ray_init_s']:4.1f} s  "
                    f"{r['first_stage']} {r['stages_s'][r['first_stage']]:5.1f} s  "
                    f"other stages {sum(r['stages_s'].values()) - r['stages_s'][r['first_stage']]:5.1f} s",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    local = [r for r in runs if r["executor"] == "local"]
    ray = [r for r in runs if r["executor"] == "ray"]

    def mean(rows: list[dict], key: str) -> float:
        return sum(r[key] for r in rows) / len(rows)

    def first_stage(rows: list[dict]) -> float:
        return sum(r["stages_s"][r["first_stage"]] for r in rows) / len(rows)

    extra = mean(ray, "wall_s") - mean(local, "wall_s")
    split = {
        "ray_init_s": mean(ray, "ray_init_s"),
        "first_stage_s": first_stage(ray) - first_stage(local),  # the actors' start, imports, model loads
    }
    split["other_s"] = extra - sum(split.values())
    result = {
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average": os.getloadavg(),
        "runs": runs,
        "ratio_wall_ray_over_local": round(mean(ray, "wall_s") / mean(local, "wall_s"), 2),
        "ray_extra_s": round(extra, 1),
        "ray_extra_split_s": {k: round(v, 1) for k, v in split.items()},
    }
    parts = ", ".join(f"{k[:-2]} {v:+.1f} s" for k, v in split.items())
    print(f"ray / local wall: {result['ratio_wall_ray_over_local']}x; Ray adds {extra:.1f} s: {parts}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
