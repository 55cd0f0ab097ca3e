"""Cost of the selection rules beyond Eq. 1 (#37): wall time and peak memory of `hype select --frac 0.2` with
each rule, as a ratio against HYPE's own rule (Eq. 1, the default) on the same table in the same process.

Builds a run of `--rows` rows in `--files` parts: a scores table (`bench/select_reducer.py`'s `generate`)
and, for the rules that read embeddings (`normsim`, `dbp`, `negclip`), `embed/<id>.parquet` with unit
`clip_img` (and `clip_txt` for negclip) of `--dim` dimensions drawn around 1,000 centres (clustered like
real CLIP features), plus plan.json naming the parts. normsim's target is
`--target-rows` unit vectors (.npy). Each rule runs in its own child process (`hype select`, peak RSS is the
child's own); every rule's subset is checked to hold the expected row count.

    python bench/rule_costs.py [--rows 1000000] [--dim 768] [--files 100] [--target-rows 10000]
        [--rules hype,zscore,combine,normsim,dbp] [--out DIR] [--keep]
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]  # bench/ is not a package
sys.path.insert(0, os.path.dirname(_HERE))

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

RULES = {
    "hype": ["--preset", "hype"],
    "zscore": ["--preset", "hype", "--normalize", "zscore"],
    "combine": ["--rank", "combine", "--weights", "neg_d_l=1,cos_theta=0.5,eps_t=0.25"],
    "normsim": ["--rank", "normsim:target={target},p=2"],
    "normsim-inf": ["--rank", "normsim:target={target}"],
    "dbp": ["--rank", "dbp:inner=hype"],
    "negclip": ["--rank", "negclip"],
    "negclip-k1": ["--rank", "negclip:k=1"],  # one partition: negclip's cost is k times it
}

# Run as a child: `hype select`, then this process's own peak RSS on stderr's last line.
CHILD = """
import json, resource, runpy, sys
sys.argv = ["hype"] + sys.argv[1:]
try:
    runpy.run_module("hype.cli", run_name="__main__")
finally:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rss_mb": rss}), file=sys.stderr)
"""


def generate(root: Path, rows: int, files: int, dim: int, text: bool, seed: int = 0) -> None:
    """The scores table of bench/select_reducer.py, then embed/ and plan.json for the same rows."""
    import importlib.util

    import pyarrow as pa
    import pyarrow.parquet as pq

    from hype.scoring.rundir import parquet_bytes

    spec = importlib.util.spec_from_file_location("select_reducer", Path(_HERE) / "select_reducer.py")
    reducer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reducer)
    reducer.generate(root, rows, files, seed)
    (root / "embed").mkdir(parents=True, exist_ok=True)
    centres = np.random.default_rng([seed, 1 << 20]).standard_normal((1000, dim)).astype(np.float32)
    shards = []
    for i, part in enumerate(sorted((root / "scores").glob("part-*.parquet"))):
        uid = pq.read_table(part, columns=["uid"]).column("uid").combine_chunks()
        rng = np.random.default_rng([seed, i, 1])
        emb = {"uid": uid, "clip_img": _features(rng, centres, len(uid))}
        if text:
            emb["clip_txt"] = _features(rng, centres, len(uid))
        sid = f"{i:08d}-00000000"
        (root / "embed" / f"{sid}.parquet").write_bytes(parquet_bytes(pa.table(emb)))
        shards.append({"id": sid, "index": i, "path": f"pool/{i:08d}.tar", "source": f"pool/{i:08d}.tar"})
    (root / "plan.json").write_text(json.dumps({"shards": shards, "pool": "pool", "pools": ["pool"]}))
    (root / "summary.json").write_text(json.dumps({"status": "complete", "rows": rows}))


def _features(rng: np.random.Generator, centres: np.ndarray, n: int):
    import pyarrow as pa

    x = centres[rng.integers(0, len(centres), n)] + 0.5 * rng.standard_normal((n, centres.shape[1]))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    return pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), centres.shape[1])


def run_rule(root: Path, rule: list[str], out: Path) -> dict:
    for old in (out, out.with_suffix(".json"), out.with_suffix(".parquet")):  # this bench's own earlier
        old.unlink(missing_ok=True)  # outputs: hype select would take a kept run as done and skip it
    cmd = [sys.executable, "-c", CHILD, "select", "--scores", str(root / "scores"), "--frac", "0.2",
           "--out", str(out), "--no-progress", *rule]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    tail = proc.stderr.strip().splitlines()
    if proc.returncode or not out.is_file():
        raise SystemExit(f"{' '.join(rule)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    rows = json.loads(Path(f"{out.with_suffix('')}.json").read_text())["selected_rows"]
    return {"wall_s": round(wall, 2), "rss_mb": round(json.loads(tail[-1])["rss_mb"]), "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--files", type=int, default=100)
    p.add_argument("--target-rows", type=int, default=10_000)
    p.add_argument("--rules", default="hype,zscore,combine,normsim,dbp")
    p.add_argument("--out", type=Path, default=None, help="build the run here (default: a temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the generated run")
    args = p.parse_args()
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    if rules[0] != "hype":
        rules.insert(0, "hype")  # the baseline every ratio is against
    root = (args.out or Path(tempfile.mkdtemp(prefix="hype-rule-costs-"))).resolve()
    try:
        t0 = time.perf_counter()
        if not (root / "plan.json").is_file():
            generate(root, args.rows, args.files, args.dim, text=any(r.startswith("negclip") for r in rules))
            target = np.random.default_rng(7).standard_normal((args.target_rows, args.dim)).astype(np.float32)
            np.save(root / "target.npy", target / np.linalg.norm(target, axis=1, keepdims=True))
        print(f"run of {args.rows:,} rows x {args.dim} dims in {time.perf_counter() - t0:.0f} s: {root}")
        results = {}
        for name in rules:
            rule = [a.replace("{target}", str(root / "target.npy")) for a in RULES[name]]
            results[name] = run_rule(root, rule, root / "subsets" / f"{name}.npy")
            r = results[name]
            base = results["hype"]
            print(f"{name:12s} {r['wall_s']:9.1f} s  {r['wall_s'] / base['wall_s']:7.1f}x  "
                  f"peak RSS {r['rss_mb']:7,} MB  ({r['rows']:,} rows kept)", flush=True)  # fmt: skip
        print(json.dumps({"rows": args.rows, "dim": args.dim, "target_rows": args.target_rows,
                          "results": results}))  # fmt: skip
    finally:
        if not args.keep and args.out is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
