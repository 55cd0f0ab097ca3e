"""Quality: how well each HYPE term detects each kind of noise of the synthetic world (DESIGN §5).

1. a synthetic world (`hype synth --size 4000 --clean-size 8000`), unless --world is given;
2. tiny MERU (`tiny-hyperbolic-scorer`) and tiny CLIP (`tiny-clip`) trained with `hype train` on its
   clean set (the scorer set),
   unless --meru/--clip are given;
3. `hype score` on the noisy pool with the reference-class images (`eval/reference`) for c_IN;
4. AUROC of clean vs each noise kind for every metric (and the HYPE score, Eq. 1), from truth.parquet,
   the pairs the paper motivates (misaligned by −d_L and cos θ, underspecified texts by ε_t,
   underspecified images by ε_i), and whether mean ε_t < mean ε_i (HYPE Table 1).

AUROC = P(metric(clean) > metric(noisy)), ties counting one half (`hype.scoring.quality`).

    python bench/score_quality.py [--out runs/quality] [--size 4000] [--clean-size 8000]
        [--samples-seen 12800] [--world DIR] [--meru CKPT --clip CKPT] [--meru-config PRESET] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _drop_script_dir_from_path() -> None:
    # bench/ holds scripts, not modules: keep their names (e.g. bench/select.py) from shadowing the
    # standard library modules of the same name.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]


def _hype(*args: str) -> None:
    import subprocess  # after _drop_script_dir_from_path: subprocess imports `select`

    cmd = [sys.executable, "-c", "from hype.cli import main; main()", *args]
    print("$ hype " + " ".join(args), flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    _drop_script_dir_from_path()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/quality", help="working folder (world, models, score run)")
    p.add_argument("--size", type=int, default=4000)
    p.add_argument("--clean-size", type=int, default=8000)
    p.add_argument("--samples-seen", type=int, default=None, help="training samples per model [preset's]")
    p.add_argument("--world")
    p.add_argument("--meru")
    p.add_argument("--clip")
    p.add_argument("--score-args", default="", help="extra `hype score` arguments, e.g. '--hinge'")
    p.add_argument(
        "--meru-overrides",
        default="",
        help="key=value overrides of the MERU scorer's recipe, e.g. 'loss.K_start=0.3 loss.K_end=0.1'",
    )
    p.add_argument(
        "--meru-config",
        default="tiny-hyperbolic-scorer",
        help="train preset of the hyperbolic scorer, e.g. tiny-hycoclip (HyCoCLIP's losses on the grounding)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timings = {}
    world = Path(args.world) if args.world else out / "world"
    if not args.world and not (world / "truth.parquet").exists():
        t = time.perf_counter()
        _hype(
            "synth",
            "--out",
            str(world),
            "--size",
            str(args.size),
            "--clean-size",
            str(args.clean_size),
            "--no-progress",
        )
        timings["synth_s"] = round(time.perf_counter() - t, 1)
    models = {}
    for role, preset in (("meru", args.meru_config), ("clip", "tiny-clip")):
        given = getattr(args, role)
        if given:
            models[role] = given
            continue
        train_dir = out / f"train-{preset}"
        models[role] = str(train_dir / "model.safetensors")
        if not Path(models[role]).exists():
            extra = [f"samples_seen={args.samples_seen}"] if args.samples_seen else []
            if role == "meru":
                extra += args.meru_overrides.split()
            t = time.perf_counter()
            _hype(
                "train",
                "--config",
                preset,
                "--data",
                str(world / "clean" / "shards"),
                "--out",
                str(train_dir),
                "--no-progress",
                *extra,
            )
            timings[f"train_{role}_s"] = round(time.perf_counter() - t, 1)
    run = out / "score"
    t = time.perf_counter()
    _hype(
        "score",
        "--pool",
        str(world / "pool" / "shards"),
        "--meru",
        models["meru"],
        "--clip",
        models["clip"],
        "--class-images",
        str(world / "eval" / "reference" / "train"),
        "--out",
        str(run),
        "--config",
        "tiny",
        "--no-progress",
        *args.score_args.split(),
    )
    timings["score_s"] = round(time.perf_counter() - t, 1)

    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    from hype.scoring.quality import noise_auroc_table

    scores = ds.dataset(run / "scores", format="parquet").to_table().to_pandas()
    truth = pq.read_table(world / "truth.parquet", columns=["uid", "noise"]).to_pandas()
    df = scores.merge(truth, on="uid", how="inner")
    table = noise_auroc_table(df)
    kinds = sorted(k for k in df.noise.unique() if k != "clean")
    clean = df[df.noise == "clean"]
    result = {
        "pool": len(scores),
        "matched_truth": len(df),
        "counts": df.noise.value_counts().to_dict(),
        "auroc": table,
        "headline": {
            "misaligned by -d_L": table["neg_d_l"].get("misaligned"),
            "misaligned by cos θ": table["cos_theta"].get("misaligned"),
            "underspecified_text by ε_t": table["eps_t"].get("underspecified_text"),
            "underspecified_image by ε_i": table["eps_i"].get("underspecified_image"),
        },
        "mean_eps_t": float(df.eps_t.mean()),
        "mean_eps_i": float(df.eps_i.mean()),
        "mean_eps_t_clean": float(clean.eps_t.mean()),
        "mean_eps_i_clean": float(clean.eps_i.mean()),
        "spread": {m: float(df[m].std()) for m in ("eps_i", "eps_t", "neg_d_l", "cos_theta")},
        "origin_distance": origin_distances(run, df),
        "timings": timings,
        "summary": json.loads((run / "summary.json").read_text())["stages"],
    }
    result["eps_t_below_eps_i"] = result["mean_eps_t"] < result["mean_eps_i"]
    if args.json:
        print(json.dumps(result, indent=2, default=float))
        return
    print(f"\nAUROC, clean vs each noise kind ({len(df)} samples: {result['counts']})")
    width = max(len(k) for k in kinds)
    print(f"{'metric':<10} " + " ".join(f"{k:>{width}}" for k in kinds))
    for metric, row in table.items():
        print(f"{metric:<10} " + " ".join(f"{row[k]:>{width}.3f}" for k in kinds))
    print("\nheadline pairs:")
    for name, value in result["headline"].items():
        print(f"  {name:<30} {value:.3f}" if value is not None else f"  {name:<30} n/a")
    verdict = "yes" if result["eps_t_below_eps_i"] else "no"
    print(
        f"\nmean ε_t = {result['mean_eps_t']:.4f}, mean ε_i = {result['mean_eps_i']:.4f}: "
        f"ε_t < ε_i (HYPE Table 1)? {verdict}  "
        f"(clean only: ε_t {result['mean_eps_t_clean']:.4f}, ε_i {result['mean_eps_i_clean']:.4f})"
    )
    d = result["origin_distance"]
    print(
        f"distance from the origin (clean pool pairs): texts {d['text_mean']:.3f}, "
        f"images {d['image_mean']:.3f}; "
        f"text nearer than its image for {d['text_nearer_fraction']:.1%} (MERU Fig. 4)"
    )
    print("std over the pool: " + ", ".join(f"{k} {v:.3f}" for k, v in result["spread"].items()))
    print(f"timings: {timings}")


def origin_distances(run: Path, df) -> dict:
    """Mean geodesic distance from the origin, asinh(sqrt(c)|x|)/sqrt(c) of the MERU space components, of
    the clean pool samples' texts and images (MERU Fig. 4: texts sit nearer the origin)."""
    import numpy as np
    import pyarrow.dataset as ds

    from hype.scoring.embed_format import fixed_list_to_numpy, model_scalars

    files = sorted((run / "embed").glob("*.parquet"))
    curv = model_scalars(files[0])[0]
    table = ds.dataset([str(f) for f in files], format="parquet").to_table(
        columns=["uid", "meru_img", "meru_txt"]
    )
    clean = set(df.loc[df.noise == "clean", "uid"])
    keep = np.array([u in clean for u in table.column("uid").to_pylist()])

    def dist(col: str) -> np.ndarray:
        x = fixed_list_to_numpy(table.column(col)).astype(np.float64)[keep]
        return np.arcsinh(np.sqrt(curv) * np.linalg.norm(x, axis=1)) / np.sqrt(curv)

    d_img, d_txt = dist("meru_img"), dist("meru_txt")
    return {
        "pairs": int(keep.sum()),
        "text_mean": float(d_txt.mean()),
        "image_mean": float(d_img.mean()),
        "text_nearer_fraction": float((d_txt < d_img).mean()),
    }


if __name__ == "__main__":
    main()
