"""Quality benchmark: does a HYPE subset train a better CLIP than the baselines, at equal samples seen?

On the synthetic world (DESIGN §5):
1. a world (`hype synth --size 4000 --clean-size 4000`), unless --world is given;
2. tiny MERU and tiny CLIP scorers trained on its clean set (`hype train`), `hype score` on the pool;
3. the detection AUROC of every HYPE term for every noise kind (`hype.scoring.quality`);
4. `hype select --frac 0.2` for each arm: HYPE, the paper's ablations (cos θ only = CLIP score,
   specificity only, each with and without c_IN, HYPE without c_IN) and random; plus the whole pool;
5. a tiny CLIP trained on each arm for every seed at the same samples seen, `hype eval` on the synthetic
   tasks; mean ± std over seeds of the average and of each task.

    python bench/quality.py [--out runs/bench-quality] [--seeds 0,1,2] [--samples-seen 4800]
        [--arms hype,clip-score,random,pool] [--world DIR]

Prints the tables and writes OUT/quality.json and OUT/quality.md. Every step is a `hype` command; a
rerun reuses finished steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _drop_script_dir_from_path() -> None:
    # bench/ holds scripts, not modules: keep their names from shadowing standard library modules.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]


_drop_script_dir_from_path()

import numpy as np  # noqa: E402

# arm -> `hype select` arguments; None = the whole pool (no subset).
ARMS: dict[str, list[str] | None] = {
    "hype": ["--preset", "hype"],
    "hype-no-c_in": ["--preset", "no-c-in"],
    "clip-score": ["--preset", "cos-only"],
    "clip-score+c_in": ["--weights", "cos_theta=1,c_in=1"],
    "specificity": ["--preset", "specificity-only"],
    "specificity+c_in": ["--weights", "eps_i=1,eps_t=1,c_in=1"],
    "random": ["--preset", "random"],
    "pool": None,
}


def main() -> None:
    from hype.data.uids import load_subset
    from hype.workflow import (
        Runner,
        average,
        eval_args,
        format_table,
        read_eval,
        select_args,
        subset_composition,
        train_args,
    )

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/bench-quality"))
    p.add_argument("--world", type=Path, help="an existing world [default: OUT/world, generated]")
    p.add_argument("--size", type=int, default=4000)
    p.add_argument("--clean-size", type=int, default=4000)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--frac", type=float, default=0.2)
    p.add_argument("--samples-seen", type=int, default=4800, help="per arm and seed (equal for all arms)")
    p.add_argument("--scorer-samples", type=int, default=9600)
    p.add_argument("--num-clusters", type=int, default=64)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--progress", action="store_true", help="show the commands' progress bars")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        p.error(f"unknown arms {unknown}; known: {', '.join(ARMS)}")

    out = args.out.resolve()
    world = (args.world or out / "world").resolve()
    run = Runner(out / "logs", progress=args.progress)
    t0 = time.perf_counter()
    if not (world / "world.json").is_file():
        run.hype("synth", "synth", "--out", str(world), "--size", str(args.size),
                 "--clean-size", str(args.clean_size), "--no-progress")  # fmt: skip
    pool = world / "pool" / "shards"
    models = out / "scorers"
    for name, preset in (("meru", "tiny-hyperbolic"), ("clip", "tiny-clip")):
        if not (models / name / "model.safetensors").is_file():
            ov = [f"samples_seen={args.scorer_samples}"]
            run.hype(
                f"train-{name}", *train_args(preset, world / "clean" / "shards", models / name, overrides=ov)
            )
    score = out / "score"
    run.hype(
        "score",
        "score", "--pool", str(pool), "--meru", str(models / "meru" / "model.safetensors"),
        "--clip", str(models / "clip" / "model.safetensors"),
        "--class-images", str(world / "eval" / "reference" / "train"), "--out", str(score),
        "--config", "tiny", "--num-clusters", str(args.num_clusters), "--no-progress",
    )  # fmt: skip
    auroc = _auroc(score, world)

    rows = []
    for arm in arms:
        subset = None
        info = json.loads((world / "world.json").read_text())
        samples = info["counts"]["pool"]
        comp = {k: v / samples for k, v in info["noise_counts"].items()}
        if ARMS[arm] is not None:
            subset = out / "subsets" / f"{arm}.npy"
            if not subset.is_file():
                subset.parent.mkdir(parents=True, exist_ok=True)
                run.hype(f"select-{arm}", *select_args(score, args.frac, subset, ARMS[arm]))
            samples = len(load_subset(subset))
            comp = subset_composition(subset, world / "truth.parquet")
        per_seed = []
        for seed in seeds:
            model = out / "train" / f"{arm}-seed{seed}" / "model.safetensors"
            if not model.is_file():
                ov = [f"samples_seen={args.samples_seen}", f"seed={seed}"]
                run.hype(
                    f"train-{arm}-{seed}",
                    *train_args("tiny-clip", pool, model.parent, subset=subset, overrides=ov),
                )
            results = out / "eval" / f"{arm}-seed{seed}.jsonl"
            if not (results.is_file() and results.read_text().strip()):
                results.parent.mkdir(parents=True, exist_ok=True)
                run.hype(f"eval-{arm}-{seed}", *eval_args(model, world, results), "--no-progress")
            per_seed.append(read_eval(results))
        tasks = sorted(per_seed[0])
        mat = np.array([[m[t] for t in tasks] for m in per_seed])
        avgs = np.array([average(m) for m in per_seed])
        spread = len(seeds) > 1
        rows.append(
            {
                "name": arm,
                "samples": samples,
                "clean": comp.get("clean", 0.0),
                "composition": comp,
                "average": float(avgs.mean()),
                "average_std": float(avgs.std(ddof=1)) if spread else None,
                "metrics": dict(zip(tasks, mat.mean(0).tolist(), strict=True)),
                "metrics_std": dict(zip(tasks, mat.std(0, ddof=1).tolist(), strict=True)) if spread else None,
                "per_seed_average": avgs.tolist(),
            }
        )

    tasks = sorted(rows[0]["metrics"])
    table = format_table(rows, tasks)
    result = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "seeds": seeds,
        "rows": rows,
        "auroc": auroc,
        "elapsed_s": round(time.perf_counter() - t0, 1),
    }
    (out / "quality.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "quality.md").write_text(_markdown(rows, tasks, auroc, args, seeds))
    print(f"\nmean ± std over seeds {seeds}; {args.samples_seen:,} samples seen per run\n{table}\n")
    print(_auroc_text(auroc))
    print(f"\nwrote {out / 'quality.md'} and {out / 'quality.json'} ({result['elapsed_s'] / 60:.1f} min)")


def _auroc(score: Path, world: Path) -> dict:
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    from hype.scoring.quality import noise_auroc_table

    scores = ds.dataset(score / "scores", format="parquet").to_table().to_pandas()
    truth = pq.read_table(world / "truth.parquet", columns=["uid", "noise"]).to_pandas()
    df = scores.merge(truth, on="uid", how="inner")
    return {
        "table": noise_auroc_table(df),
        "mean_eps_t": float(df.eps_t.mean()),
        "mean_eps_i": float(df.eps_i.mean()),
        "c_in_share": float((df.c_in > 0).mean()),
    }


def _auroc_text(auroc: dict) -> str:
    table = auroc["table"]
    kinds = sorted({k for v in table.values() for k in v})
    lines = ["detection AUROC, clean vs each noise kind (1.0 = every clean sample scores higher)"]
    lines.append(f"{'metric':<12}" + "".join(f"{k:>22}" for k in kinds))
    for metric, row in table.items():
        lines.append(f"{metric:<12}" + "".join(f"{row.get(k, float('nan')):>22.3f}" for k in kinds))
    lines.append(
        f"mean eps_t {auroc['mean_eps_t']:.3f} vs mean eps_i {auroc['mean_eps_i']:.3f}; "
        f"c_IN = 10 for {auroc['c_in_share']:.1%} of the pool"
    )
    return "\n".join(lines)


def _markdown(rows: list[dict], tasks: list[str], auroc: dict, args, seeds: list[int]) -> str:
    def cell(v, s):
        return f"{v:.3f}" if s is None else f"{v:.3f} ± {s:.3f}"

    lines = [
        f"Tiny CLIP, {args.samples_seen:,} samples seen per run, seeds {seeds}, {args.frac:.0%} subsets; "
        "mean ± std over seeds.",
        "",
        "| arm | samples | clean share | average | " + " | ".join(t.split("/")[-1] for t in tasks) + " |",
        "|" + "---|" * (4 + len(tasks)),
    ]
    for r in rows:
        cells = [r["name"], f"{r['samples']:,}", f"{r['clean']:.2f}", cell(r["average"], r["average_std"])]
        cells += [cell(r["metrics"][t], (r["metrics_std"] or {}).get(t)) for t in tasks]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "```", _auroc_text(auroc), "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
