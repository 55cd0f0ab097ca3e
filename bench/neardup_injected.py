"""Near-duplicates as a new user measures them: a world the scorers never saw, with copies injected.

A fresh world (`hype synth --size SIZE --seed SEED`) gains one shard of `--copies` copies of its clean
pool images, a third each re-encoded as JPEG, resized to 75% and cropped by 10% (`hype.synth.contaminate`);
it is scored with scorers trained on another world (`--scorers DIR` holding meru/ and clip/, e.g.
bench/neardup.py's OUT/scorers) and `--neardup` at the defaults (or `--set`). Reported: the copies grouped
with their source, and the other samples grouped: those in no injected family and no near-duplicate
family of the world's truth ("of another scene": grouped with no other render of their scene, since the
world draws some scenes twice).

With `--eval-copies N` (the issue's case: 50) a second shard holds copies of N evaluation images drawn at
random from every task (exact, JPEG, resized, cropped by 10%, in turn), and the run adds
`--decontaminate WORLD/eval` at its defaults: reported are the copies flagged in their source's task and
the other pool samples flagged in any task ("false flags": no other pool sample is a copy of an evaluation
image; "same scene": those whose match is its evaluation image's scene drawn again by the world).

    python bench/neardup_injected.py --scorers runs/bench-neardup/scorers [--out /tmp/hype-neardup-inj]
        [--size 1500] [--copies 75] [--eval-copies 50] [--seed 7] [--name default] [--set ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from hype.data.samples import SkipStats, iter_tar_samples
from hype.synth.contaminate import KINDS, eval_images, write_copies

SCENE = ["shape", "color", "count", "size", "position", "background", "image_kind"]  # the truth's scene


def hype(*args: str) -> None:
    subprocess.run([sys.executable, "-c", "from hype.cli import main; main()", *args], check=True)


def inject(world: Path, copies: int, seed: int) -> dict[str, str]:
    """Write the copies' shard once; {copy uid: source uid}."""
    record = world / "copies.json"
    if record.is_file():
        return json.loads(record.read_text())
    truth = pq.read_table(world / "truth.parquet", columns=["uid", "noise"]).to_pandas()
    clean = set(truth.uid[truth.noise == "clean"])
    images = []
    for tar in sorted((world / "pool" / "shards").glob("*.tar")):
        for s in iter_tar_samples(str(tar), SkipStats()):
            ext = next((e for e in ("jpg", "png", "webp") if e in s.files), None)
            uid = json.loads(s.files["json"])["uid"]
            if ext and uid in clean:
                images.append(((str(tar), s.key, s.files[ext], ext), uid))
    pick = np.random.default_rng(seed).permutation(len(images))[:copies].tolist()
    rows = write_shard(world, "zz-copies", [images[i][0] for i in pick], ("jpeg", "resized", "crop10"))
    source = {row["uid"]: images[i][1] for row, i in zip(rows, pick, strict=True)}
    record.write_text(json.dumps(source))
    return source


def write_shard(world: Path, name: str, images: list, kinds: tuple[str, ...]) -> list[dict]:
    """One pool shard `name`.tar of a copy of each image, of `kinds` in turn; the copies' truth rows."""
    rows = []
    with tarfile.open(world / "pool" / "shards" / f"{name}.tar", "w") as out:
        for n, image in enumerate(images):
            part = world / f"{name}-{n}.tar"
            rows += write_copies([image], part, kinds=(kinds[n % len(kinds)],), seed=n, root=world)
            with tarfile.open(part) as one:
                for member in one.getmembers():
                    data = one.extractfile(member)
                    member.name = member.name.replace("c000000", f"c{n:06d}")  # keys unique in the shard
                    out.addfile(member, data)
            part.unlink()
    return rows


def inject_eval(world: Path, copies: int, seed: int) -> pd.DataFrame:
    """Write the evaluation copies' shard once; their truth rows (uid, kind, task, eval_key)."""
    from hype.scoring.stage_decontam import task_name

    record = world / "eval-copies.json"
    if not record.is_file():
        tars = sorted(str(t) for t in (world / "eval").glob("wds_*/test/*.tar"))
        images = eval_images(tars)
        pick = np.random.default_rng(seed).permutation(len(images))[:copies].tolist()
        rows = write_shard(world, "zz-eval-copies", [images[i] for i in pick], KINDS)
        record.write_text(json.dumps(rows))
    truth = pd.DataFrame(json.loads(record.read_text()))
    return truth.assign(task=[task_name(str(Path(s).parent.parent)) for s in truth.eval_shard])


