"""c_IN's nearest-centroid assignment: the exact rule (fp32 top candidates, then fixed-order float64 sums
for the rows with several inside the error margin) against the fp32 argmax it replaced, in one process.

    python bench/assign_exact.py [--points 200000 --k 2000 --dim 768]

Prints seconds per arm (faiss and torch on the CPU), the ratios new / old and how many rows the two rules
assign differently (fp32 near-ties).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=int, default=200_000)
    ap.add_argument("--k", type=int, default=2000)
    ap.add_argument("--dim", type=int, default=768)
    args = ap.parse_args()
    import faiss
    import torch

    from hype.scoring.clusters import ASSIGN_BATCH, nearest_centroid

    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.points, args.dim), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    c = x[rng.choice(args.points, args.k, replace=False)] + 0.1 * rng.standard_normal((args.k, args.dim))
    c = c.astype(np.float32)

    def faiss_argmax() -> np.ndarray:  # the rule before: the fp32 search's first
        index = faiss.IndexFlatIP(args.dim)
        index.add(c)
        return np.concatenate(
            [index.search(x[s : s + ASSIGN_BATCH], 1)[1][:, 0] for s in range(0, len(x), 1 << 16)]
        )

    def torch_argmax() -> np.ndarray:
        ct = torch.from_numpy(c)
        rows = max(1, (1 << 30) // (4 * args.k))
        return torch.cat(
            [(torch.from_numpy(x[s : s + rows]) @ ct.T).argmax(1) for s in range(0, len(x), rows)]
        ).numpy()

    arms = {
        "faiss_old": faiss_argmax,
        "faiss_new": lambda: nearest_centroid(x, c),
        "torch_old": torch_argmax,
        "torch_new": lambda: nearest_centroid(x, c, backend="torch"),
    }
    result = {"points": args.points, "k": args.k, "dim": args.dim, "cpus": os.cpu_count()}
    result["torch_threads"], out = torch.get_num_threads(), {}
    for name, fn in arms.items():
        t0 = time.perf_counter()
        out[name] = fn()
        result[f"{name}_s"] = round(time.perf_counter() - t0, 3)
    for b in ("faiss", "torch"):
        result[f"{b}_ratio"] = round(result[f"{b}_new_s"] / result[f"{b}_old_s"], 3)
        result[f"{b}_rows_changed"] = int((out[f"{b}_new"] != out[f"{b}_old"]).sum())
    assert np.array_equal(out["faiss_new"], out["torch_new"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
