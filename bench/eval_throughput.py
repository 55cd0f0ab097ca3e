"""Throughput of `hype eval`'s image path against the model-only ceiling, measured in the same run.

Full path: webdataset tars -> decode + preprocess in DataLoader workers -> encode_image -> similarity
against the class embeddings -> top-k (`hype.eval.zeroshot.run_classification`, exactly what `hype eval`
runs for a classification task). Ceiling: the same model, batch size and class head on tensors decoded
in advance (no I/O, no decoding). The ratio full / ceiling is the target metric (>= 0.85). The one-off
class-embedding time (prompt encoding) is reported separately; it does not depend on the number of images.
Wall-clock rates are medians of interleaved repeats; the CPU-time ratio (images per CPU second of this
process and its decode workers) is printed too, as it is steadier on a machine shared with other work.

    python bench/eval_throughput.py                         # tiny-clip, 2000 synthetic images, CPU
    python bench/eval_throughput.py --model-config clip-vit-b32 --device cuda --workers 8 --images 5000
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-config", default="tiny-clip", help="model config (random init) [tiny-clip]")
    ap.add_argument("--world", default=None, help="existing synthetic world (default: generate one)")
    ap.add_argument("--images", type=int, default=2000, help="images in the generated task [2000]")
    ap.add_argument("--task", default="synth/objects", help="classification task of the world")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=None, help="decode processes [hype eval's default]")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads [torch's default]")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats of each path; the median is kept")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()

    from hype.data.imageprep import Preprocess
    from hype.eval import readers as R
    from hype.eval.runner import default_workers
    from hype.eval.tasks import load_suite
    from hype.eval.zeroshot import EncodeOptions, class_embeddings, encode_images, run_classification
    from hype.models import create_model

    with tempfile.TemporaryDirectory() as tmp:
        world = Path(args.world) if args.world else _make_world(Path(tmp) / "world", args.images)
        task = load_suite("synthetic").get(args.task)
        folder = task.find(world / "eval")
        if folder is None:
            sys.exit(f"{args.task} not found under {world / 'eval'}")

        if args.threads:
            torch.set_num_threads(args.threads)
        device = torch.device(args.device)
        workers = default_workers(device) if args.workers is None else args.workers
        torch.manual_seed(0)
        model = create_model(args.model_config).to(device).eval()
        opts = EncodeOptions(device=device, batch_size=args.batch_size)
        transform = Preprocess.of(model)

        t0 = time.perf_counter()
        classnames, templates = R.read_classnames(folder), R.read_templates(folder)
        head = class_embeddings(model, classnames, templates, opts)
        _sync(device)
        prompt_s = time.perf_counter() - t0
        k = min(5, len(classnames))
        spec = R.WdsSpec(label=True)

        def full() -> int:
            loader = R.wds_loader(
                folder,
                transform=transform,
                spec=spec,
                batch_size=args.batch_size,
                workers=workers,
                pin_memory=device.type == "cuda",
            )
            out = run_classification(model, loader, [head], [k], opts)
            _sync(device)
            return out.stats.num_samples

        # Pre-decode every image once for the ceiling (same transform, same batches).
        batches = [
            b["images"]
            for b in R.wds_loader(
                folder, transform=transform, spec=spec, batch_size=args.batch_size, workers=0
            )
        ]
        batches = [b for b in batches if b is not None]
        if device.type == "cuda":
            batches = [b.pin_memory() for b in batches]
        n_images = sum(len(b) for b in batches)

        @torch.no_grad()
        def ceiling() -> int:
            for images in batches:
                emb = encode_images(model, images, opts)
                model.similarity(emb, head).topk(k, dim=1).indices.cpu()
            _sync(device)
            return n_images

        ceiling()  # warm-up (kernels, allocator, first-call overheads)
        full_runs, ceil_runs = [], []
        for _ in range(args.repeats):  # interleaved, so drifting machine load hits both paths alike
            full_runs.append(_rate(full))
            ceil_runs.append(_rate(ceiling))
        full_rates, ceil_rates = [r[0] for r in full_runs], [r[0] for r in ceil_runs]
        full_ips, ceil_ips = statistics.median(full_rates), statistics.median(ceil_rates)
        full_cpu = statistics.median(r[1] for r in full_runs)
        ceil_cpu = statistics.median(r[1] for r in ceil_runs)
        result = {
            "model_config": args.model_config,
            "device": str(device),
            "torch_threads": torch.get_num_threads(),
            "workers": workers,
            "batch_size": args.batch_size,
            "images": n_images,
            "full_images_per_s": round(full_ips, 1),
            "ceiling_images_per_s": round(ceil_ips, 1),
            "ratio": round(full_ips / ceil_ips, 3),
            "cpu_ratio": round(full_cpu / ceil_cpu, 3),
            "full_images_per_cpu_s": round(full_cpu, 1),
            "ceiling_images_per_cpu_s": round(ceil_cpu, 1),
            "full_runs": [round(r, 1) for r in full_rates],
            "ceiling_runs": [round(r, 1) for r in ceil_rates],
            "prompt_encoding_s": round(prompt_s, 2),
            "classes_x_templates": f"{len(classnames)}x{len(templates)}",
        }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"{args.model_config} on {device} (batch {args.batch_size}, {workers} decode workers, "
            f"{result['torch_threads']} torch threads, {n_images} images)\n"
            f"  full eval path   {full_ips:8.1f} images/s   runs {result['full_runs']}\n"
            f"  model-only       {ceil_ips:8.1f} images/s   runs {result['ceiling_runs']}\n"
            f"  ratio            {result['ratio']:8.3f}   (target >= 0.85; medians of wall-clock rates)\n"
            f"  CPU-time ratio   {result['cpu_ratio']:8.3f}   (images per CPU second, full / model-only)\n"
            f"  prompt encoding  {prompt_s:8.2f} s once per task ({result['classes_x_templates']} prompts)"
        )


def _rate(fn) -> tuple[float, float]:
    """Images per second of wall time and per second of CPU time (this process and its reaped
    children, i.e. the decode workers): on a shared machine the CPU-time rate is the steadier one."""
    t0, c0 = time.perf_counter(), _cpu_seconds()
    n = fn()
    return n / (time.perf_counter() - t0), n / (_cpu_seconds() - c0)


def _cpu_seconds() -> float:
    self, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return self.ru_utime + self.ru_stime + children.ru_utime + children.ru_stime


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _make_world(out: Path, images: int) -> Path:
    from hype.synth import make_world

    print(f"generating a synthetic world with {images} images per task in {out} ...", file=sys.stderr)
    make_world(out, size=64, clean_size=16, eval_size=images, reference_per_class=1)
    return out


if __name__ == "__main__":
    main()
