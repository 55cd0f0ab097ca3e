"""Where the near-duplicate stage loses a world's true pairs, and what other candidate settings would give.

Reads a run that `bench/neardup.py` scored (OUT/score, with the copy check: its split holds every row once
per cluster it is searched in, with its feature, work image and, from #37 item 5's fourth pass on, its
pixel descriptor) and the world's truth. For every true pair (within a true family, as bench/neardup.py):

    share one of n        the two rows' n nearest clusters meet (n = 1..4: what `neardup.assign` = n sees;
                          the run's partition: pixel or CLIP clusters)
    in a shared cluster   the two rows are searched in one cluster by the run (`neardup.assign`)
    cosine >= threshold   float64 cosine of the CLIP image features
    CLIP candidate        one is among the other's `neardup.candidates` nearest by cosine in a shared cluster
    pixel candidate       ... among its `neardup.pixel_candidates` nearest by pixel descriptor
    either                the union: what the copy check sees
    copy check passes     copy similarity >= `neardup.copy_threshold` (every true pair checked)
    candidate + check     both: an edge of the stage's graph
    found (pair recall)   the run's groups hold both (transitively)

Then `--sweep`: the stage's candidates rebuilt per cluster from the split (`nearest_pairs`, the stage's
own function) for each (candidates, pixel_candidates[, assign: each sample in its n nearest clusters
instead of the run's]) and copy threshold, checked (copy similarities cached), grouped by uid, and
measured as bench/neardup.py does: copies found, others grouped (and their share).

    python bench/neardup_loss.py --run OUT/score --world WORLD [--sweep 10:0,10:10,0:10,10:10:3]
        [--copy-thresholds 0.9] [--threshold 0.9] [--time-check]

`--time-check`: the run's candidate pairs (CLIP and pixel, as the stage builds them) checked by the check
before #37 item 5's seventh pass (64-px work images, 28-px edges) and by the stage's
(`stage_neardup.copy_check`), one after the other in this process, best of 2: seconds and their ratio.

Prints both tables and writes RUN/../neardup_loss.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]  # bench/ holds scripts


def _bench_neardup():
    spec = importlib.util.spec_from_file_location("bench_neardup", os.path.join(HERE, "neardup.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def read_split(run: Path) -> dict:
    """The split's rows (a row once per cluster it is searched in): uid, cluster searched, unit feature,
    work image and pixel descriptor (computed from the work image when the run has none)."""
    from hype.scoring import embed_format
    from hype.scoring.neardup import normalize_rows, pixel_descriptors
    from hype.scoring.stage_neardup import WORK_SIDE

    parts = [pq.read_table(f) for f in sorted((run / "neardup_split").glob("*.parquet"))]
    t = pa.concat_tables(parts).combine_chunks()
    work = np.frombuffer(b"".join(t.column("work").to_pylist()), np.uint8).reshape(
        -1, WORK_SIDE, WORK_SIDE, 3
    )
    if "pixel" in t.column_names:
        pixels = np.frombuffer(b"".join(t.column("pixel").to_pylist()), np.int8).reshape(t.num_rows, -1)
    else:
        pixels = pixel_descriptors(work)
    return {
        "uid": np.array(t.column("uid").to_pylist()),
        "within": t.column("within").to_numpy(),
        "x": normalize_rows(embed_format.fixed_list_to_numpy(t.column("clip_img"))),
        "work": work,
        "pixels": pixels,
    }


def nearest_clusters(run: Path, split: dict, n: int) -> np.ndarray:
    """Each split row's `n` nearest centroids (float64 products): what `neardup.assign` = n would search
    (the stage's own rule breaks exact ties the same way). A run partitioned by pixels
    (`neardup.partition=pixel`): its pixel centroids, by unit pixel descriptor (`pixel_units`); else by
    CLIP feature, c_IN's centroids when the run has them (reused), else the stage's own."""
    from hype.scoring.neardup import normalize_rows, pixel_units

    info = json.loads((run / "summary.json").read_text()).get("neardup") or {}
    pixel = info.get("partition") == "pixel"
    cin = run / "clusters" / "centroids.npy"
    reused = not pixel and cin.is_file() and info.get("clusters_from") != "own k-means"
    c = normalize_rows(np.load(cin if reused else run / "neardup" / "centroids.npy"))
    rows = pixel_units(split["pixels"]) if pixel else split["x"]
    return np.argsort(-(rows.astype(np.float64) @ c.astype(np.float64).T), axis=1, kind="stable")[:, :n]


def searched(split: dict, nearest: np.ndarray, assign: int) -> dict:
    """The split's rows as `neardup.assign=assign` would search them: each sample once in each of its
    `assign` nearest clusters (`nearest_clusters`); 0: the run's own split."""
    if not assign:
        return split
    first = np.unique(split["uid"], return_index=True)[1]
    rows = np.repeat(first, assign)
    return {k: split[k][rows] for k in ("uid", "x", "pixels")} | {"within": nearest[first, :assign].ravel()}


def candidates(split: dict, threshold: float, k: int, pixel_k: int) -> set[tuple[str, str]]:
    """The stage's copy-check candidates (uid pairs, sorted) of each cluster of the split."""
    from hype.scoring.neardup import nearest_pairs

    out = set()
    for c in np.unique(split["within"]):
        rows = np.flatnonzero(split["within"] == c)
        if len(rows) < 2:
            continue
        a, b, _ = nearest_pairs(split["x"][rows], threshold, k, pixels=split["pixels"][rows], pixel_k=pixel_k)
        ua, ub = split["uid"][rows[a]], split["uid"][rows[b]]
        out |= {(min(p, q), max(p, q)) for p, q in zip(ua.tolist(), ub.tolist(), strict=True) if p != q}
    return out


def copy_sims(split: dict, pairs: list[tuple[str, str]]) -> dict[tuple[str, str], float]:
    from hype.scoring.config import NeardupConfig
    from hype.scoring.copydetect import pair_similarities
    from hype.scoring.stage_neardup import copy_check

    row = {u: i for i, u in enumerate(split["uid"].tolist())}  # any copy of the row: same work image
    at = np.array([(row[a], row[b]) for a, b in pairs], np.int64).reshape(-1, 2)
    sims = pair_similarities(split["work"], split["work"], at, copy_check(NeardupConfig()))  # the stage's
    return dict(zip(pairs, sims.tolist(), strict=True))


def time_checks(split: dict, pairs: list[tuple[str, str]]) -> dict:
    """Seconds (best of 2) of the previous check and the stage's on `pairs`, one after the other. The
    previous: the sixth session's (64-px work images, here the 2 x 2 means of the split's 128-px ones; 28-px
    edges; the third search from 0.85)."""
    from hype.scoring.config import NeardupConfig
    from hype.scoring.copydetect import CopyCheck, pair_similarities
    from hype.scoring.stage_neardup import copy_check

    row = {u: i for i, u in enumerate(split["uid"].tolist())}
    at = np.array([(row[a], row[b]) for a, b in pairs], np.int64).reshape(-1, 2)
    out = {"pairs": len(at)}
    work = split["work"]
    small = work.reshape(len(work), 64, 2, 64, 2, 3).mean(axis=(2, 4)).round().astype(np.uint8)
    previous = CopyCheck(work_side=64, edge_size=28, local_step=0.0075, local_radius=2, local_from=0.85)
    for name, check, images in (("previous", previous, small), ("stage", copy_check(NeardupConfig()), work)):
        best = []
        for _ in range(2):
            t0 = time.perf_counter()
            pair_similarities(images, images, at, check)
            best.append(time.perf_counter() - t0)
        out[name] = round(min(best), 1)
    out["ratio"] = round(out["stage"] / out["previous"], 2)
    print(
        f"copy check on {len(at):,} candidate pairs: previous {out['previous']} s, "
        f"the stage's {out['stage']} s ({out['ratio']}x)"
    )
    return out


def components(edges: list[tuple[str, str]]) -> dict[str, str]:
    parent: dict[str, str] = {}

    def find(u: str) -> str:
        while parent.setdefault(u, u) != u:
            parent[u] = parent[parent[u]]
            u = parent[u]
        return u

    for a, b in edges:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return {u: find(u) for u in list(parent)}


def outcome(edges: list[tuple[str, str]], family: dict[str, int], dups: list[str], n: int) -> dict:
    """bench/neardup.py's columns for the groups of `edges`: copies found, others grouped, pair recall."""
    root = components(edges)
    groups: dict[str, list[str]] = {}
    for u, r in root.items():
        groups.setdefault(r, []).append(u)
    right = {u for g in groups.values() for u in g if sum(family.get(v, -1) == family.get(u) for v in g) > 1}
    others = sum(u not in family for g in groups.values() for u in g if len(g) > 1)
    return {
        "dups_found": len(right & set(dups)) / max(1, len(dups)),
        "others_grouped": others,
        "others_grouped_share": others / max(1, n - len(family)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, required=True, help="a scored run with the copy check (OUT/score)")
    p.add_argument("--world", type=Path, required=True)
    p.add_argument("--threshold", type=float, default=0.9, help="neardup.threshold (cosine)")
    p.add_argument("--candidates", type=int, default=10)
    p.add_argument("--pixel-candidates", type=int, default=10)
    p.add_argument("--copy-threshold", type=float, default=0.9)
    p.add_argument("--sweep", default="", help="candidates:pixel_candidates,... to rebuild and measure")
    p.add_argument("--copy-thresholds", default="0.9", help="copy thresholds of the sweep")
    p.add_argument("--time-check", action="store_true", help="time the stage's check against the previous")
    args = p.parse_args()
    bn = _bench_neardup()
    t0 = time.perf_counter()
    truth = pq.read_table(args.world / "truth.parquet", columns=["uid", "noise", "source_uid"]).to_pandas()
    families = bn.true_groups(truth)
    family = {u: i for i, g in enumerate(families) for u in g}
    dups = truth.uid[truth.noise == "near_duplicate"].tolist()
    split = read_split(args.run)
    present = set(split["uid"].tolist())
    true_pairs = sorted(q for q in bn.group_pairs(families) if q[0] in present and q[1] in present)
    clusters: dict[str, set] = {}
    for u, c in zip(split["uid"].tolist(), split["within"].tolist(), strict=True):
        clusters.setdefault(u, set()).add(c)
    row = {u: i for i, u in enumerate(split["uid"].tolist())}
    x = split["x"].astype(np.float64)
    cos = np.array([x[row[a]] @ x[row[b]] for a, b in true_pairs])
    clip = candidates(split, args.threshold, args.candidates, 0)
    pix = candidates(split, args.threshold, 0, args.pixel_candidates) if args.pixel_candidates else set()
    nearest = nearest_clusters(args.run, split, 4)
    sweep = [(*(int(v) for v in s.split(":")), 0)[:3] for s in args.sweep.split(",") if s]
    built = {s: candidates(searched(split, nearest, s[2]), args.threshold, *s[:2]) for s in sweep}
    cache = copy_sims(split, sorted(set(true_pairs).union(clip, pix, *built.values())))
    timed = time_checks(split, sorted(clip | pix)) if args.time_check else None
    check = np.array([cache[q] >= args.copy_threshold for q in true_pairs])
    shared = np.array([bool(clusters[a] & clusters[b]) for a, b in true_pairs])
    ia, ib = (np.array([row[q[side]] for q in true_pairs], np.int64) for side in (0, 1))
    share = {n: (nearest[ia, :n, None] == nearest[ib, None, :n]).any(axis=(1, 2)) for n in (1, 2, 3, 4)}
    is_clip = np.array([q in clip for q in true_pairs])
    is_pix = np.array([q in pix for q in true_pairs])
    g = pq.read_table(args.run / "neardup" / "groups.parquet", columns=["uid", "group"]).to_pandas()
    group = dict(zip(g.uid, g.group, strict=True))
    found = np.array([a in group and group.get(a) == group.get(b) for a, b in true_pairs])
    steps = {
        **{f"share one of their {n} nearest clusters": share[n] for n in (1, 2, 3, 4)},
        "in a shared cluster (the run's)": shared,
        f"cosine >= {args.threshold:g}": cos >= args.threshold,
        f"CLIP candidate ({args.candidates} nearest)": is_clip,
        f"pixel candidate ({args.pixel_candidates} nearest)": is_pix,
        "either (what the copy check sees)": is_clip | is_pix,
        f"copy check passes (>= {args.copy_threshold:g})": check,
        "candidate and check passes": (is_clip | is_pix) & check,
        "found by the run (pair recall)": found,
    }
    print(f"{len(true_pairs):,} true pairs in the split ({args.run})\n")
    print("| step | share of true pairs |\n|---|---|")
    for name, ok in steps.items():
        print(f"| {name} | {ok.mean():.3f} |")
    rows = []
    for ct in (float(v) for v in args.copy_thresholds.split(",")):
        for s in sweep:
            edges = [q for q in built[s] if cache[q] >= ct]
            rows.append({"candidates": s[0], "pixel_candidates": s[1], "assign": s[2] or "run's",
                         "copy_threshold": ct, "checked_pairs": len(built[s]),
                         **outcome(edges, family, dups, len(truth))})  # fmt: skip
    if rows:
        head = "| candidates | pixel candidates | assign | copy threshold | pairs checked | copies found"
        print(f"\n{head} | others grouped |\n" + "|---" * 7 + "|")
        for r in rows:
            print(f"| {r['candidates']} | {r['pixel_candidates']} | {r['assign']} | "
                  f"{r['copy_threshold']:g} | {r['checked_pairs']:,} | {r['dups_found']:.3f} | "
                  f"{r['others_grouped']:,} ({r['others_grouped_share']:.2%}) |")  # fmt: skip
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "true_pairs": len(true_pairs),
              "steps": {k: float(v.mean()) for k, v in steps.items()}, "sweep": rows, "time_check": timed,
              "elapsed_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    out = args.run.parent / "neardup_loss.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out} ({result['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main()
