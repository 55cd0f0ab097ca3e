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
        [--meru CKPT --clip CKPT | --meru-config NAME --clip-config NAME] [--world DIR]
        [--image-side 512] [--metadata] [--flops]
    (defaults: tiny random-init models, a fresh synthetic pool)

`--meru-config/--clip-config` build random-init models of a named config (e.g. hype-meru-vit-l14 and
clip-vit-l14: the throughput of a trained model is the same). `--image-side N` re-encodes the pool's JPEGs
at N px on the long side, the size DataComp's downloader stores (512), so that decoding costs what it does
on a real pool. `--metadata` runs the embed stage as `hype score --metadata` does: cos θ and CLIP image
features from DataComp-style metadata (written here, random), so only MERU runs. `--flops` counts the model
FLOPs per sample (torch's FlopCounterMode on one ceiling batch) and reports the MFU of both paths against
`--peak-tflops` (default: the dense bf16 peak of a known GPU, e.g. 989 for an H100 SXM).
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


def _models(tmp: Path, meru_config: str, clip_config: str) -> tuple[str, str]:
    import torch

    from hype.checkpoint import save_checkpoint
    from hype.models import create_model

    torch.manual_seed(0)
    save_checkpoint(tmp / "meru.safetensors", create_model(meru_config))
    save_checkpoint(tmp / "clip.safetensors", create_model(clip_config))
    return str(tmp / "meru.safetensors"), str(tmp / "clip.safetensors")


def _resize_pool(shards: Path, side: int) -> None:
    """Re-encode every JPEG of the pool's tars at `side` px on the long side (quality 90), in place."""
    from concurrent.futures import ProcessPoolExecutor

    tars = sorted(shards.glob("*.tar"))
    with ProcessPoolExecutor(min(len(tars), os.cpu_count() or 1)) as pool:
        list(pool.map(_resize_tar, tars, [side] * len(tars)))


def _resize_tar(path: Path, side: int) -> None:
    import io
    import tarfile

    from PIL import Image

    out = path.with_suffix(".tmp")
    with tarfile.open(path) as src, tarfile.open(out, "w") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read() if m.isfile() else None
            if m.name.endswith(".jpg") and data is not None:
                img = Image.open(io.BytesIO(data)).convert("RGB")
                scale = side / max(img.size)
                img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))))
                buf = io.BytesIO()
                img.save(buf, "JPEG", quality=90)
                data = buf.getvalue()
                m.size = len(data)
            dst.addfile(m, io.BytesIO(data) if data is not None else None)
    out.replace(path)


