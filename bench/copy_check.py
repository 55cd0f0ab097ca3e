"""The pixel copy check's pair throughput (`hype.scoring.copydetect.pair_similarities`) against the same
work done the simple way in the same process: one image at a time, BLAS on its default threads.

    python bench/copy_check.py [--pairs 20000] [--busy 0] [--repeats 3]

Random work images (the cost does not depend on the pixels): `--pairs` pairs between 400 and 500 images,
each image's windows computed once for all its pairs in both arms. `--busy N` starts N processes that spin
on the CPU for the whole bench (a machine shared with other work, as CI's and clusters' are): small BLAS
products on BLAS's own threads slow down most there. The two arms' results must be the same bytes (every
sum of the check is exact: BLAS's threads and blocking cannot change it). Prints the best of `--repeats`
for each arm and their ratio.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import numpy as np

from hype.scoring.copydetect import CopyCheck, _match, pair_similarities, thumbnails


def baseline(a: np.ndarray, b: np.ndarray, pairs: np.ndarray, check: CopyCheck) -> np.ndarray:
    """The same similarities, one image at a time on the calling thread, BLAS threads as numpy set them."""
    out = np.full(len(pairs), -1.0, np.float32)
    wholes = []
    for side, images in enumerate((a, b)):
        used = np.unique(pairs[:, side])
        rows = [thumbnails(images[i], check, whole_only=True) for i in used.tolist()]
        wholes.append((used, tuple(np.concatenate([r[p] for r in rows]) for p in range(2))))
    for side, images in enumerate((a, b)):
        col = pairs[:, side]
        used, rows = wholes[1 - side]
        order = np.argsort(col, kind="stable")
        for group in np.split(order, np.flatnonzero(np.diff(col[order])) + 1):
            at = np.searchsorted(used, pairs[group, 1 - side])
            found = _match((rows[0][at], rows[1][at]), thumbnails(images[col[group[0]]], check), check)
            out[group] = np.maximum(out[group], found)
    return out


def best_of(fn, repeats: int) -> tuple[float, np.ndarray]:
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=20000)
    ap.add_argument("--busy", type=int, default=0, help="CPU-spinning processes beside the bench")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    check = CopyCheck()  # the stages' (128-px work images); random images never reach the later searches
    side = (check.work_side, check.work_side, 3)
    a = rng.integers(0, 256, (400, *side), dtype=np.uint8)
    b = rng.integers(0, 256, (500, *side), dtype=np.uint8)
    pairs = np.stack([rng.integers(0, len(a), args.pairs), rng.integers(0, len(b), args.pairs)], axis=1)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        t_base, ref = best_of(lambda: baseline(a, b, pairs, check), args.repeats)
        t_new, got = best_of(lambda: pair_similarities(a, b, pairs, check), args.repeats)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    diff = float(np.abs(got - ref).max())
    assert got.tobytes() == ref.tobytes(), f"the arms disagree by {diff}"
    print(f"{args.pairs} pairs, {args.busy} busy processes, best of {args.repeats}:")
    print(f"  one image at a time, BLAS threads: {t_base:.2f} s ({args.pairs / t_base:,.0f} pairs/s)")
    print(f"  pair_similarities:                 {t_new:.2f} s ({args.pairs / t_new:,.0f} pairs/s)")
    print(f"  ratio (baseline / new): {t_base / t_new:.2f}x; largest difference {diff:.1e}")


if __name__ == "__main__":
    main()
