"""The pixel copy check of another git revision against this tree's, on a scored run's real candidate pairs,
in one process: seconds (best of `--repeats`), their ratio, and whether the answers are the same.

    python bench/copy_check_revisions.py --run RUN --old REV [--pairs 0] [--repeats 2]

RUN is a `hype score --neardup` run directory (its `neardup_split/` holds the work images); the pairs are
the stage's candidates at the defaults (each row's 10 nearest by CLIP cosine ≥ 0.9 and its 10 nearest of
those by pixel descriptor, within each cluster searched), all of them or `--pairs` drawn by a seed (fewer
pairs per image than the stage checks: a sample understates what computing an image's windows once for all
its pairs saves). REV's `hype/scoring/copydetect.py` is loaded from git as a module of its own (the rest of
hype is this tree's).
Both stages' checks are timed: decontamination's (`CopyCheck(threshold=0.94, refine_from=None)`, on two sets
of images as pool against evaluation images; its values are stored: they must be the same bytes) and the
near-duplicate stage's (`stage_neardup.copy_check`, which only asks whether a pair reaches the threshold: this
tree's `enough=` may stop a search early, so the decisions must be the same).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]  # bench/ holds scripts


def _module(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


def old_copydetect(rev: str):
    """REV's copydetect.py as the module `copydetect_at_rev`."""
    source = subprocess.run(
        ["git", "show", f"{rev}:hype/scoring/copydetect.py"], cwd=HERE, capture_output=True, check=True
    ).stdout
    folder = tempfile.mkdtemp(prefix="copydetect-")
    path = os.path.join(folder, "copydetect_at_rev.py")
    Path(path).write_bytes(source)
    return _module("copydetect_at_rev", path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, required=True, help="a hype score --neardup run directory")
    p.add_argument("--old", required=True, help="the git revision to compare with (e.g. HEAD~5)")
    p.add_argument("--pairs", type=int, default=0, help="candidate pairs drawn (0: all)")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()

    from hype.scoring import copydetect as new
    from hype.scoring.config import NeardupConfig
    from hype.scoring.stage_neardup import copy_check

    loss = _module("bench_neardup_loss", os.path.join(HERE, "neardup_loss.py"))
    best_of = _module("bench_copy_check", os.path.join(HERE, "copy_check.py")).best_of
    split = loss.read_split(args.run)
    cands = sorted(loss.candidates(split, 0.9, 10, 0) | loss.candidates(split, 0.9, 0, 10))
    row = {u: i for i, u in enumerate(split["uid"].tolist())}
    at = np.array([(row[a], row[b]) for a, b in cands], np.int64).reshape(-1, 2)
    if args.pairs and len(at) > args.pairs:
        at = at[np.sort(np.random.default_rng(0).choice(len(at), args.pairs, replace=False))]
    work = split["work"]
    old = old_copydetect(args.old)
    print(f"{len(at):,} of {len(cands):,} candidate pairs of {args.run}; {args.old} against this tree")
    stage = copy_check(NeardupConfig())
    # decontamination checks pool images against evaluation images (two sets), the near-duplicate stage
    # pairs within one set (`a is b`: each image windowed once for both sides)
    for name, check, enough, other in (
        ("decontamination", new.CopyCheck(threshold=0.94, refine_from=None), None, work.copy()),
        ("near-duplicates", stage, stage.threshold, work),
    ):
        old_check = old.CopyCheck(**asdict(check))
        t_old, ref = best_of(lambda: old.pair_similarities(work, other, at, old_check), args.repeats)  # noqa: B023
        t_new, got = best_of(
            lambda: new.pair_similarities(work, other, at, check, enough=enough),  # noqa: B023
            args.repeats,
        )
        if enough is None:
            same = got.tobytes() == ref.tobytes()
        else:
            same = bool(np.array_equal(got >= check.threshold, ref >= check.threshold))
        print(
            f"  {name}: {args.old} {t_old:.1f} s, this tree {t_new:.1f} s, ratio (old / new) "
            f"{t_old / t_new:.2f}x; {'same bytes' if enough is None else 'same decisions'}: {same}"
        )
        assert same, f"{name}: the revisions disagree"


if __name__ == "__main__":
    main()
