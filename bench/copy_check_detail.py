"""The copy check on images with detail everywhere, which the synthetic worlds (single objects on flat or
striped backgrounds) do not have: each copy against its own source, the share passing each threshold.

    python bench/copy_check_detail.py [--images 200] [--sides 96,200]

Images of four random ellipses on a random colour (`hype.synth.render.ellipses_png`, as the copy
check's tests use), `--images` per side; their JPEG (quality 75), resized (75%) and 10% cropped copies
(`hype.synth.contaminate`, one seeded generator per image), and as many other such images, each against
one source (the highest similarity printed). Three checks: decontamination's before #37 item 5's eighth
pass (square windows only, images area-resampled), decontamination's now (`stage_decontam.search_of`),
the near-duplicate stage's (`stage_neardup.copy_check`). One thread, so the seconds compare.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from hype.scoring.config import DecontamConfig, NeardupConfig
from hype.scoring.copydetect import CopyCheck, pair_similarities, work_image
from hype.scoring.stage_decontam import search_of
from hype.scoring.stage_neardup import copy_check
from hype.synth.contaminate import _copy
from hype.synth.render import ellipses_png

THRESHOLDS = (0.9, 0.92, 0.94)
KINDS = ("jpeg", "resized", "crop10")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--sides", default="96,200", help="image sides in pixels, comma-separated")
    args = ap.parse_args()
    checks = {
        "decontamination before (square, BOX)": (
            CopyCheck(threshold=0.9, refine_from=None, local_step=None),
            False,
        ),
        "decontamination (square + third search)": (search_of(DecontamConfig()).check, True),
        "near-duplicate stage (+ second search)": (copy_check(NeardupConfig()), True),
    }
    n = args.images
    for side in (int(s) for s in args.sides.split(",")):
        sources = [ellipses_png(s, side) for s in range(n)]
        copies = {
            k: [_copy(x, "png", k, np.random.default_rng(s))[0] for s, x in enumerate(sources)] for k in KINDS
        }
        others = [ellipses_png(10_000 + s, side) for s in range(n)]
        at = ", ".join(map(str, THRESHOLDS))
        print(f"\n{side}-px images, {n} each; share of copies at or above {at} (lowest)")
        for name, (check, upsample) in checks.items():
            t0 = time.perf_counter()
            b = np.stack([work_image(x, check.work_side, upsample) for x in sources])
            row = []
            for kind, made in copies.items():
                a = np.stack([work_image(x, check.work_side, upsample) for x in made])
                sims = pair_similarities(a, b, np.stack([np.arange(n)] * 2, axis=1), check, workers=1)
                shares = " / ".join(f"{(sims >= t).mean():.3f}" for t in THRESHOLDS)
                row.append(f"{kind} {shares} ({sims.min():.3f})")
            a = np.stack([work_image(x, check.work_side, upsample) for x in others])
            pairs = np.stack([np.arange(n), (np.arange(n) + 1) % n], axis=1)
            worst = pair_similarities(a, b, pairs, check, workers=1).max()
            seconds = time.perf_counter() - t0
            print(f"  {name}: " + " | ".join(row) + f" | others at most {worst:.3f} ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
