"""What still varies between training runs of the same inputs, measured on a tiny synthetic world.

    python bench/repro.py [--threads 1 2 4] [--steps 6] [--device cpu]

Trains the tiny hyperbolic preset once per thread count, twice at the first count, and prints for each
run the largest absolute weight difference from the first run and whether the checkpoint bytes are equal.
Same threads, same machine: identical bytes (tests/test_train_loop.py checks it). Another thread count
splits CPU reductions differently: weights differ at float32 rounding level, growing with steps.
With --device cuda the GPU run is compared with the CPU one (TF32/cuBLAS kernels differ)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from train_helpers import MICRO  # noqa: E402

from hype.checkpoint import load_checkpoint  # noqa: E402
from hype.synth import make_world  # noqa: E402
from hype.train import load_train_config, train  # noqa: E402

FAST = ["data.workers=0", "data.shuffle_buffer=32", "log_every_steps=1", "optim.warmup_steps=2"]


def run(world: Path, out: Path, threads: int, steps: int, device: str) -> Path:
    overrides = [*MICRO, *FAST, f"samples_seen={steps * 8}", "batch_size=8", "checkpoint.every_steps=0"]
    overrides += [f"threads={threads}", f"device={device}", f"data.train={world / 'clean' / 'shards'}"]
    train(load_train_config("tiny-hyperbolic", [*overrides, f"out={out}"]), progress=False)
    return out / "model.safetensors"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_world(root / "world", 64, 0, clean_size=96, eval_size=8, reference_per_class=1, shard_size=32)
        plan = [("cpu", args.threads[0]), ("cpu", args.threads[0])] + [("cpu", t) for t in args.threads[1:]]
        if args.device != "cpu":
            plan.append((args.device, args.threads[0]))
        files = [run(root / "world", root / f"run{i}", t, args.steps, d) for i, (d, t) in enumerate(plan)]
        ref = load_checkpoint(files[0]).state_dict()
        print(f"{'device':>8} {'threads':>7} {'max |dw|':>10} same-bytes  (vs run 0, {args.steps} steps)")
        for (device, threads), f in zip(plan, files, strict=True):
            sd = load_checkpoint(f).state_dict()
            diff = max((sd[k].float() - ref[k].float()).abs().max().item() for k in ref)
            same = f.read_bytes() == files[0].read_bytes()
            print(f"{device:>8} {threads:>7} {diff:10.2e} {same}")


if __name__ == "__main__":
    main()
