"""Training throughput of `hype train` vs `python -m open_clip_train.main` on the same tiny CLIP.

Both train the same architecture (configs/models/tiny-clip.yaml, written as an open_clip model config
and loaded with open_clip's `local-dir:` schema) on the same webdataset shards of a synthetic world,
with the same global batch, precision, optimizer settings, gradient clipping, resampled shards and
DataLoader worker count, on the same device. Startup is excluded the same way for both: each logs every
step's wall time (data wait included), the first `--skip` steps are dropped and the steady-state rate is
batch * steps / sum(step times) over the rest.

    .venv/bin/python -P bench/train_throughput.py              # 2-core CPU defaults
    .venv/bin/python -P bench/train_throughput.py --device cuda --batch 256 --steps 60 --workers 4

Prints both rates and the ratio hype / open_clip, and writes them as JSON with --json-out.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def open_clip_config(model_name: str) -> dict:
    """The open_clip `open_clip_config.json` equivalent to a hype model config (CLIP geometry)."""
    sys.path.insert(0, str(REPO))
    from hype.models import load_model_config

    c = load_model_config(model_name)
    if c.geometry != "clip":
        raise SystemExit(f"{model_name}: open_clip only trains the clip geometry")
    v, t = c.vision, c.text
    return {
        "model_cfg": {
            "embed_dim": c.embed_dim,
            "quick_gelu": c.quick_gelu,
            "vision_cfg": {
                "image_size": v.image_size,
                "layers": v.layers,
                "width": v.width,
                "head_width": v.head_width,
                "mlp_ratio": v.mlp_ratio,
                "patch_size": v.patch_size,
            },
            "text_cfg": {
                "context_length": t.context_length,
                "vocab_size": t.vocab_size,
                "width": t.width,
                "heads": t.heads,
                "layers": t.layers,
                "mlp_ratio": t.mlp_ratio,
            },
        },
        "preprocess_cfg": {
            "mean": list(c.preprocess.mean),
            "std": list(c.preprocess.std),
            "interpolation": c.preprocess.interpolation,
            "resize_mode": c.preprocess.resize_mode,
        },
    }


def steady_rate(step_times: list[float], batch: int, skip: int) -> tuple[float, int]:
    kept = step_times[skip:]
    if not kept:
        raise SystemExit(f"only {len(step_times)} steps logged; raise --steps above --skip")
    return batch * len(kept) / sum(kept), len(kept)


def run_hype(args, shards: str, out: Path) -> tuple[list[float], list[float]]:
    """(per-step wall times, per-step losses)."""
    cmd = [
        sys.executable, "-m", "hype.train", "--config", args.model, "--data", shards, "--out", str(out),
        "--no-progress", f"batch_size={args.batch}", f"samples_seen={args.batch * args.steps}",
        f"precision={args.precision}", f"device={args.device}", f"data.workers={args.workers}",
        "optim.lr=1e-3", "optim.warmup_steps=10", "optim.grad_clip_norm=1.0", "optim.eps=1e-6",
        "optim.beta2=0.98", "optim.weight_decay=0.2", "log_every_steps=1", "checkpoint.every_steps=0",
        "data.resampled=true",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["time_s"] for r in rows]
    # time_s is cumulative from the loader's start; step 1's time includes the first batch's startup.
    steps = [times[0]] + [b - a for a, b in zip(times, times[1:], strict=False)]
    return steps, [r["loss"] for r in rows]


# open_clip_train 3.3's `group_by_keys_nothrow` predates webdataset 1.x, whose `tar_file_expander` yields an
# empty end-of-shard marker it cannot handle (KeyError: 'fname'). The launcher turns the marker off, which
# is what the older webdataset did; nothing else changes. DataLoader workers inherit it through fork.
OPEN_CLIP_LAUNCHER = """
import sys
import open_clip_train.data as data
from webdataset.tariterators import tar_file_expander

def expander(src, handler=None, **kw):
    return tar_file_expander(src, handler=handler, eof_value=None)

data.tar_file_expander = expander
from open_clip_train.main import main

