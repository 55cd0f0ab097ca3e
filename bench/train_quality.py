"""Quality of the CPU-tiny training presets on the synthetic world (what `hype train` buys you).

1. Generates a fresh world (default: `hype synth --size 4000 --clean-size 8000`) unless --world exists.
2. Trains each preset (default tiny-hyperbolic = MERU and tiny-clip) on `WORLD/clean/shards` with
   `hype train` (the preset's own schedule: 9.6k samples seen, batch 64).
3. Runs `hype eval --tasks synthetic` on every trained model and on a randomly initialized one
   (empirical chance), next to the analytic chance 1/#classes.
4. MERU Fig. 4 check for hyperbolic models: mean geodesic distance from the origin, |log_0(x)|, of text vs
   image embeddings on held-out pairs (clean samples of the pool, never trained on).

    .venv/bin/python -P bench/train_quality.py [--world /tmp/qworld] [--out runs/quality]

Prints the table and writes OUT/quality.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import torch

REPO = Path(__file__).resolve().parents[1]
HYPE = [sys.executable, "-c", "from hype.cli import main; main()"]


def ensure_world(world: Path, size: int, clean_size: int) -> None:
    if (world / "world.json").is_file():
        return
    cmd = [*HYPE, "synth", "--out", str(world), "--size", str(size), "--clean-size", str(clean_size)]
    subprocess.run(cmd, check=True, cwd=REPO)


def train(preset: str, world: Path, out: Path, overrides: list[str]) -> dict:
    cmd = [*HYPE, "train", "--config", preset, "--data", str(world / "clean" / "shards"), "--out", str(out)]
    subprocess.run([*cmd, *overrides], check=True, cwd=REPO)
    return json.loads((out / "summary.json").read_text())


def evaluate(world: Path, results: Path, *, model: Path | None = None, config: str | None = None) -> dict:
    what = ["--model", str(model)] if model is not None else ["--model-config", str(config)]
    cmd = [*HYPE, "eval", *what, "--data-dir", str(world), "--tasks", "synthetic", "--out", str(results)]
    subprocess.run([*cmd, "--no-progress", "--workers", "1"], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    return {r["key"]: r["metrics"]["main_metric"] for r in rows}


def analytic_chance(world: Path) -> dict[str, float | None]:
    out = {}
    for folder in sorted((world / "eval").glob("wds_*_test")):
        key = folder.name[len("wds_") : -len("_test")].replace("-", "/", 1)  # DataComp: "/" -> "-" on disk
        names = folder / "classnames.txt"
        n = len([x for x in names.read_text().splitlines() if x.strip()]) if names.is_file() else 0
        out[key] = 1.0 / n if n else None
    return out


def held_out_pairs(world: Path, n: int) -> list[tuple]:
    """Clean pool samples (never in the clean training set): (PIL image, caption)."""
    from hype.data.samples import SkipStats, decode_pair, iter_tar_samples, sample_uid

    truth = pq.read_table(world / "truth.parquet", columns=["uid", "noise"]).to_pydict()
    clean = {u for u, k in zip(truth["uid"], truth["noise"], strict=True) if k == "clean"}
    pairs, stats = [], SkipStats()
    for shard in sorted((world / "pool" / "shards").glob("*.tar")):
        for sample in iter_tar_samples(str(shard), stats):
            if sample_uid(sample, stats) in clean:
                pair = decode_pair(sample, stats)
                if pair is not None and pair[1]:
                    pairs.append(pair)
            if len(pairs) >= n:
                return pairs
    return pairs


@torch.no_grad()
def origin_distances(model_path: Path, pairs: list[tuple]) -> dict:
    from hype.checkpoint import load_checkpoint
    from hype.geometry import lorentz

    model = load_checkpoint(model_path)
    if not model.geometry.uses_curvature:
        return {}
    prep, tok = model.preprocess(train=False), model.tokenizer()
    img, txt = [], []
    for i in range(0, len(pairs), 64):
        chunk = pairs[i : i + 64]
        img.append(model.encode_image(torch.stack([prep(p[0]) for p in chunk])))
        txt.append(model.encode_text(tok([p[1] for p in chunk])))
    curv = model.curv
    d_img = lorentz.log_map0(torch.cat(img), curv).norm(dim=-1)
    d_txt = lorentz.log_map0(torch.cat(txt), curv).norm(dim=-1)
    return {
        "pairs": len(pairs),
        "curvature": float(curv),
        "image_mean_distance": float(d_img.mean()),
        "text_mean_distance": float(d_txt.mean()),
        "text_closer_fraction": float((d_txt < d_img).float().mean()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=Path, default=Path("/tmp/qworld"))
    p.add_argument("--size", type=int, default=4000)
    p.add_argument("--clean-size", type=int, default=8000)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "quality")
    p.add_argument("--presets", nargs="+", default=["tiny-hyperbolic", "tiny-clip"])
    p.add_argument("--held-out", type=int, default=512)
    p.add_argument("overrides", nargs="*", help="key=value overrides for every training run")
    args = p.parse_args()

    ensure_world(args.world, args.size, args.clean_size)
    args.out.mkdir(parents=True, exist_ok=True)
    chance = analytic_chance(args.world)
    report: dict = {"world": str(args.world), "chance": chance, "runs": {}}
    pairs = held_out_pairs(args.world, args.held_out)
    for preset in args.presets:
        out = args.out / preset
        summary = train(preset, args.world, out, args.overrides)
        random_eval = out / "eval_random_init.jsonl"
        random_eval.unlink(missing_ok=True)
        report["runs"][preset] = {
            "train": {
                k: summary[k]
                for k in ("step", "samples_seen", "train_time_total_s", "steady_samples_per_s", "final")
            },
            "eval": evaluate(args.world, out / "eval.jsonl", model=out / "model.safetensors"),
            "eval_random_init": evaluate(args.world, random_eval, config=preset),
            "origin_distance": origin_distances(out / "model.safetensors", pairs),
        }
    (args.out / "quality.json").write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)


def print_table(report: dict) -> None:
    runs = report["runs"]
    tasks = sorted({k for r in runs.values() for k in r["eval"]})
    head = f"{'task':<24}{'chance':>8}" + "".join(f"{p + ' (rand)':>26}{p:>20}" for p in runs)
    print("\nzero-shot main metric on the synthetic tasks (held-out eval sets)")
    print(head)
    for t in tasks:
        c = report["chance"].get(t)
        row = f"{t:<24}{(f'{c:.3f}' if c else '-'):>8}"
        for r in runs.values():
            row += (
                f"{r['eval_random_init'].get(t, float('nan')):>26.3f}{r['eval'].get(t, float('nan')):>20.3f}"
            )
        print(row)
    for name, r in runs.items():
        tr = r["train"]
        loss = tr["final"].get("loss", float("nan"))
        minutes = tr["train_time_total_s"] / 60
        print(f"\n{name}: {tr['step']} steps, {tr['samples_seen']} samples in {minutes:.1f} min")
        print(f"  {tr['steady_samples_per_s']:.1f} samples/s (steady state); final loss {loss:.3f}")
        d = r["origin_distance"]
        if d:
            print(
                f"  distance from the origin on {d['pairs']} held-out pairs: "
                f"text {d['text_mean_distance']:.3f} vs image {d['image_mean_distance']:.3f}; "
                f"text closer in {100 * d['text_closer_fraction']:.1f}% of pairs "
                f"(curvature {d['curvature']:.3f})"
            )


if __name__ == "__main__":
    main()
