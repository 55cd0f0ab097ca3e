"""Near-duplicates as a new user measures them: a world the scorers never saw, with copies injected.

A fresh world (`hype synth --size SIZE --seed SEED`) gains one shard of `--copies` copies of its clean
pool images, a third each re-encoded as JPEG, resized to 75% and cropped by 10% (`hype.synth.contaminate`);
it is scored with scorers trained on another world (`--scorers DIR` holding meru/ and clip/, e.g.
bench/neardup.py's OUT/scorers) and `--neardup` at the defaults (or `--set`). Reported: the copies grouped
with their source, and the other samples grouped: those in no injected family and no near-duplicate
family of the world's truth ("of another scene": grouped with no other render of their scene, since the
world draws some scenes twice).

    python bench/neardup_injected.py --scorers runs/bench-neardup/scorers [--out /tmp/hype-neardup-inj]
        [--size 1500] [--copies 75] [--seed 7] [--name default] [--set neardup.copy_check=false ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from hype.data.samples import SkipStats, iter_tar_samples
from hype.synth.contaminate import write_copies

SCENE = ["shape", "color", "count", "size", "position", "background", "image_kind"]  # the truth's scene


def hype(*args: str) -> None:
    subprocess.run([sys.executable, "-c", "from hype.cli import main; main()", *args], check=True)


def inject(world: Path, copies: int, seed: int) -> dict[str, str]:
    """Write the copies' shard once; {copy uid: source uid}."""
    tar_path, record = world / "pool" / "shards" / "zz-copies.tar", world / "copies.json"
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
    pick = np.random.default_rng(seed).permutation(len(images))[:copies]
    source = {}
    with tarfile.open(tar_path, "w") as out:
        for n, i in enumerate(pick.tolist()):
            part = world / f"copy-{n}.tar"
            row = write_copies([images[i][0]], part, kinds=(("jpeg", "resized", "crop10")[n % 3],), seed=n)[0]
            with tarfile.open(part) as one:
                for member in one.getmembers():
                    data = one.extractfile(member)
                    member.name = member.name.replace("c000000", f"c{n:06d}")  # keys unique in the shard
                    out.addfile(member, data)
            part.unlink()
            source[row["uid"]] = images[i][1]
    record.write_text(json.dumps(source))
    return source


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scorers", type=Path, required=True, help="a folder with meru/ and clip/ checkpoints")
    p.add_argument("--out", type=Path, default=Path("/tmp/hype-neardup-inj"))
    p.add_argument("--size", type=int, default=1500)
    p.add_argument("--copies", type=int, default=75)
    p.add_argument("--seed", type=int, default=7, help="the world's and the copies' seed")
    p.add_argument("--name", default="default", help="the scored run's name under OUT")
    p.add_argument("--set", nargs="*", default=[], help="more hype score settings")
    args = p.parse_args()
    world = args.out / "world"
    if not (world / "world.json").is_file():
        hype("synth", "--out", str(world), "--size", str(args.size), "--clean-size", "200",
             "--seed", str(args.seed), "--no-progress")  # fmt: skip
    source = inject(world, args.copies, args.seed)
    score = args.out / args.name
    hype("score", "--pool", str(world / "pool" / "shards"), "--out", str(score), "--config", "tiny",
         "--meru", str(args.scorers / "meru" / "model.safetensors"),
         "--clip", str(args.scorers / "clip" / "model.safetensors"),
         "--class-images", str(world / "eval" / "reference" / "train"), "--no-progress", "--neardup",
         *args.set)  # fmt: skip
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
    alone = sum([scene[v] for v in members[g]].count(scene[u]) == 1 for u, g in pairs)
    pool = pq.read_table(score / "scores", columns=["uid"]).num_rows
    result = {"name": args.name, "set": args.set, "pool": pool, "copies": len(source), "found": found,
              "others_grouped": len(others), "others_share": len(others) / (pool - len(in_family)),
              "other_scenes_grouped": alone, "members": len(groups)}  # fmt: skip
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{args.name}: copies grouped with their source {found}/{len(source)}; other samples grouped "
        f"{len(others)} ({result['others_share']:.2%} of {pool - len(in_family):,}), {alone} of another "
        f"scene; {len(groups):,} of {pool:,} samples in groups"
    )


if __name__ == "__main__":
    main()
