"""The pixel copy check (`hype.scoring.copydetect`) on a world's true near-duplicate pairs and on hard
non-copies: how many of each it passes, which of its terms fails a true pair, and the jitter behind it.

    python bench/copy_check_recall.py WORLD [WORLD ...] [--score SCORE ...] [--neighbours 10]
        [--set scales=0.95,0.9 steps=5 ...] [--out FILE.json]

WORLD is a synthetic world (`hype synth`: truth.parquet, pool/images/<uid>.jpg, world.json), read only.
True pairs: every pair within a copy family (the components of the truth's (near-duplicate, source)
pairs: what the near-duplicate stage should group). Hard non-pairs: each pool sample's `--neighbours`
nearest samples by the tiny CLIP's image features (SCORE/embed, default WORLD/../score) outside its copy
family; "of another scene" excludes the pairs whose truth scene (shape, colour, count, size, position,
background, kind) is the same (the world draws some scenes twice: copies by content that the truth does
not list). Printed: the pass rate of each at copy thresholds 0.8 to 0.95 (a check's second search is
relative to no threshold: one run serves all); the pair recall if every true pair were checked and the
passing ones united (the check's cap on the near-duplicate stage's pair recall); for the true pairs below
`--threshold` (the check's default), which term is lowest at their best window (colour NCC, a channel's
contrast, edge NCC), their background, and their jitter (replayed from the world's plan: the crop of each
side as a share of the source's side, its anisotropy |crop x - crop y|, the brightness factor, resized or
not). `--set` evaluates other `CopyCheck` settings (the same pairs).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from dataclasses import fields
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]  # bench/ holds scripts

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from hype.scoring.copydetect import CopyCheck, pair_similarities, terms, thumbnails, work_image  # noqa: E402

THRESHOLDS = (0.8, 0.85, 0.875, 0.9, 0.925, 0.95)
SCENE = ("shape", "color", "count", "size", "position", "background", "image_kind")
TERMS = ("colour", "contrast", "edges")


def _neardup_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_neardup", os.path.join(HERE, "neardup.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def jitters(world: Path) -> pd.DataFrame:
    """Per near-duplicate uid, its jitter replayed from the world's plan (`hype.synth.render.jitter`'s draws
    in its order)."""
    from hype.synth.render import jitter_crop
    from hype.synth.world import replay_plan

    plan = replay_plan(world)
    rows = []
    for s in plan.pool:
        if s.dup_seed is None:
            continue
        rng = np.random.default_rng(s.dup_seed)
        dx0, dy0, dx1, dy1 = jitter_crop(s.width, s.height, rng)
        bright = float(rng.uniform(0.88, 1.12))
        crop_x, crop_y = (dx0 + dx1) / s.width, (dy0 + dy1) / s.height
        rows.append(
            {"uid": s.uid, "crop_x": crop_x, "crop_y": crop_y, "aniso": abs(crop_x - crop_y),
             "bright": bright, "resized": bool(rng.random() < 0.4)}
        )  # fmt: skip
    return pd.DataFrame(rows)


def hard_non_pairs(score: Path, family: dict[str, int], index: dict[str, int], k: int) -> np.ndarray:
    """(n, 2) unordered pairs of row indices: each sample's k nearest by CLIP image features outside its
    copy family."""
    from hype.scoring.embed_format import read_columns, read_embeddings

    uids, feats = [], []
    for f in sorted(glob.glob(str(score / "embed" / "*.parquet"))):
        uids += read_columns(f, ["uid"]).column("uid").to_pylist()
        feats.append(read_embeddings(f, "clip_img"))
    table = pd.DataFrame({"uid": uids, "row": range(len(uids))}).drop_duplicates("uid")
    table = table[table.uid.isin(index)]
    x = np.concatenate(feats)[table.row.to_numpy()].astype(np.float64)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    rows = np.array([index[u] for u in table.uid])
    fam = np.array([family.get(u, -1 - i) for i, u in enumerate(table.uid)])
    sim = x @ x.T
    sim[fam[:, None] == fam[None, :]] = -np.inf  # itself and its copy family
    near = np.argsort(-sim, axis=1)[:, :k]
    pairs = np.sort(np.stack([np.repeat(rows, k), rows[near.ravel()]], axis=1), axis=1)
    return np.unique(pairs, axis=0)


def transitive_recall(true: np.ndarray, passed: np.ndarray) -> float:
    """Share of the true pairs joined in one group when the near-duplicate stage checks every true pair
    and unites those that pass (connected components): the check's cap on pair recall."""
    parent = {}

    def find(u: int) -> int:
        while parent.setdefault(u, u) != u:
            u = parent[u]
        return u

    for i, j in true[passed]:
        parent[find(i)] = find(j)
    return float(np.mean([find(i) == find(j) for i, j in true]))


def best_terms(images: np.ndarray, pairs: np.ndarray, check: CopyCheck) -> np.ndarray:
    """(n, 3) the terms at each pair's best window (either direction), as the check picks it."""
    out = np.zeros((len(pairs), 3))
    for n, (i, j) in enumerate(pairs):
        a, b = thumbnails(images[i], check), thumbnails(images[j], check)
        best = -np.inf
        for whole, wins in ((a, b), (b, a)):
            t = np.stack([x[0] for x in terms((whole[0][:1], whole[1][:1]), wins, check)])
            w = int(t.min(axis=0).argmax())
            if t[:, w].min() > best:
                best, out[n] = t[:, w].min(), t[:, w]
    return out


