"""`hype demo`: the whole product on the synthetic world, offline, in minutes on a laptop CPU.

generate the world -> serve its pool on loopback -> `hype download` it -> train tiny MERU and CLIP scorers
on the clean set -> `hype score` on a local Ray cluster -> `hype select` HYPE, CLIP-score and random
subsets of the same size -> train a tiny CLIP on each at equal samples seen -> `hype eval` -> `hype report`
-> a results table (results.md / results.json in the output folder).

Every step is a `hype` command (echoed as it runs); a rerun skips finished steps.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hype.data.uids import load_subset
from hype.workflow import (
    Runner,
    StepError,
    average,
    eval_args,
    fmt_seconds,
    format_table,
    read_eval,
    select_args,
    subset_composition,
    train_args,
)

# name -> `hype select` arguments (besides --scores/--frac/--out): the three arms the demo compares.
ARMS: dict[str, list[str]] = {
    "hype": ["--preset", "hype"],
    "clip-score": ["--preset", "cos-only"],
    "random": ["--preset", "random"],
}


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
    # k-means K for c_IN: DataComp's ~128 samples per centroid would flag most of a tiny pool.
    num_clusters: int = 48  # faiss wants >= 39 points per centroid: 2,000 / 39
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


def run_demo(cfg: DemoConfig) -> dict:
    """Run (or resume) the demo in `cfg.out`; returns the results (also written to results.json)."""
    cfg.check()
    out = cfg.out.resolve()
    world, pool, models = out / "world", out / "pool", out / "models"
    run = Runner(out / "logs", progress=cfg.progress)
    t0 = time.perf_counter()

    _world_and_pool(run, cfg, world, pool)

    scorers = {"meru": "tiny-hyperbolic-scorer", "clip": "tiny-clip"}
    for name, preset in scorers.items():
        if (models / name / "model.safetensors").is_file():
            run.skip(f"train-{name}", "model exists")
            continue
        overrides = [f"samples_seen={cfg.scorer_samples}", f"seed={cfg.seed}"]
        run.hype(
            f"train-{name}",
            *train_args(preset, world / "clean" / "shards", models / name, overrides=overrides),
        )

    score = out / "score"
    # Reference sets half the pool: with N = M >= the pool, mean ε_t equals mean ε_i by construction and
    # HYPE Table 1's "ε_t < ε_i" would say nothing (DESIGN §2.3).
    refs = max(1, cfg.size // 2)
    run.hype(
        "score",
        "score", "--pool", str(pool), "--meru", str(models / "meru" / "model.safetensors"),
        "--clip", str(models / "clip" / "model.safetensors"),
        "--class-images", str(world / "eval" / "reference" / "train"),
        "--out", str(score), "--config", "tiny", "--executor", cfg.executor,
        "--num-clusters", str(cfg.num_clusters), "--no-progress",
        f"reference.n_top={refs}", f"reference.m={refs}",
    )  # fmt: skip

    rows = []
    for arm, select in ARMS.items():
        subset = out / "subsets" / f"{arm}.npy"
        if not subset.is_file():
            subset.parent.mkdir(parents=True, exist_ok=True)
            run.hype(f"select-{arm}", *select_args(score, cfg.frac, subset, select))
        model = out / "train" / arm / "model.safetensors"
        if not model.is_file():
            overrides = [f"samples_seen={cfg.subset_samples}", f"seed={cfg.seed}"]
            run.hype(
                f"train-{arm}",
                *train_args("tiny-clip", pool, model.parent, subset=subset, overrides=overrides),
            )
        results = out / "eval" / f"{arm}.jsonl"
        if not _complete(results):
            results.parent.mkdir(parents=True, exist_ok=True)
            run.hype(f"eval-{arm}", *eval_args(model, world, results), "--no-progress")
        metrics = read_eval(results)
        comp = subset_composition(subset, world / "truth.parquet")
        samples = len(load_subset(subset))
        rows.append(
            {"name": arm, "samples": samples, "clean": comp.get("clean", 0.0), "composition": comp,
             "average": average(metrics), "metrics": metrics}
        )  # fmt: skip

    report = out / "report.html"
    run.hype("report", "report", "--scores", str(score), "--subset", str(out / "subsets" / "hype.npy"),
             "--out", str(report), "--no-progress")  # fmt: skip

    tasks = sorted(rows[0]["metrics"])
    table = format_table(rows, tasks)
    elapsed = time.perf_counter() - t0
    result = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "rows": rows,
        "report": str(report),
        "elapsed_s": round(elapsed, 1),
        "step_seconds": {k: round(v, 1) for k, v in run.timings.items()},
    }
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "results.md").write_text(_markdown(rows, tasks, cfg))
    result["table"] = table
    return result


def _world_and_pool(run: Runner, cfg: DemoConfig, world: Path, pool: Path) -> None:
    """The world, and its pool downloaded over HTTP from a loopback server as a real pool would be."""
    from hype.synth.serve import serve_directory

    if (world / "world.json").is_file() and _downloaded(pool):
        run.skip("synth", "world exists")
        run.skip("download", "pool downloaded")
        return
    # The urls name the server's port, so the world is generated after the server is up; a partial
    # download from an earlier server is discarded.
    shutil.rmtree(pool, ignore_errors=True)
    with serve_directory(world / "pool") as base_url:
        run.hype(
            "synth",
            "synth", "--out", str(world), "--size", str(cfg.size), "--clean-size", str(cfg.clean_size),
            "--eval-size", str(cfg.eval_size), "--seed", str(cfg.seed), "--base-url", base_url,
            "--overwrite", "--no-progress",
        )  # fmt: skip
        run.hype(
            "download",
            "download", "--metadata", str(world / "pool" / "metadata"), "--out", str(pool),
            # Small shards so that scoring has several units of work; few processes on a laptop.
            "--samples-per-shard", "256", "--processes", "2", "--threads", "16",
            "--allow-private-network",  # the demo's server is on 127.0.0.1 on purpose
        )  # fmt: skip
    if not _downloaded(pool):
        raise StepError(
            f"hype download left shards to retry in {pool}; see {pool / '_hype' / 'summary.json'}"
        )


def _downloaded(pool: Path) -> bool:
    summary = pool / "_hype" / "summary.json"  # written by `hype download` at the end
    return summary.is_file() and json.loads(summary.read_text()).get("status") == "complete"


def _complete(results: Path) -> bool:
    return results.is_file() and bool(results.read_text().strip())


def _markdown(rows: list[dict], tasks: list[str], cfg: DemoConfig) -> str:
    head = (
        "| subset | samples | clean share | average | " + " | ".join(t.split("/")[-1] for t in tasks) + " |"
    )
    lines = [
        f"Tiny CLIP trained on {cfg.frac:.0%} subsets of a {cfg.size:,}-sample synthetic pool, "
        f"{cfg.subset_samples:,} samples seen each (seed {cfg.seed}); zero-shot on the synthetic tasks.",
        "",
        head,
        "|" + "---|" * (4 + len(tasks)),
    ]
    for r in rows:
        cells = [r["name"], f"{r['samples']:,}", f"{r['clean']:.2f}", f"{r['average']:.3f}"]
        cells += [f"{r['metrics'].get(t, float('nan')):.3f}" for t in tasks]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summary_text(result: dict) -> str:
    return (
        f"{result['table']}\n\n"
        f"clean = share of the subset that is clean in the world's truth table (the rest is noise).\n"
        f"report   {result['report']}\n"
        f"results  {Path(result['report']).parent / 'results.md'} (and results.json)\n"
        f"time     {fmt_seconds(result['elapsed_s'])}"
    )
