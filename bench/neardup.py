"""Near-duplicate detection on the synthetic world: precision and recall against its truth table.

The world's pool holds near-duplicates (jittered, re-encoded copies of clean samples, half with another
caption; `hype.synth.pool`), each with the uid of its source in `truth.parquet`. The true duplicate
groups are the connected components of (copy, source) pairs; the true pairs, every pair within a true
group. `hype score` runs its near-duplicate stage once at the lowest threshold (`neardup.enabled=true`,
reusing c_IN's k-means), and every higher threshold is regrouped from the stored spanning forest, exactly
as `hype select --filter dedup:threshold=T` does. For each threshold: the predicted pairs (every pair
within a predicted group), precision and recall of the true pairs, the share of near-duplicate samples
grouped with their source and with any of their family ("dups found"), the samples in no true family that
are grouped ("others grouped"; "of another scene": those grouped with no other render of their scene,
since the world draws some scenes twice; "crop-alike": those grouped with a render of their scene that
differs as a copy's crop would, `hype.synth.scenes.crop_alike`, which no pixel check can tell from a copy),
and what `--filter dedup` (keeper hype) would remove, by noise
kind. The stage runs with its copy check (the default); `--set neardup.copy_check=false` measures
cosine-only groups.

The world and scorers are bench/quality.py's (same code: synth, the tiny MERU and CLIP scorers trained on
the clean set, `hype score --config tiny`), at the demo's size by default:

    python bench/neardup.py [--out runs/bench-neardup] [--size 2000] [--clean-size 2000]
        [--thresholds 0.90,0.95,0.99] [--set neardup.candidates=20 ...]

Prints the table and writes OUT/neardup.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from itertools import combinations
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]  # bench/ holds scripts


def _quality_module():
    spec = importlib.util.spec_from_file_location("bench_quality", os.path.join(HERE, "quality.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SCENE = ("shape", "color", "count", "size", "position", "background", "image_kind")  # the truth's scene


def group_pairs(groups: list[list[str]]) -> set[tuple[str, str]]:
    """Every unordered pair within each group."""
    return {tuple(sorted(p)) for g in groups for p in combinations(g, 2)}


def true_groups(truth) -> list[list[str]]:
    """Components of the (near-duplicate, source) pairs of the truth table."""
    parent: dict[str, str] = {}

    def find(u: str) -> str:
        while parent.setdefault(u, u) != u:
            u = parent[u]
        return u

    dups = truth[truth.noise == "near_duplicate"]
    for u, s in zip(dups.uid, dups.source_uid, strict=True):
        ru, rs = find(u), find(s)
        if ru != rs:
            parent[max(ru, rs)] = min(ru, rs)
    out: dict[str, list[str]] = {}
    for u in list(parent):
        out.setdefault(find(u), []).append(u)
    return [g for g in out.values() if len(g) >= 2]


def measure(score: Path, truth, thresholds: list[float], scenes: dict | None = None) -> list[dict]:
    """The table's rows; with `scenes` (uid -> the plan's `Scene`, `replay_plan`), also the other samples
    grouped with a render that differs from theirs as a copy's crop would (`crop_alike`): in pixels,
    copies."""
    from hype.data.uids import pair_to_uid
    from hype.scoring.stage_neardup import read_groups, regroup
    from hype.synth.scenes import crop_alike

    stored = read_groups(score)
    uids = [pair_to_uid(h, lo) for h, lo in zip(stored.hi, stored.lo, strict=True)]
    families = true_groups(truth)
    truth_pairs = group_pairs(families)
    family = {u: i for i, g in enumerate(families) for u in g}
    noise = dict(zip(truth.uid, truth.noise, strict=True))
    source = dict(zip(truth.uid, truth.source_uid, strict=True))
    kinds = truth.noise.value_counts().to_dict()
    dup_uids = truth.uid[truth.noise == "near_duplicate"].tolist()
    scene = dict(zip(truth.uid, zip(*(truth[c] for c in SCENE), strict=True), strict=True))
    rows = []
    for t in thresholds:
        group, keep = regroup(stored, t, "hype", 0)
        members: dict[int, list[str]] = {}
        for u, g in zip(uids, group.tolist(), strict=True):
            if g >= 0:
                members.setdefault(g, []).append(u)
        pred = group_pairs(list(members.values()))
        hit = len(pred & truth_pairs)
        with_source = sum(tuple(sorted((u, source[u]))) in pred for u in dup_uids)
        # a copy is found when its group holds another of its true family; other samples (in no family)
        # should be in no group
        right = {
            u for g in members.values() for u in g if sum(family.get(v, -1) == family.get(u) for v in g) > 1
        }
        others = sum(u not in family for g in members.values() for u in g)
        # the world also draws a scene's attributes again (its object moved, resized or turned a little, at
        # another image size: not in the truth's copies): other samples grouped with no other render of it
        alone = [
            u
            for g in members.values()
            for u in g
            if u not in family and [scene[v] for v in g].count(scene[u]) == 1
        ]
        alike = [
            u
            for g in members.values()
            for u in g
            if scenes and u not in family and any(v != u and crop_alike(scenes[u], scenes[v]) for v in g)
        ]
        removed = [noise[u] for u, k in zip(uids, keep.tolist(), strict=True) if not k]
        rows.append(
            {
                "threshold": t,
                "groups": len(members),
                "members": int((group >= 0).sum()),
                "predicted_pairs": len(pred),
                "true_pairs": len(truth_pairs),
                "precision": hit / len(pred) if pred else float("nan"),
                "recall": hit / len(truth_pairs) if truth_pairs else float("nan"),
                "dups_with_source": with_source / max(1, len(dup_uids)),
                "dups_found": len(right & set(dup_uids)) / max(1, len(dup_uids)),
                "others_grouped": others,
                "others_grouped_share": others / max(1, len(truth) - len(family)),
                "other_scenes_grouped": len(alone),
                "others_crop_alike": len(alike),
                "removed": len(removed),
                "removed_share_by_kind": {k: removed.count(k) / n for k, n in sorted(kinds.items())},
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/bench-neardup"))
    p.add_argument("--world", type=Path, help="an existing world [default: OUT/world, generated]")
    p.add_argument("--world-seed", type=int, default=0)
    p.add_argument("--size", type=int, default=2000, help="pool samples [default: the demo's]")
    p.add_argument("--clean-size", type=int, default=2000)
    p.add_argument("--num-clusters", type=int, default=48, help="c_IN's k-means K [default: the demo's]")
    p.add_argument("--thresholds", default="0.90,0.95,0.99", help="cosines: the first is the stage's")
    p.add_argument("--set", nargs="*", default=[], help="more hype score settings: neardup.candidates=20 ...")
    p.add_argument("--progress", action="store_true")
    args = p.parse_args()
    thresholds = sorted(float(t) for t in args.thresholds.split(","))

    import pyarrow.parquet as pq

    from hype.workflow import Runner

    out = args.out.resolve()
    world = (args.world or out / "world").resolve()
    t0 = time.perf_counter()
    quality = _quality_module()
    score = quality._scores(
        Runner(out / "logs", progress=args.progress),
        args,
        out,
        world,
        ("neardup.copy_check=true", f"neardup.threshold={thresholds[0]}", *args.set),
    )
    truth = pq.read_table(world / "truth.parquet", columns=["uid", "noise", "source_uid", *SCENE]).to_pandas()
    from hype.synth.world import replay_plan

    rows = measure(score, truth, thresholds, {s.uid: s.scene for s in replay_plan(world).pool})
    result = {"world": str(world), "score": str(score), "args": vars(args) | {"out": str(out)}, "rows": rows}
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)
    (out / "neardup.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    kinds = list(rows[0]["removed_share_by_kind"])
    n = len(truth)
    print(
        f"pool {n:,} samples, {rows[0]['true_pairs']:,} true duplicate pairs (precision of a random pair: "
        f"{rows[0]['true_pairs'] / (n * (n - 1) / 2):.5f}); removed share by noise kind with --filter dedup "
        "(keeper hype)\n"
    )
    head = "| threshold | groups | members | pairs | precision | recall | dups with source | dups found | "
    head += "others grouped | of another scene | crop-alike | removed | "
    print(head + " | ".join(k.replace("_", " ") for k in kinds) + " |")
    print("|" + "---|" * (12 + len(kinds)))
    for r in rows:
        cells = [
            f"{r['threshold']:g}",
            f"{r['groups']:,}",
            f"{r['members']:,}",
            f"{r['predicted_pairs']:,}",
            f"{r['precision']:.3f}",
            f"{r['recall']:.3f}",
            f"{r['dups_with_source']:.3f}",
            f"{r['dups_found']:.3f}",
            f"{r['others_grouped']:,} ({r['others_grouped_share']:.2%})",
            f"{r['other_scenes_grouped']:,}",
            f"{r['others_crop_alike']:,}",
            f"{r['removed']:,}",
        ]
        cells += [f"{r['removed_share_by_kind'][k]:.3f}" for k in kinds]
        print("| " + " | ".join(cells) + " |")
    print(f"\nwrote {out / 'neardup.json'} ({result['elapsed_s'] / 60:.1f} min)")


if __name__ == "__main__":
    main()
