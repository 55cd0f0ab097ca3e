"""`hype fit --proxy` on the quality benchmark's scored worlds: what the search chose, what it cost, and
(measured after the choice, never fed back) whether the proxy's ranking of the candidates holds on eval/.

For each `--run RUN` (a `bench/quality.py` output: RUN/world and RUN/score):
1. the world is made again beside OUT with the same arguments plus `--proxy-size` (the same arguments give
   the same bytes: its pool and eval files are compared with RUN/world's, a real-size check that the proxy
   set leaves the world as it was);
2. `hype fit --proxy OUT/wN/proxy` with the quality benchmark's recipe (tiny-clip, 4,800 samples seen,
   20% subsets), `--candidates` weightings, `--train-seeds`;
3. each candidate's trained model is evaluated on the world's eval/ tasks (only to measure), and the
   Spearman correlation of the proxy averages with the eval averages is reported.

    python bench/fit_proxy.py --run /work/runs/bq36-w0 --run /work/runs/bq36-w1 --out /tmp/fit-proxy

Writes OUT/fit_proxy.json and prints one line per world.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _drop_script_dir_from_path() -> None:
    # bench/ holds scripts, not modules: keep their names from shadowing standard library modules.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]


_drop_script_dir_from_path()

import numpy as np  # noqa: E402


def hype(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "hype.cli", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"hype {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout + done.stderr


def digests(root: Path, parts: tuple[str, ...]) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for part in parts
        for p in sorted((root / part).rglob("*"))
        if p.is_file()
    }


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = (np.argsort(np.argsort(x)).astype(float) for x in (a, b))
    return float(np.corrcoef(ra, rb)[0, 1]) if len(a) > 2 else float("nan")


def one_world(run: Path, out: Path, args) -> dict:
    info = json.loads((run / "world" / "world.json").read_text())
    a = info["args"]
    world = out / f"w{info['seed']}"
    t0 = time.perf_counter()
    hype(
        "synth", "--out", str(world), "--size", str(a["size"]), "--clean-size", str(a["clean_size"]),
        "--seed", str(info["seed"]), "--eval-size", str(a["eval_size"]),
        "--reference-per-class", str(a["reference_per_class"]), "--shard-size", str(a["shard_size"]),
        "--proxy-size", str(args.proxy_size), "--no-progress",
    )  # fmt: skip
    synth_s = time.perf_counter() - t0
    same = digests(world, ("pool", "eval")) == digests(run / "world", ("pool", "eval"))
    weights = out / f"w{info['seed']}-weights.json"
    t0 = time.perf_counter()
    log = hype(
        "fit", "--scores", str(run / "score"), "--proxy", str(world / "proxy"),
        "--data", str(world / "pool" / "shards"), "--out", str(weights), "--candidates", str(args.candidates),
        "--samples-seen", str(args.samples_seen), "--frac", str(args.frac), "--train-seeds", args.train_seeds,
    )  # fmt: skip
    search_s = time.perf_counter() - t0
    record = json.loads(weights.read_text())
    cands = record["data"]["candidates"]
    eval_avg = []
    for i, c in enumerate(cands):
        per_seed = []
        for s in record["data"]["train_seeds"]:
            model = Path(f"{weights}.proxy") / f"candidate-{i}" / f"train-{c['subset_sha256'][:16]}-seed{s}"
            results = model / "eval.jsonl"
            if not results.is_file():
                hype("eval", "--model", str(model / "model.safetensors"), "--data-dir", str(world),
                     "--tasks", "synthetic", "--out", str(results), "--no-progress")  # fmt: skip
            rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
            per_seed.append(float(np.mean([r["metrics"]["main_metric"] for r in rows])))
        eval_avg.append(float(np.mean(per_seed)))
    proxy_avg = [c["proxy_score"] for c in cands]
    return {
        "world_seed": info["seed"],
        "world_files_identical_to_run": same,
        "proxy": record["data"]["proxy"],
        "synth_s": round(synth_s, 1),
        "search_s": round(search_s, 1),
        "per_candidate_s": round(search_s / len(cands), 1),
        "chosen": record["fit"]["chosen"],
        "weights": {k: round(v, 3) for k, v in record["weights"].items()},
        "candidates": [
            {
                "weights": {k: round(v, 3) for k, v in c["weights"].items()},
                "proxy": round(p, 4),
                "eval": round(e, 4),
            }
            for c, p, e in zip(cands, proxy_avg, eval_avg, strict=True)
        ],
        "spearman_proxy_eval": spearman(proxy_avg, eval_avg),
        "eval_chosen_minus_eq1": round(eval_avg[record["fit"]["chosen"]] - eval_avg[0], 4),
        "progress": [line for line in log.splitlines() if line.startswith("candidate ")],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, action="append", required=True, help="a bench/quality.py output")
    p.add_argument("--out", type=Path, default=Path("runs/bench-fit-proxy"))
    p.add_argument("--proxy-size", type=int, default=200)
    p.add_argument("--candidates", type=int, default=4)
    p.add_argument("--samples-seen", type=int, default=4800)
    p.add_argument("--frac", type=float, default=0.2)
    p.add_argument("--train-seeds", default="0")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for run in args.run:
        rows.append(one_world(run.resolve(), args.out.resolve(), args))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "progress"}), flush=True)
    (args.out / "fit_proxy.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