def _metadata(world: Path, tmp: Path, dim: int, index: Path) -> dict:
    """DataComp-style metadata for the pool (<hash>.parquet with uid and cos θ + row-aligned <hash>.npz of
    L2-normalized fp16 `l14_img`, random) and its uid index, as `hype score --metadata` builds it."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hype.scoring.metadata import build_index

    uids = pq.read_table(world / "truth.parquet", columns=["uid"]).column("uid").to_pylist()
    rng = np.random.default_rng(0)
    folder = tmp / "metadata"
    folder.mkdir()
    feats = rng.normal(size=(len(uids), dim)).astype(np.float32)
    feats /= np.linalg.norm(feats, axis=1, keepdims=True)
    cos = rng.uniform(0.1, 0.4, len(uids)).astype(np.float32)
    pq.write_table(pa.table({"uid": uids, "clip_l14_similarity_score": cos}), folder / "0a1b.parquet")
    np.savez(folder / "0a1b.npz", l14_img=feats.astype(np.float16))
    index.parent.mkdir(parents=True, exist_ok=True)
    build_index(str(folder), index, "clip_l14_similarity_score")
    return {"dir": str(folder), "features_key": "l14_img"}


# Dense bf16 peak FLOP/s of the GPUs a user would run this on (vendor datasheets, without sparsity).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def _peak_tflops(device: str, given: float | None) -> float | None:
    import torch

    if given or not device.startswith("cuda"):
        return given
    name = torch.cuda.get_device_name(torch.device(device))
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


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
    p.add_argument("--meru-config", default="tiny-hyperbolic", help="random-init MERU config (no --meru)")
    p.add_argument("--clip-config", default="tiny-clip", help="random-init CLIP config (no --clip)")
    p.add_argument("--image-side", type=int, default=0, help="re-encode pool JPEGs at N px (0: as made)")
    p.add_argument("--metadata", action="store_true", help="cos θ and CLIP features from metadata")
    p.add_argument("--flops", action="store_true", help="count FLOPs per sample and report the MFU")
    p.add_argument("--peak-tflops", type=float, help="peak FLOP/s for the MFU [known GPUs: datasheet]")
    p.add_argument("--world", help="an existing synthetic world (else one is generated)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args()

    import torch

    from hype.data.samples import SkipStats, decode_pair, iter_tar_samples
    from hype.data.shards import expand_shards
    from hype.geometry import get_geometry
    from hype.io import blake2b128_file
    from hype.scoring.embed import EmbedStage, ModelRef
    from hype.scoring.embed import _autocast as embed_autocast
    from hype.scoring.rundir import RunDir, make_tasks

    with tempfile.TemporaryDirectory(prefix="hype-bench-embed-") as tmp_str:
        tmp = Path(tmp_str)
        world = Path(args.world) if args.world else _world(args.size, args.shard_size, tmp)
        if args.image_side:
            if args.world:
                raise SystemExit("--image-side rewrites the pool: use it with a generated world")
            _resize_pool(world / "pool" / "shards", args.image_side)
        if args.meru and args.clip:
            meru_path, clip_path = args.meru, args.clip
        else:
            meru_path, clip_path = _models(tmp, args.meru_config, args.clip_config)
        tasks = make_tasks(expand_shards(str(world / "pool" / "shards")).paths)
        run = RunDir(tmp / "run")
        run.create()
        stage = EmbedStage(
            run,
            meru=ModelRef(meru_path, blake2b128_file(meru_path)),
            clip=ModelRef(clip_path, blake2b128_file(clip_path)),
            metadata=_metadata(world, tmp, 768, run.metadata_index) if args.metadata else None,
            batch_size=args.batch_size,
            decode_workers=args.decode_workers,
            decode=args.decode,
            prefetch_batches=2,
            jpeg_draft=True,
            precision="auto",
            device=args.device,
        )
        stage.setup()
        meru, clip, dev = stage._meru, stage._clip, stage.device

        # Ceiling inputs: up to 8 batches decoded, preprocessed and tokenized up front (not timed), cycled
        # through as many batches as the pool has: the models' work per sample is the same.
        B = args.batch_size
        images_m, images_c, texts = [], [], []
        for task in tasks:
            for sample in iter_tar_samples(task.source, SkipStats()):
                pair = decode_pair(sample, SkipStats()) if len(texts) < 8 * B else None
                if pair is not None:
                    images_m.append(meru.preprocess(False)(pair[0]))
                    if clip is not None:
                        images_c.append(clip.preprocess(False)(pair[0]))
                    texts.append(pair[1])
        batches = [
            (
                torch.stack(images_m[s : s + B]).to(dev),
                torch.stack(images_c[s : s + B]).to(dev) if clip is not None else None,
                meru.tokenizer()(texts[s : s + B]).to(dev),
                clip.tokenizer()(texts[s : s + B]).to(dev) if clip is not None else None,
            )
            for s in range(0, len(texts) - B + 1 if len(texts) >= B else 1, B)
        ]
        hyp, cosine = get_geometry("hyperbolic"), get_geometry("clip")

        def sync() -> None:
            if torch.device(dev).type == "cuda":
                torch.cuda.synchronize()

        autocast = embed_autocast(stage.device, stage.precision)

        @torch.inference_mode()
        def forward(xm, xc, tm, tc) -> None:
            with autocast:  # the towers as the stage runs them (bf16 on a GPU); the geometry in fp32
                mi, mt = meru.encode_image(xm), meru.encode_text(tm)
                ci, ct = (clip.encode_image(xc), clip.encode_text(tc)) if clip is not None else (None, None)
            d = hyp.rowwise(mi.float(), mt.float(), curv=stage._curv)
            d.cpu()
            if clip is not None:
                cosine.rowwise(ci.float(), ct.float()).cpu()

        def ceiling() -> float:
            sync()
            t0 = time.perf_counter()
            done = 0
            while done < n:
                b = batches[(done // B) % len(batches)]
                forward(*b)
                done += b[0].shape[0]
            sync()
            return done / (time.perf_counter() - t0)

        def pipeline() -> float:
            t0 = time.perf_counter()
            done = sum(stage.run(task)["counts"]["embedded"] for task in tasks)
            assert done == n, (done, n)
            return done / (time.perf_counter() - t0)

        # Warm-up of both (allocator, thread pools, page cache); the first pass counts the pool's samples.
        n = sum(stage.run(task)["counts"]["embedded"] for task in tasks)
        ceiling()
        ceil_rates, pipe_rates = [], []
        for _ in range(args.repeats):
            ceil_rates.append(ceiling())
            pipe_rates.append(pipeline())
        flops = _flops_per_sample(forward, batches[0]) if args.flops else None
        result = {
            "models": "MERU only (--metadata)" if clip is None else "MERU + CLIP",
            "meru": Path(meru_path).name if args.meru else args.meru_config,
            "clip": None if clip is None else Path(clip_path).name if args.clip else args.clip_config,
            "precision": "bf16" if autocast.fast_dtype == torch.bfloat16 and autocast._enabled else "fp32",
            "image_side": args.image_side or "synthetic (48-160 px)",
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
        if flops is not None:
            peak = _peak_tflops(str(dev), args.peak_tflops)
            result["gflops_per_sample"] = round(flops / 1e9, 2)
            result["peak_tflops"] = peak
            for key in ("ceiling", "pipeline"):
                rate = result[f"{key}_samples_per_s"]
                result[f"{key}_tflops"] = round(rate * flops / 1e12, 2)
                result[f"{key}_mfu"] = round(rate * flops / (peak * 1e12), 4) if peak else None
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
    if "gflops_per_sample" in result:
        print(
            f"  {result['gflops_per_sample']} GFLOP/sample; MFU ceiling {result['ceiling_mfu']}, "
            f"pipeline {result['pipeline_mfu']} (peak {result['peak_tflops']} TFLOP/s)"
        )


def _flops_per_sample(forward, batch) -> float:
    """Model FLOPs per sample (matmuls and convolutions, as torch counts them) over one ceiling batch."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        forward(*batch)
    return counter.get_total_flops() / batch[0].shape[0]


if __name__ == "__main__":
    main()
