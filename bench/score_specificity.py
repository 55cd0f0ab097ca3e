"""Benchmark: streaming ε_t / ε_i against the bare matrix product and the straightforward approach.

Prints, per pool size:
- time of hype's streaming specificity (`hype.scoring.specificity.text_specificity`, the code `hype
  score` runs) and of the bare matmul of the same shapes, (pool x n) @ (n x M) with a row mean and
  nothing else, interleaved and repeated, and their ratio (target <= 1.5). The bare matmul is timed two
  ways and the faster counts: `bare-mkl`, chunks of rows x M on torch's own threads, and `bare-tiled`,
  the tiles and threads of hype's kernel (`hype.geometry._tiles`) with only a row sum after the matmul;
- peak RSS of each, measured in a fresh child process (target: independent of the pool size);
- the straightforward approach of the authors' released code: the whole (pool x M) energy matrix at
  once, run under an address-space limit so that running out of memory is reported, not fatal.

The pool is generated block by block (like per-shard Parquet files), so inputs do not grow with it.

    python bench/score_specificity.py [--pools 10000,1000000] [--refs 20000] [--dim 512] [--mem-limit-gb 16]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

BLOCK = 10_000  # pool rows per block, like one shard's embeddings


def _pool_blocks(pool: int, dim: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    for start in range(0, pool, BLOCK):
        yield torch.randn(min(BLOCK, pool - start), dim, generator=g) * 0.05


def _bare_tiled(block, ref) -> float:
    """Row means of block @ ref.T on the kernel's tiles and threads: the matmul, then only a row sum."""
    import torch

    from hype.geometry import lorentz
    from hype.geometry._tiles import run_tiles, tile_grid

    tiles, (tr, tc) = tile_grid(block.shape[0], ref.shape[0], *lorentz.CPU_TILE)
    partial = block.new_zeros(-(-ref.shape[0] // tc), block.shape[0])

    def work(r, cs, scratch):
        if "w" not in scratch:
            scratch["w"] = block.new_empty(tr * tc)
        w = scratch["w"][: (r.stop - r.start) * (cs.stop - cs.start)].view(r.stop - r.start, -1)
        torch.mm(block[r], ref[cs].T, out=w)
        torch.sum(w, dim=1, out=partial[cs.start // tc, r])

    run_tiles(tiles, work)
    return float((partial.sum(0) / ref.shape[0]).sum())


def run(mode: str, pool: int, refs: int, dim: int, threads: int = 0) -> dict:
    """One measurement in this process; `mode` is streaming | bare-mkl | bare-tiled | naive."""
    import torch

    from hype.geometry import lorentz
    from hype.scoring.specificity import chunk_rows, text_specificity

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(1)
    ref = torch.randn(refs, dim) * 0.05
    curv = 0.1
    rows = chunk_rows(refs)
    t0, cpu0 = time.perf_counter(), time.process_time()
    total = 0.0
    if mode == "naive":
        texts = torch.cat(list(_pool_blocks(pool, dim)))
        total = float(lorentz.pairwise_entailment_energy(texts, ref, curv).mean(1).sum())
    else:
        for block in _pool_blocks(pool, dim):
            if mode == "streaming":
                total += float(text_specificity(block, ref, curv).sum())
            elif mode == "bare-tiled":
                total += _bare_tiled(block, ref)
            else:  # bare-mkl: the bare matrix product of the same shapes, chunk by chunk
                for s in range(0, block.shape[0], rows):
                    total += float((block[s : s + rows] @ ref.T).mean(1).sum())
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "mode": mode,
        "pool": pool,
        "threads": torch.get_num_threads(),
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "peak_rss_mb": rss_mb,
        "checksum": total,
    }


def child(mode: str, pool: int, refs: int, dim: int, mem_limit_gb: float | None, threads: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        mode,
        "--pools",
        str(pool),
        "--refs",
        str(refs),
        "--dim",
        str(dim),
        "--threads",
        str(threads),
    ]
    if mem_limit_gb:
        cmd += ["--mem-limit-gb", str(mem_limit_gb)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["?"])[-1]
        oom = "memory" in out.stderr.lower() or "alloc" in out.stderr.lower() or out.returncode in (-9, 137)
        return {"mode": mode, "pool": pool, "error": "out of memory" if oom else tail}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pools", default="10000")
    ap.add_argument("--refs", type=int, default=20_000)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mem-limit-gb", type=float, default=16.0, help="address-space limit of the naive run")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--bare", default="bare-mkl,bare-tiled", help="bare-matmul variants to time (the faster counts)"
    )
    ap.add_argument(
        "--child", choices=["streaming", "bare-mkl", "bare-tiled", "naive"], help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    pools = [int(p) for p in args.pools.split(",")]

    if args.child:
        if args.mem_limit_gb and args.child == "naive":
            limit = int(args.mem_limit_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        print(json.dumps(run(args.child, pools[0], args.refs, args.dim, args.threads)))
        return

    print(
        f"refs M = {args.refs}, dim = {args.dim}, block = {BLOCK} rows, torch threads "
        f"{args.threads or 'default'}; best of {args.repeats}, interleaved"
    )
    for pool in pools:
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            for mode in [*args.bare.split(","), "streaming"]:
                r = child(mode, pool, args.refs, args.dim, None, args.threads)
                if mode not in best or r["seconds"] < best[mode]["seconds"]:
                    best[mode] = r
        naive = child("naive", pool, args.refs, args.dim, args.mem_limit_gb, args.threads)
        s = best.pop("streaming")
        b = min(best.values(), key=lambda r: r["seconds"])
        ratio = s["seconds"] / b["seconds"]
        print(
            f"pool {pool:>9,}: streaming {s['seconds']:8.2f} s ({s['peak_rss_mb']:6.0f} MB peak) | "
            f"bare matmul {b['seconds']:8.2f} s ({b['peak_rss_mb']:6.0f} MB, {b['mode']}) | ratio {ratio:.2f}"
        )
        # CPU time: robust to other jobs on a shared machine, comparable where both run the same threads
        cpu_ratio = s["cpu_seconds"] / b["cpu_seconds"]
        print(
            f"{'':17}CPU time: streaming {s['cpu_seconds']:.2f} s, bare {b['cpu_seconds']:.2f} s, "
            f"ratio {cpu_ratio:.2f}"
        )
        others = ", ".join(
            f"{r['mode']} {r['seconds']:.2f} s (CPU {r['cpu_seconds']:.2f} s, {r['peak_rss_mb']:.0f} MB)"
            for r in best.values()
        )
        print(f"{'':17}bare variants: {others}", flush=True)
        if "error" in naive:
            print(f"{'':17}straightforward full matrix: {naive['error']} (limit {args.mem_limit_gb:g} GB)")
        else:
            slower = naive["seconds"] / s["seconds"]
            print(
                f"{'':17}straightforward full matrix: {naive['seconds']:8.2f} s "
                f"({naive['peak_rss_mb']:6.0f} MB peak), {slower:.2f}x the streaming time"
            )


if __name__ == "__main__":
    main()
