"""Benchmark: the embed stage end to end against the model-only ceiling, measured in the same run.

- pipeline: `hype score`'s embed stage on real shards: read the tar, parse, decode and preprocess in the
  decode threads, MERU + CLIP forward (image and text), −d_L and cos θ, write the shard's Parquet;
- ceiling: the same models at the same batch size on already-decoded, already-normalized tensors and
  already-tokenized captions (forward passes, −d_L and cos θ, nothing else).

Both run in this process with the same torch threads, back to back and repeated; the median rates and
the median of the per-repeat ratios are printed (target: pipeline >= 85% of the ceiling). Model
loading is outside both timings.

    python bench/score_embed.py [--size 2048] [--shard-size 1024] [--batch-size 128] [--repeats 5]
        [--device cpu] [--decode-workers N] [--decode processes|threads]
        [--meru CKPT --clip CKPT] [--world DIR]
    (defaults: tiny random-init models, a fresh synthetic pool)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _world(size: int, shard_size: int, tmp: Path) -> Path:
    from click.testing import CliRunner

    from hype.cli.synth import synth

    out = tmp / "world"
    args = f"--out {out} --size {size} --shard-size {shard_size} --clean-size 64 --eval-size 10".split()
    args += ["--reference-per-class", "1", "--no-progress"]
    result = CliRunner().invoke(synth, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


def _models(tmp: Path) -> tuple[str, str]:
    import torch

    from hype.checkpoint import save_checkpoint
    from hype.models import create_model

    torch.manual_seed(0)
    save_checkpoint(tmp / "meru.safetensors", create_model("tiny-hyperbolic"))
    save_checkpoint(tmp / "clip.safetensors", create_model("tiny-clip"))
    return str(tmp / "meru.safetensors"), str(tmp / "clip.safetensors")


def _drop_script_dir_from_path() -> None:
    # bench/ holds scripts, not modules: keep their names (e.g. bench/select.py) from shadowing the
    # standard library modules of the same name.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]


def main() -> None:
    _drop_script_dir_from_path()
    from hype.scoring.decode import share_cores_with_decoders

    share_cores_with_decoders()  # as `hype score` does, before torch starts (applies to both sides)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=2048, help="pool samples (synthetic world)")
    p.add_argument("--shard-size", type=int, default=1024, help="samples per tar (DataComp: 10,000)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--decode-workers", type=int, default=0, help="0: one per CPU")
    p.add_argument("--decode", default="processes", choices=["processes", "threads"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--meru")
    p.add_argument("--clip")
    p.add_argument("--world", help="an existing synthetic world (else one is generated)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args()

    import torch

    from hype.data.samples import SkipStats, decode_pair, iter_tar_samples
    from hype.data.shards import expand_shards
    from hype.geometry import get_geometry
    from hype.scoring.embed import EmbedStage, ModelRef
    from hype.scoring.rundir import RunDir, file_digest, make_tasks

    with tempfile.TemporaryDirectory(prefix="hype-bench-embed-") as tmp_str:
        tmp = Path(tmp_str)
        world = Path(args.world) if args.world else _world(args.size, args.shard_size, tmp)
        meru_path, clip_path = (args.meru, args.clip) if args.meru and args.clip else _models(tmp)
        tasks = make_tasks(expand_shards(str(world / "pool" / "shards")).paths)
        stage = EmbedStage(
            RunDir(tmp / "run"),
            meru=ModelRef(meru_path, file_digest(meru_path)),
            clip=ModelRef(clip_path, file_digest(clip_path)),
            batch_size=args.batch_size,
            decode_workers=args.decode_workers,
            decode=args.decode,
            prefetch_batches=2,
            jpeg_draft=True,
            precision="auto",
            device=args.device,
        )
        stage.run_dir.create()
        stage.setup()
        meru, clip, dev = stage._meru, stage._clip, stage.device

        # Ceiling inputs: every sample decoded, preprocessed and tokenized up front (not timed).
        images_m, images_c, texts = [], [], []
        for task in tasks:
            for sample in iter_tar_samples(task.source, SkipStats()):
                pair = decode_pair(sample, SkipStats())
                if pair is not None:
                    images_m.append(meru.preprocess(False)(pair[0]))
                    images_c.append(clip.preprocess(False)(pair[0]))
                    texts.append(pair[1])
        n = len(texts)
        B = args.batch_size
        batches = [
            (
                torch.stack(images_m[s : s + B]).to(dev),
                torch.stack(images_c[s : s + B]).to(dev),
                meru.tokenizer()(texts[s : s + B]).to(dev),
                clip.tokenizer()(texts[s : s + B]).to(dev),
            )
            for s in range(0, n, B)
        ]
        hyp, cosine = get_geometry("hyperbolic"), get_geometry("clip")

        def sync() -> None:
            if torch.device(dev).type == "cuda":
                torch.cuda.synchronize()

        @torch.inference_mode()
        def ceiling() -> float:
            sync()
            t0 = time.perf_counter()
            for xm, xc, tm, tc in batches:
                d = hyp.rowwise(meru.encode_image(xm), meru.encode_text(tm), curv=stage._curv)
                c = cosine.rowwise(clip.encode_image(xc), clip.encode_text(tc))
                d.cpu(), c.cpu()
            sync()
            return n / (time.perf_counter() - t0)

        def pipeline() -> float:
            t0 = time.perf_counter()
            done = sum(stage.run(task)["counts"]["embedded"] for task in tasks)
            assert done == n, (done, n)
            return n / (time.perf_counter() - t0)

        ceiling(), pipeline()  # warm-up (allocator, thread pools, page cache)
        ceil_rates, pipe_rates = [], []
        for _ in range(args.repeats):
            ceil_rates.append(ceiling())
            pipe_rates.append(pipeline())
        result = {
            "samples": n,
            "shards": len(tasks),
            "batch_size": B,
            "device": dev,
            "torch_threads": torch.get_num_threads(),
            "decode_workers": f"{stage._decoder.workers} {stage.decode}",
            "ceiling_samples_per_s": round(statistics.median(ceil_rates), 1),
            "pipeline_samples_per_s": round(statistics.median(pipe_rates), 1),
            "ceiling_runs": [round(r, 1) for r in ceil_rates],
            "pipeline_runs": [round(r, 1) for r in pipe_rates],
        }
        # Each repeat measures the two back to back, so the machine's load drifts less within a pair: the
        # median of the per-pair ratios is the robust figure on a shared machine.
        result["ratio"] = round(
            statistics.median(p / c for p, c in zip(pipe_rates, ceil_rates, strict=True)), 3
        )
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"embed stage, {n} samples in {len(tasks)} shards, batch {B}, {dev}, "
        f"{result['torch_threads']} torch threads, decode workers: {result['decode_workers']}"
    )
    print(
        f"  model-only ceiling {result['ceiling_samples_per_s']:>9,.1f} samples/s  {result['ceiling_runs']}"
    )
    print(
        f"  embed stage        {result['pipeline_samples_per_s']:>9,.1f} samples/s  {result['pipeline_runs']}"
    )
    print(f"  ratio              {result['ratio']:>9.1%}   (median of per-repeat ratios; target >= 85%)")


if __name__ == "__main__":
    main()