def measure(world: Path, score: Path, check: CopyCheck, k: int) -> dict:
    import pyarrow.parquet as pq

    nd = _neardup_module()
    truth = pq.read_table(world / "truth.parquet", columns=["uid", "noise", "source_uid", *SCENE]).to_pandas()
    families = nd.true_groups(truth)
    family = {u: i for i, g in enumerate(families) for u in g}
    index = {u: i for i, u in enumerate(truth.uid)}
    t0 = time.perf_counter()
    files = [world / "pool" / "images" / f"{u}.jpg" for u in truth.uid]
    images = np.stack([work_image(f.read_bytes(), check.work_side) for f in files])
    true = np.array(sorted((index[a], index[b]) for a, b in nd.group_pairs(families)))
    hard = hard_non_pairs(score, family, index, k)
    scene = [tuple(r) for r in truth[list(SCENE)].itertuples(index=False)]
    other_scene = np.array([scene[i] != scene[j] for i, j in hard])
    t1 = time.perf_counter()
    sim_true = pair_similarities(images, images, true, check)
    sim_hard = pair_similarities(images, images, hard, check)
    seconds = time.perf_counter() - t1
    rates = [
        {"threshold": t, "true_pass": float((sim_true >= t).mean()),
         "hard_pass": float((sim_hard >= t).mean()),
         "hard_other_scene_pass": float((sim_hard[other_scene] >= t).mean()),
         "hard_other_scene_passed": int((sim_hard[other_scene] >= t).sum())}
        for t in THRESHOLDS
    ]  # fmt: skip
    low = np.flatnonzero(sim_true < check.threshold)
    low_terms = best_terms(images, true[low], check.fine() if check.refine_from is not None else check)
    uid = truth.uid.to_numpy()
    jit = jitters(world).set_index("uid")
    copy_of = [a if a in jit.index else b for a, b in zip(uid[true[:, 0]], uid[true[:, 1]], strict=True)]
    pairs = (
        jit.loc[copy_of]
        .reset_index()
        .assign(similarity=sim_true, background=truth.background.to_numpy()[true[:, 0]])
    )
    failing = pairs.iloc[low].assign(lowest=[TERMS[i] for i in low_terms.argmin(axis=1)])
    for n, name in enumerate(TERMS):
        failing[name] = low_terms[:, n]
    return {
        "world": str(world),
        "true_pairs": len(true),
        "hard_pairs": len(hard),
        "hard_other_scene": int(other_scene.sum()),
        "check": check.settings(),
        "load_seconds": t1 - t0,
        "check_seconds": seconds,
        "rates": rates,
        "pair_recall_cap": transitive_recall(true, sim_true >= check.threshold),
        "failing": failing,
        "pairs": pairs,
    }


def report(r: dict, threshold: float) -> None:
    print(f"\n{r['world']}: {r['true_pairs']} true pairs, {r['hard_pairs']} hard non-pairs "
          f"({r['hard_other_scene']} of another scene); check {r['check_seconds']:.1f} s")  # fmt: skip
    print(pd.DataFrame(r["rates"]).to_string(index=False, float_format="%.3f"))
    cap = r["pair_recall_cap"]
    print(f"pair recall if every true pair were checked (transitive, at {threshold}): {cap:.3f}")
    f, p = r["failing"], r["pairs"]
    print(f"{len(f)} true pairs below {threshold}; lowest term: {f.lowest.value_counts().to_dict()}")
    print(f"  background (failing / all): {f.background.value_counts().to_dict()} / "
          f"{p.background.value_counts().to_dict()}")  # fmt: skip
    for name, cut in (("aniso", 0.05), ("crop_x", 0.08), ("crop_y", 0.08)):
        print(f"  {name} >= {cut}: failing {(f[name] >= cut).mean():.2f}, all {(p[name] >= cut).mean():.2f}")
    print(f"  resized: failing {f.resized.mean():.2f}, all {p.resized.mean():.2f}; bright > 1.06: failing "
          f"{(f.bright > 1.06).mean():.2f}, all {(p.bright > 1.06).mean():.2f}")  # fmt: skip
    cols = ["similarity", "lowest", *TERMS, "background", "crop_x", "crop_y", "bright", "resized"]
    print(f.sort_values("similarity")[cols].head(12).to_string(index=False, float_format="%.3f"))


def _setting(text: str) -> tuple[str, object]:
    """name=value of a `CopyCheck` field, parsed as its default's type."""
    name, value = text.split("=", 1)
    default = {f.name: f.default for f in fields(CopyCheck)}[name]
    if isinstance(default, tuple):
        return name, tuple(float(v) for v in value.split(","))
    return name, value.lower() in ("1", "true") if isinstance(default, bool) else type(default)(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("worlds", nargs="+", type=Path)
    ap.add_argument("--score", nargs="*", type=Path, help="score folders [default: WORLD/../score]")
    ap.add_argument("--neighbours", type=int, default=10)
    ap.add_argument("--set", nargs="*", default=[], help="CopyCheck settings: scales=0.95,0.9 steps=5")
    ap.add_argument("--out", type=Path, help="write the pass rates as JSON")
    args = ap.parse_args()
    check = CopyCheck(**dict(_setting(s) for s in args.set))
    results = []
    for n, world in enumerate(args.worlds):
        score = args.score[n] if args.score else world.parent / "score"
        r = measure(world, score, check, args.neighbours)
        report(r, check.threshold)
        results.append({k: v for k, v in r.items() if k not in ("failing", "pairs")})
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
