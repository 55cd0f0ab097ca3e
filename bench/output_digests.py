"""Digests of every output of synth -> score -> select -> reshard on a small synthetic world.

Refactors promise byte-identical outputs; this is how that is checked across two versions of the code:

    python bench/output_digests.py --write before.json     # on the old tree
    python bench/output_digests.py --check before.json     # on the new tree

Both runs must use the same --work folder: run directories record absolute paths (plan, fingerprints).

Files whose bytes record time, hosts or process ids (run summaries, per-shard markers, logs) are left out;
everything else (pool shards and their Parquet, scores, embeddings, subsets, reshards) must match.
Takes about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

# JSON files record wall-clock times, hostnames or pids by design (summaries, markers, reference and
# cluster reports), as do checkpoints' metadata; the data files beside them are compared.
STABLE_JSON = {"plan.json", "world.json"}
VOLATILE_SUFFIXES = (".log", ".html", ".txt.lock")


def _hype(*args: str) -> None:
    cmd = [sys.executable, "-c", "from hype.cli import main; main()", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"hype {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")


def build(work: Path) -> None:
    import torch

    from hype.checkpoint import save_checkpoint
    from hype.models import create_model

    w, models, run, subsets = work / "world", work / "models", work / "run", work / "subsets"
    pool = str(w / "pool" / "shards")
    _hype(
        *("synth", "--out", str(w), "--size", "300", "--shard-size", "100", "--clean-size", "50"),
        *("--eval-size", "10", "--reference-per-class", "1", "--workers", "1", "--no-progress"),
    )
    models.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    save_checkpoint(models / "meru.safetensors", create_model("tiny-hyperbolic"))
    save_checkpoint(models / "clip.safetensors", create_model("tiny-clip"))
    _hype(
        *("score", "--pool", pool, "--out", str(run), "--meru", str(models / "meru.safetensors")),
        *("--clip", str(models / "clip.safetensors"), "--class-images", str(w / "eval/reference/train")),
        *("batch_size=32", "threads=1", "progress=false", "reference.n_top=100", "reference.m=80"),
    )
    rules = {"hype": [], "no-c-in": ["--preset", "no-c-in"], "random": ["--rank", "random"]}
    for name, extra in rules.items():
        out = str(subsets / f"{name}.npy")
        _hype("select", "--scores", str(run), "--out", out, "--frac", "0.2", "--no-progress", *extra)
    _hype(
        *("reshard", "--pool", pool, "--subset", str(subsets / "hype.npy"), "--out", str(work / "reshard")),
        *("--shard-size", "20", "--workers", "2", "--no-progress"),
    )


def digests(work: Path) -> dict[str, str]:
    out = {}
    for p in sorted(work.rglob("*")):
        if not p.is_file() or p.name.endswith(VOLATILE_SUFFIXES):
            continue
        if p.suffix == ".json" and p.name not in STABLE_JSON or p.parent.name == "models":
            continue
        if any(part.startswith(".") for part in p.relative_to(work).parts):
            continue
        out[str(p.relative_to(work))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/hype-output-digests"),
                    help="Folder for the run (replaced; the same path on both sides).")  # fmt: skip
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path, help="Write the digests to this JSON file.")
    group.add_argument("--check", type=Path, help="Compare with digests written by --write.")
    args = ap.parse_args()
    if args.work.exists():
        if any(args.work.iterdir()) and not (args.work / "world").is_dir():
            raise SystemExit(f"{args.work} holds something else; name an empty or new folder")
        shutil.rmtree(args.work)
    build(args.work)
    got = digests(args.work)
    if args.write:
        args.write.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"{len(got)} files -> {args.write}")
        return
    want = json.loads(args.check.read_text())
    differ = sorted(k for k in want.keys() & got.keys() if want[k] != got[k])
    missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
    for label, names in (("differ", differ), ("missing", missing), ("new", extra)):
        for name in names:
            print(f"{label}: {name}")
    same = len(want.keys() & got.keys()) - len(differ)
    counts = f"{len(differ)} differ, {len(missing)} missing, {len(extra)} new"
    print(f"{same} of {len(want)} files byte-identical; {counts}")
    raise SystemExit(1 if differ or missing or extra else 0)


if __name__ == "__main__":
    main()
