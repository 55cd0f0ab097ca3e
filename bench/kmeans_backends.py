"""c_IN's k-means: `clusters.backend=torch` against faiss (the default) in the same process, same points.

    python bench/kmeans_backends.py [--points 100000 --k 1000 --dim 256 --niter 10 --device cpu]

Prints each backend's seconds, the ratio torch / faiss, and both k-means objectives (mean squared distance
to the nearest centroid: the two draw their initial centroids differently, so they end in different local
optima). faiss always runs on the CPU (faiss-cpu); torch on `--device`. On a GPU see bench/gpu_suite.py
`kmeans` (K = 100,000).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def objective(x: np.ndarray, c: np.ndarray) -> float:
    from hype.scoring.clusters import _torch_nearest

    near = _torch_nearest(x, c, "cpu", l2=True)
    return float(((x - c[near]) ** 2).sum(1).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=int, default=100_000)
    ap.add_argument("--k", type=int, default=1000)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--niter", type=int, default=10)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch

    from hype.scoring.clusters import kmeans_centroids

    x = np.random.default_rng(0).standard_normal((args.points, args.dim), dtype=np.float32)
    result = {"points": args.points, "k": args.k, "dim": args.dim, "niter": args.niter}
    result |= {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    kmeans_centroids(x[: 4 * args.k], args.k // 4 or 1, niter=1, backend="torch", device=args.device)  # warm
    for backend, device in (("faiss", "cpu"), ("torch", args.device)):
        t0 = time.perf_counter()
        c = kmeans_centroids(x, args.k, niter=args.niter, backend=backend, device=device)
        result[f"{backend}_s"] = round(time.perf_counter() - t0, 3)
        result[f"{backend}_objective"] = round(objective(x, c), 4)
    result["ratio_torch_over_faiss"] = round(result["torch_s"] / result["faiss_s"], 3)
    print(json.dumps(result) if args.json else "\n".join(f"{k:>24}  {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
