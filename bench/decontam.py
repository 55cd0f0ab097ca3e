"""Decontamination recall and false positives per threshold and per kind of copy (README "Decontamination").

    python bench/decontam.py [--out /tmp/hype-bench-decontam] [--clip CKPT] [--size 2000] [--per-task 50]
        [--candidates 3,10,30,100]

On the synthetic world (`hype synth`, the demo's sizes): the pool is the world's pool (clean: no copy of
an evaluation image) plus, for `--per-task` evaluation images of each of the 7 tasks, one copy of each
kind (`hype.synth.contaminate`: exact, JPEG re-encoded, resized to 75%, cropped by 10%). `hype score
--decontaminate WORLD/eval` calls on one run (each after the first reuses every stage but the matches):
    CLIP only         `--no-copy-check decontam.threshold=-1`: every pool sample's nearest image of every
                      task; the table's threshold is the cosine;
    CLIP (k) + copy check  `--copy-threshold -1 decontam.candidates=k`, for each k of `--candidates`:
                      the k nearest of each task at the preset's cosine checked from pixels, the best one
                      recorded; the threshold is the copy similarity (`hype.scoring.copydetect`).
Per threshold: the recall of each kind of copy (a copy counts when it is flagged in its source's task),
the share of those whose match is the source image itself (`source_found`: the synthetic evaluation sets
hold near-identical scenes, so a copy may match another one) and the false positives: clean pool samples
flagged in any task. Then the share of copies whose source is among the CLIP's k nearest images of its
task (`candidate_recall`): the copy check can only confirm a candidate, so this bounds its recall.

The CLIP is the demo's scorer (`hype train --config tiny-clip` on the world's clean set, 6,400 samples
seen, as configs/workflows/demo.yaml trains it) unless `--clip` gives one. Measured 2026-11-27 (2 CPU
cores shared with other agents; bench/RESULTS.md has the tables): CLIP alone flags 1,985 of the 2,000
clean samples at cosine 0.95 (the tiny CLIP puts the median clean sample at cosine 0.9992 from its nearest
evaluation image: the world's evaluation scenes come from the pool's small scene grammar). The copy check
at 0.85 keeps every exact, JPEG and resized copy with any candidate count; 10%-crops need their source
among the candidates (the tiny CLIP's 1 / 3 / 10 / 30 / 100 nearest: 46 / 73 / 90 / 98 / 100%): crop
recall 0.749 / 0.977 / 1.0 with 3 / 30 / 100 candidates, clean samples flagged 165 / 274 / 333. Given the
source (`source_similarity`, no CLIP), every one of the 1,400 copies scores >= 0.85 (lowest: crop10
0.853). The clean samples it still passes are scenes that are, in pixels, nearly a crop of an evaluation
scene (one object of the same shape, colour and place on the same flat background). The check took 57 /
90 / 226 s for 71,291 / 706,257 / 2,082,121 candidate pairs.

Last, `clean_scenes`: the clean samples flagged at the last arm's settings, and how many are their
evaluation image's scene drawn again (the world's plan replayed). 2026-11-29, world seeds 0 / 1 with their
own tiny CLIPs, at the defaults since #37 item 5 (30 candidates, copy >= 0.9): 166 / 171 of 2,000 flagged,
109 / 92 of them the same scene; the rest mostly differ in colour only (32 / 59: orange against yellow or
red) or shape only (20 / 11). Since the copy check compares each colour channel's contrast (bench/quality.py's
4,000-sample worlds 0 / 1): 352 / 305 -> 253 / 244 of 4,000 flagged, colour-only 110 / 69 -> 5 / 2. Of the
200 / 193 same-scene flags, `same_scene_as_a_crop` (`hype.synth.scenes.crop_alike`) counts those that
differ from the evaluation image as a crop would: 105 / 114, 2.6% / 2.9% of the pool (bench/RESULTS.md).
Since the check compares edges at 28 px (sixth session, same worlds): 177 / 175 flagged at 0.9, crops 0.923 /
0.983; at 0.94, 76 / 63 (1.9% / 1.6%) with crops 0.871 / 0.883.
"""