def decontam_result(score: Path, world: Path, truth: pd.DataFrame) -> dict:
    """Copies flagged in their source's task, other samples flagged, and how many of those are their
    evaluation image's scene drawn again (bench/decontam.py's `clean_scenes`)."""
    spec = importlib.util.spec_from_file_location("bench_decontam", Path(__file__).with_name("decontam.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    m = pd.read_parquet(score / "decontam" / "matches.parquet")
    found = m.merge(truth, on=["uid", "task", "eval_key"]).uid.nunique()
    pool = pq.read_table(score / "scores", columns=["uid"]).num_rows
    flagged = m[~m.uid.isin(truth.uid)].uid.nunique()
    threshold = json.loads((score / "decontam" / "matches.json").read_text())["copy_check"]["threshold"]
    same = bench.clean_scenes(score, world, (threshold,)).same_scene.iloc[0]
    share = flagged / (pool - len(truth))
    return {"eval_copies": len(truth), "eval_found": found, "false_flags": flagged,
            "false_flags_share": share, "false_flags_same_scene": int(same)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scorers", type=Path, required=True, help="a folder with meru/ and clip/ checkpoints")
    p.add_argument("--out", type=Path, default=Path("/tmp/hype-neardup-inj"))
    p.add_argument("--size", type=int, default=1500)
    p.add_argument("--copies", type=int, default=75)
    p.add_argument("--eval-copies", type=int, default=0, help="copies of evaluation images: decontaminate")
    p.add_argument("--seed", type=int, default=7, help="the world's and the copies' seed")
    p.add_argument("--name", default="default", help="the scored run's name under OUT")
    p.add_argument("--set", nargs="*", default=[], help="more hype score settings")
    args = p.parse_args()
    world = args.out / "world"
    if not (world / "world.json").is_file():
        hype("synth", "--out", str(world), "--size", str(args.size), "--clean-size", "200",
             "--seed", str(args.seed), "--no-progress")  # fmt: skip
    source = inject(world, args.copies, args.seed)
    eval_truth = inject_eval(world, args.eval_copies, args.seed) if args.eval_copies else None
    decontam = ["--decontaminate", str(world / "eval")] if args.eval_copies else []
    score = args.out / args.name
    hype("score", "--pool", str(world / "pool" / "shards"), "--out", str(score), "--config", "tiny",
         "--meru", str(args.scorers / "meru" / "model.safetensors"),
         "--clip", str(args.scorers / "clip" / "model.safetensors"),
         "--class-images", str(world / "eval" / "reference" / "train"), "--no-progress", "--neardup",
         *decontam, *args.set)  # fmt: skip
    groups = pq.read_table(score / "neardup" / "groups.parquet").to_pandas()
    group = dict(zip(groups.uid, groups.group, strict=True))
    truth = pq.read_table(world / "truth.parquet", columns=["uid", "noise", "source_uid", *SCENE]).to_pandas()
    scene = {u: tuple(r) for u, r in zip(truth.uid, truth[SCENE].itertuples(index=False), strict=True)}
    scene |= {c: scene[s] for c, s in source.items()}
    dups = truth[truth.noise == "near_duplicate"]
    in_family = set(source) | set(source.values()) | set(dups.uid) | set(dups.source_uid)
    found = sum(c in group and group[c] == group.get(s) for c, s in source.items())
    others = groups[~groups.uid.isin(in_family)]
    members = groups.groupby("group").uid.apply(list)
    pairs = zip(others.uid, others.group, strict=True)
    # an evaluation image's copy has no scene in the truth (None)
    alone = sum([scene.get(v) for v in members[g]].count(scene.get(u)) == 1 for u, g in pairs)
    pool = pq.read_table(score / "scores", columns=["uid"]).num_rows
    result = {"name": args.name, "set": args.set, "pool": pool, "copies": len(source), "found": found,
              "others_grouped": len(others), "others_share": len(others) / (pool - len(in_family)),
              "other_scenes_grouped": alone, "members": len(groups)}  # fmt: skip
    if eval_truth is not None:
        result |= decontam_result(score, world.resolve(), eval_truth)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{args.name}: copies grouped with their source {found}/{len(source)}; other samples grouped "
        f"{len(others)} ({result['others_share']:.2%} of {pool - len(in_family):,}), {alone} of another "
        f"scene; {len(groups):,} of {pool:,} samples in groups"
    )
    if eval_truth is not None:
        print(
            f"decontamination: evaluation copies flagged {result['eval_found']}/{result['eval_copies']}; "
            f"other samples flagged {result['false_flags']} ({result['false_flags_share']:.2%}), "
            f"{result['false_flags_same_scene']} of them their evaluation image's scene drawn again"
        )


if __name__ == "__main__":
    main()