main(sys.argv[1:])
"""

_BATCH_T = re.compile(r"Train Epoch: \d+ \[\s*(\d+)/\d+.*?Batch \(t\): ([0-9.]+).*? Loss: ([0-9.]+)")


def run_open_clip(
    args, shards: str, n_shards: int, cfg_dir: Path, logs: Path
) -> tuple[list[float], list[float]]:
    precision = {"fp32": "fp32", "bf16": "amp_bf16", "fp16": "amp"}[args.precision]
    cmd = [
        sys.executable, "-c", OPEN_CLIP_LAUNCHER, "--model", f"local-dir:{cfg_dir}",
        "--train-data", shards, "--dataset-type", "webdataset", "--dataset-resampled",
        "--train-num-samples", str(args.batch * args.steps), "--batch-size", str(args.batch),
        "--epochs", "1", "--workers", str(args.workers), "--precision", precision, "--device", args.device,
        "--lr", "1e-3", "--warmup", "10", "--grad-clip-norm", "1.0", "--eps", "1e-6", "--beta1", "0.9",
        "--beta2", "0.98", "--wd", "0.2", "--log-every-n-steps", "1", "--logs", str(logs), "--name", "bench",
        "--save-frequency", "0", "--zeroshot-frequency", "0", "--val-frequency", "0", "--seed", "0",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    found = list(_BATCH_T.finditer((logs / "bench" / "out.log").read_text()))
    return [float(m.group(2)) for m in found], [float(m.group(3)) for m in found]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-clip", help="hype model config with geometry clip")
    p.add_argument("--world", type=Path, help="existing synthetic world (default: generate one)")
    p.add_argument("--clean-size", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="first steps left out (startup, warm-up)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=1, help="alternate the two trainers this many times")
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="hype-bench-") as tmp:
        tmp = Path(tmp)
        world = args.world
        if world is None:
            world = tmp / "world"
            from hype.synth import make_world

            make_world(world, 64, 0, clean_size=args.clean_size, eval_size=8, reference_per_class=1)
        tars = sorted((world / "clean" / "shards").glob("*.tar"))
        shards = f"{tars[0].parent}/{{{tars[0].stem}..{tars[-1].stem}}}.tar"
        cfg_dir = tmp / "open_clip_model"
        cfg_dir.mkdir()
        (cfg_dir / "open_clip_config.json").write_text(json.dumps(open_clip_config(args.model), indent=2))

        rates: dict[str, list[float]] = {"hype": [], "open_clip": []}
        # Same model, data and recipe: the losses must fall alike (a check that both train the same thing).
        last_losses: dict[str, list[float]] = {"hype": [], "open_clip": []}
        for r in range(args.repeats):
            t = time.perf_counter()
            h, h_loss = run_hype(args, shards, tmp / f"hype{r}")
            last_losses["hype"].append(statistics.mean(h_loss[-5:]))
            rates["hype"].append(steady_rate(h, args.batch, args.skip)[0])
            took = time.perf_counter() - t
            print(f"[{r}] hype train:      {rates['hype'][-1]:8.1f} samples/s  ({took:.0f} s)")
            t = time.perf_counter()
            o, o_loss = run_open_clip(args, shards, len(tars), cfg_dir, tmp / f"oc{r}")
            last_losses["open_clip"].append(statistics.mean(o_loss[-5:]))
            rates["open_clip"].append(steady_rate(o, args.batch, args.skip)[0])
            took = time.perf_counter() - t
            print(f"[{r}] open_clip_train: {rates['open_clip'][-1]:8.1f} samples/s  ({took:.0f} s)")

    hype_rate, oc_rate = statistics.median(rates["hype"]), statistics.median(rates["open_clip"])
    result = {
        "model": args.model,
        "device": args.device,
        "precision": args.precision,
        "batch": args.batch,
        "workers": args.workers,
        "steps": args.steps,
        "skipped_steps": args.skip,
        "hype_samples_per_s": hype_rate,
        "open_clip_samples_per_s": oc_rate,
        "ratio": hype_rate / oc_rate,
        "runs": rates,
        "mean_loss_last_5_steps": last_losses,
    }
    print(f"\n{'trainer':<18}{'samples/s':>12}")  # steady state, startup excluded
    h_loss, o_loss = statistics.median(last_losses["hype"]), statistics.median(last_losses["open_clip"])
    print(f"{'hype train':<18}{hype_rate:>12.1f}   loss over the last 5 steps {h_loss:.3f}")
    print(f"{'open_clip_train':<18}{oc_rate:>12.1f}   loss over the last 5 steps {o_loss:.3f}")
    print(
        f"ratio hype / open_clip = {result['ratio']:.2f}  (target >= 1.0; {args.model}, batch {args.batch}, "
        f"{args.precision}, {args.workers} worker(s), {args.device}, median of {args.repeats})"
    )
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