from __future__ import annotations

import argparse
import glob
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from hype.synth.contaminate import KINDS

THRESHOLDS = (0.90, 0.95, 0.98, 0.99, 0.999)  # CLIP cosine, matching on CLIP features alone
COPY_THRESHOLDS = (
    0.7,
    0.75,
    0.8,
    0.85,
    0.9,
    0.92,
    0.93,
    0.94,
    0.95,
)  # copy similarity of CLIP candidates (cosine >= 0.9)


def hype(*args: str) -> None:
    cmd = [sys.executable, "-c", "from hype.cli import main; main()", *args]
    print("$ hype", " ".join(args), flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/hype-bench-decontam"))
    ap.add_argument("--clip", type=Path, help="CLIP checkpoint (default: train the demo's tiny CLIP)")
    ap.add_argument("--size", type=int, default=2000, help="pool samples of the world")
    ap.add_argument("--eval-size", type=int, default=500, help="images per evaluation task")
    ap.add_argument("--per-task", type=int, default=50, help="evaluation images copied per task")
    ap.add_argument("--scorer-samples", type=int, default=6400)
    ap.add_argument("--candidates", type=lambda v: [int(k) for k in v.split(",")], default=[3, 10, 30, 100],
                    help="candidate counts of the copy check, comma-separated")  # fmt: skip
    args = ap.parse_args()
    out = args.out
    started = time.perf_counter()
    world = (out / "world").resolve()  # the run records resolved paths: a linked world compares equal
    if not (world / "world.json").is_file():
        hype("synth", "--out", str(world), "--size", str(args.size), "--eval-size", str(args.eval_size),
             "--no-progress")  # fmt: skip
    clip = args.clip
    if clip is None:
        clip = out / "clip" / "model.safetensors"
        if not clip.is_file():
            data = str(world / "clean" / "shards")
            hype("train", "--config", "tiny-clip", "--data", data, "--out", str(clip.parent),
                 "--no-progress", f"samples_seen={args.scorer_samples}", "seed=0")  # fmt: skip
    meru = out / "meru.safetensors"
    if not meru.is_file():  # MERU's scores play no part here: a random tiny one keeps the run short
        import torch

        from hype.checkpoint import save_checkpoint
        from hype.models import create_model

        torch.manual_seed(0)
        save_checkpoint(meru, create_model("tiny-hyperbolic"))

    from hype.synth.contaminate import eval_images, write_copies

    copies = out / "copies" / "copies.tar"
    chosen = []
    for folder in sorted(glob.glob(str(world / "eval" / "wds_*"))):
        chosen += eval_images(sorted(glob.glob(f"{folder}/test/*.tar")))[: args.per_task]
    truth = pd.DataFrame(write_copies(chosen, copies, root=world))
    run = out / "run"
    pool = f"{world / 'pool' / 'shards'}::{copies.parent}"
    common = ["--pool", pool, "--meru", str(meru), "--clip", str(clip), "--out", str(run), "--decontaminate",
              str(world / "eval"), "--no-progress", "embed.decode=threads", "reference.n_top=200",
              "reference.m=200"]  # fmt: skip
    tables = []
    # CLIP alone: every pool sample's nearest image of every task. Then the copy check on each candidate
    # count (the k nearest of each task at cosine >= 0.9), every checked candidate's best recorded.
    arms = [("CLIP only", ["--no-copy-check", "decontam.threshold=-1"], THRESHOLDS, "similarity")]
    arms += [
        (f"CLIP ({k}) + copy check", ["--copy-threshold", "-1", f"decontam.candidates={k}"], COPY_THRESHOLDS,
         "copy_similarity")
        for k in args.candidates
    ]  # fmt: skip
    for mode, extra, thresholds, column in arms:
        t0 = time.perf_counter()
        hype("score", *common, *extra)
        info = json.loads((run / "decontam" / "matches.json").read_text())
        pairs = (info.get("copy_check") or {}).get("candidates_checked", 0)
        print(f"{mode}: matches in {info['seconds']:.0f} s, {pairs} pairs checked "
              f"(score call {time.perf_counter() - t0:.0f} s)")  # fmt: skip
        seconds = {"match_seconds": info["seconds"], "pairs_checked": pairs}
        tables.append(measure(run, truth, thresholds, column).assign(mode=mode, **seconds))
    table = pd.concat(tables, ignore_index=True)
    print(table.to_string(index=False))
    print("share of copies whose source is among the CLIP's k nearest images of its task:")
    print(candidate_recall(run, truth).to_string())
    print("copy similarity of each copy with its source (the check alone, no CLIP):")
    print(source_similarity(copies, chosen, truth).to_string())
    print("clean samples flagged at the last arm's settings: their evaluation image's scene drawn again?")
    print(clean_scenes(run, world).to_string(index=False))
    (out / "decontam.json").write_text(json.dumps(table.to_dict(orient="records"), indent=1))
    print(f"({time.perf_counter() - started:.0f} s; CLIP {clip})")


def measure(run: Path, truth: pd.DataFrame, thresholds: tuple, column: str) -> pd.DataFrame:
    """Recall per kind and false positives on the clean samples, per threshold on `column` of the matches."""
    from hype.scoring.stage_decontam import task_name

    m = pd.read_parquet(run / "decontam" / "matches.parquet")
    scores = pd.read_parquet(run / "scores", columns=["uid"])
    truth = truth.assign(task=[task_name(str(Path(s).parent.parent)) for s in truth.eval_shard])
    own = m.merge(truth, on=["uid", "task"], suffixes=("", "_src"))  # each copy's match in its source's task
    own["source"] = (own.eval_key == own.eval_key_src) & (own.eval_shard == own.eval_shard_src)
    clean = m[~m.uid.isin(truth.uid)].groupby("uid")[column].max()
    n_clean = int((~scores.uid.isin(truth.uid)).sum())
    rows = []
    for t in thresholds:
        row = {"threshold": t}
        for kind, group in truth.groupby("kind"):
            hit = own[(own.kind == kind) & (own[column] >= t)]
            row[f"recall_{kind}"] = round(hit.uid.nunique() / len(group), 4)
        found = own[own[column] >= t]
        row["source_found"] = round(float(found.source.mean()), 4) if len(found) else None
        row["false_positives"] = int((clean >= t).sum())
        row["clean_samples"] = n_clean
        rows.append(row)
    return pd.DataFrame(rows)


def clean_scenes(run: Path, world: Path, thresholds: tuple = (0.85, 0.9, 0.93, 0.94, 0.95)) -> pd.DataFrame:
    """Per copy threshold: clean samples flagged, how many of them are their best match's scene drawn again
    (the world's pool and evaluation scenes come from one grammar: same shape, colour, count, size,
    position and background) and which attributes the rest differ in. The scenes are the world's plan,
    replayed from world.json's arguments."""
    from hype.scoring.stage_decontam import task_name
    from hype.synth.eval_tasks import task_folder
    from hype.synth.scenes import crop_alike
    from hype.synth.world import replay_plan

    plan = replay_plan(world)
    pool = {s.uid: s.scene for s in plan.pool}
    scenes = {(task_name(task_folder(t)), i.key): i.scene for t, its in plan.eval_items.items() for i in its}
    attrs = ("shape", "color", "count", "size", "position", "background")

    m = pd.read_parquet(run / "decontam" / "matches.parquet")
    m = m[m.uid.isin(pool)].sort_values("copy_similarity", ascending=False)
    rows = []
    for t in thresholds:
        best = m[m.copy_similarity >= t].drop_duplicates("uid")
        pairs = [(pool[r.uid], scenes[(r.task, r.eval_key)]) for r in best.itertuples()]
        differ = pd.Series([",".join(k for k in attrs if getattr(p, k) != getattr(e, k)) for p, e in pairs])
        alike = sum(crop_alike(*q) for q, d in zip(pairs, differ, strict=True) if not d)
        rows.append({"copy_threshold": t, "clean_flagged": len(best), "same_scene": int((differ == "").sum()),
                     "same_scene_as_a_crop": alike,
                     "others_differ_in": differ[differ != ""].value_counts().head(3).to_dict()})  # fmt: skip
    return pd.DataFrame(rows)


def source_similarity(copies: Path, chosen: list, truth: pd.DataFrame) -> pd.DataFrame:
    """Per kind of copy: the copy similarity of each copy with its source image (lowest, 1st percentile)
    and the share at or above each copy threshold."""
    from hype.data.samples import SkipStats, iter_tar_samples
    from hype.scoring.config import DecontamConfig
    from hype.scoring.copydetect import pair_similarities, work_image
    from hype.scoring.stage_decontam import search_of

    check = search_of(DecontamConfig()).check  # the stage's
    side = check.work_side
    source = {(shard, key): work_image(data, side) for shard, key, data, _ in chosen}
    copy = {s.key: work_image(s.image_bytes(), side) for s in iter_tar_samples(str(copies), SkipStats())}
    a = np.stack([copy[k] for k in truth.key])
    b = np.stack([source[(s, k)] for s, k in zip(truth.eval_shard, truth.eval_key, strict=True)])
    sims = pair_similarities(a, b, np.stack([np.arange(len(a))] * 2, axis=1), check)
    rows = {}
    for kind in KINDS:
        v = sims[(truth.kind == kind).to_numpy()]
        rows[kind] = {"lowest": round(float(v.min()), 4), "p1": round(float(np.percentile(v, 1)), 4)}
        rows[kind] |= {f">={t}": round(float((v >= t).mean()), 4) for t in COPY_THRESHOLDS}
    return pd.DataFrame(rows).T


def candidate_recall(run: Path, truth: pd.DataFrame, ks: tuple = (1, 3, 10, 30, 100)) -> pd.DataFrame:
    """Per kind of copy and k: the share of copies whose source is among the k nearest images (CLIP cosine)
    of its task: the copy check can only confirm a candidate, so this bounds its recall."""
    import pyarrow.parquet as pq

    from hype.scoring import embed_format
    from hype.scoring.stage_decontam import normalise, task_name

    def features(path: str):
        return normalise(embed_format.fixed_list_to_numpy(pq.read_table(path, columns=["clip_img"])[0]))

    pool = sorted(glob.glob(str(run / "embed" / "*.parquet")))
    uids = [u for f in pool for u in pq.read_table(f, columns=["uid"])[0].to_pylist()]
    x = np.concatenate([features(f) for f in pool])
    rows, feats = [], []
    for stats in sorted(glob.glob(str(run / "decontam_eval" / "*_stats.json"))):
        info = json.loads(Path(stats).read_text())
        out = str(Path(stats).parent / info["output"]["file"])
        rows += [(info["shard"], k) for k in pq.read_table(out, columns=["key"])[0].to_pylist()]
        feats.append(features(out))
    e, at = np.concatenate(feats), {r: i for i, r in enumerate(rows)}
    task = np.array([task_name(shard.split("/test/")[0]) for shard, _ in rows])
    where = {u: i for i, u in enumerate(uids)}
    ranks = []
    for r in truth.itertuples():
        src = at[(r.eval_shard, r.eval_key)]
        same = np.flatnonzero(task == task[src])
        sims = e[same] @ x[where[r.uid]]  # one product: the source's cosine rounds as the others'
        ranks.append(int((sims > sims[np.searchsorted(same, src)]).sum()))
    ranks = np.array(ranks)
    return pd.DataFrame(
        {f"k={k}": [round(float((ranks[truth.kind == kind] < k).mean()), 4) for kind in KINDS] for k in ks},
        index=list(KINDS),
    )


if __name__ == "__main__":
    main()
