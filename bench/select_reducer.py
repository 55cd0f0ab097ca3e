"""Benchmark: hype's streaming top-fraction selection against DataComp's load-and-sort approach.

Generates a scores table of `--rows` rows in `--files` Parquet files (the `hype.table.schema` layout;
random uids, float32 metrics, c_in in {0, 10}) unless `--table DIR` names one, then selects the top
`--frac` by the HYPE sum (Eq. 1) three ways, each in a fresh child process (peak RSS is per process):

- `baseline`: DataComp's approach (baselines/utils.py get_threshold + load_uids_with_threshold): load
  the score of every row into RAM, sort it with NumPy to find the threshold, then read uids + scores
  again and keep rows above it (plus, to be exact, the rows tied at it in uid order);
- `streaming`: hype's reducer (histogram pass + select pass, bounded memory) with a sink that only
  collects uids;
- `cli`: the whole `hype select` (also writes subset.parquet and subset.json with pool/subset stats).

Both use the same reader, the same score function and the same uid sort and file writer, so the ratio
measures the selection algorithm. Asserts that all three subset files are identical; prints wall time,
peak RSS and the ratio streaming / baseline (target <= 1.2, peak RSS < 2 GB).

    python bench/select_reducer.py [--rows 100000000] [--files 100] [--frac 0.2] [--table DIR] [--keep]
"""

from __future__ import annotations

import os
import sys

# This script is named select.py: run as `python bench/select_reducer.py`, its folder comes first on sys.path
# and would shadow the standard library's `select` (which subprocess imports). Drop it, add the repo.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402


def generate(folder: Path, rows: int, files: int, seed: int = 0) -> None:
    import pyarrow as pa
    from tqdm import tqdm

    from hype.data.uids import pairs_to_arrow
    from hype.scoring.rundir import parquet_bytes
    from hype.table.schema import SCHEMA

    scores = folder / "scores"
    scores.mkdir(parents=True, exist_ok=True)
    sizes = [rows // files + (1 if i < rows % files else 0) for i in range(files)]
    with tqdm(total=rows, desc="generating table", unit=" rows", unit_scale=True, file=sys.stderr) as bar:
        for i, n in enumerate(sizes):
            rng = np.random.default_rng([seed, i])
            hi = rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False)
            lo = rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False)
            cols = {
                "uid": pairs_to_arrow(hi, lo).cast(pa.string()),
                "eps_i": pa.array(rng.normal(0.2, 0.1, n).astype(np.float32)),
                "eps_t": pa.array(rng.normal(0.05, 0.1, n).astype(np.float32)),
                "neg_d_l": pa.array(rng.normal(-1.0, 0.2, n).astype(np.float32)),
                "cos_theta": pa.array(rng.normal(0.3, 0.05, n).astype(np.float32)),
                "c_in": pa.array(np.where(rng.random(n) < 0.25, 10.0, 0.0).astype(np.float32)),
                "shard": pa.array(np.full(n, f"pool/{i:08d}.tar", dtype=object), pa.string()),
                "key": pa.nulls(n, pa.string()),
                "text": pa.nulls(n, pa.string()),
                "width": pa.array(np.full(n, 256, np.int32)),
                "height": pa.array(np.full(n, 256, np.int32)),
            }
            table = pa.Table.from_arrays([cols[f.name] for f in SCHEMA], schema=SCHEMA)
            # the bytes `hype score` would write for these rows (its writer settings)
            (scores / f"part-{i:05d}.parquet").write_bytes(parquet_bytes(table))
            bar.update(n)


def _baseline(table, rule, k: int, workers: int, progress: bool):
    """DataComp's approach, made exact: all scores in RAM, np.sort for the k-th score, then a second
    read keeping rows above it and the rows tied at it in uid order."""
    scores = np.empty(table.num_rows, dtype=np.float64)
    at = 0
    for batch in table.iter_batches(
        rule.columns(), workers=workers, progress="load scores" if progress else None
    ):
        s = rule.score(batch)
        scores[at : at + len(s)] = s
        at += len(s)
    threshold = -np.sort(-scores)[k - 1]  # the k-th largest score
    del scores
    his, los, tie_hi, tie_lo = [], [], [], []
    cols = ["uid", *rule.columns()]
    for batch in table.iter_batches(
        cols, workers=workers, progress="keep >= threshold" if progress else None
    ):
        s = rule.score(batch)
        above, tied = s > threshold, s == threshold
        for rows, out_hi, out_lo in ((above, his, los), (tied, tie_hi, tie_lo)):
            if rows.any():
                hi, lo = batch.filter(rows).uid_pairs()
                out_hi.append(hi)
                out_lo.append(lo)
    th, tl = np.concatenate(tie_hi), np.concatenate(tie_lo)
    order = np.lexsort((tl, th))[: k - sum(len(h) for h in his)]
    return his + [th[order]], los + [tl[order]]


def _streaming(table, rule, k: int, workers: int, progress: bool):
    from hype.select.reducer import Target, reduce

    his, los = [], []

    def sink(hi, lo, score, columns, uids):
        his.append(hi)
        los.append(lo)

    reduce(table, rule, [], Target(k=k), sink, workers=workers, progress=progress)
    return his, los


def worker(mode: str, table_dir: str, frac: float, out: str, workers: int, progress: bool) -> dict:
    from hype.data.uids import sorted_uids
    from hype.filters.hype import HypeScore
    from hype.select.outputs import write_subset
    from hype.select.reducer import Target, parse_frac
    from hype.table.reader import ScoresTable

    t0 = time.perf_counter()
    if mode == "cli":
        from hype.select.run import SelectRequest, select_subset

        summary = select_subset(
            SelectRequest(scores=table_dir, out=out, frac=frac, workers=workers, progress=progress)
        )
        k = summary["selected_rows"]
    else:
        table = ScoresTable(table_dir)
        k = Target(frac=parse_frac(frac)).count(table.num_rows)
        rule = HypeScore()
        his, los = (_baseline if mode == "baseline" else _streaming)(table, rule, k, workers, progress)
        write_subset(Path(out), sorted_uids(his, los))
    seconds = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"mode": mode, "seconds": seconds, "peak_rss_mb": rss, "k": k}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000_000)
    ap.add_argument("--files", type=int, default=100)
    ap.add_argument("--frac", type=float, default=0.2)
    ap.add_argument("--table", default=None, help="Existing run dir / scores table to use (not deleted).")
    ap.add_argument("--keep", action="store_true", help="Keep the generated table (its path is printed).")
    ap.add_argument("--workers", type=int, default=2, help="Reader threads (same for every method).")
    ap.add_argument("--modes", default="baseline,streaming,cli")
    ap.add_argument("--repeats", type=int, default=3, help="Rounds, alternating the order of the modes.")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        res = worker(args.worker, args.table, args.frac, args.out, args.workers, not args.no_progress)
        print("RESULT " + json.dumps(res))
        return

    tmp = Path(tempfile.mkdtemp(prefix="hype-bench-select-"))
    table_dir = Path(args.table) if args.table else tmp / "run"
    try:
        if not args.table:
            t0 = time.perf_counter()
            generate(table_dir, args.rows, args.files)
            print(
                f"generated {args.rows:,} rows in {args.files} files in {time.perf_counter() - t0:.0f} s: "
                f"{table_dir}"
            )
        modes = args.modes.split(",")
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for r in range(args.repeats):
            # Alternate the order so that page-cache warmth and neighbours' load favour no method.
            for mode in modes if r % 2 == 0 else modes[::-1]:
                out = tmp / f"{mode}.npy"
                cmd = [
                    sys.executable,
                    __file__,
                    "--worker",
                    mode,
                    "--table",
                    str(table_dir),
                    "--frac",
                    str(args.frac),
                    "--out",
                    str(out),
                    "--workers",
                    str(args.workers),
                ]
                if args.no_progress:
                    cmd.append("--no-progress")
                proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
                line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
                res = json.loads(line[len("RESULT ") :])
                runs[mode].append(res)
                print(
                    f"round {r + 1} {mode:>10}: {res['seconds']:8.1f} s   "
                    f"peak RSS {res['peak_rss_mb']:8.0f} MB   "
                    f"k = {res['k']:,}",
                    flush=True,
                )
                arrays = np.load(out, allow_pickle=False)
                if mode == modes[0] or not (tmp / "reference.npy").exists():
                    np.save(tmp / "reference.npy", arrays, allow_pickle=False)
                ref = np.load(tmp / "reference.npy", allow_pickle=False)
                assert arrays.dtype == ref.dtype and np.array_equal(arrays, ref), (
                    f"{mode} selected other uids"
                )
        print(f"identical subsets from {', '.join(modes)} in every round ({len(ref):,} uids)")
        summary = {}
        for mode, rs in runs.items():
            secs = sorted(x["seconds"] for x in rs)
            summary[mode] = {
                "min": secs[0],
                "median": secs[len(secs) // 2],
                "rss": max(x["peak_rss_mb"] for x in rs),
            }
            print(
                f"{mode:>10}: min {secs[0]:.1f} s, median {secs[len(secs) // 2]:.1f} s, "
                f"peak RSS {summary[mode]['rss']:.0f} MB over {len(rs)} run(s)"
            )
        if "baseline" in summary and "streaming" in summary:
            b, st = summary["baseline"], summary["streaming"]
            print(
                f"streaming / baseline wall time: {st['median'] / b['median']:.2f} (medians), "
                f"{st['min'] / b['min']:.2f} (minima); target <= 1.2. "
                f"Streaming peak RSS {st['rss']:.0f} MB (target < 2048)"
            )
        if "cli" in summary and "baseline" in summary:
            print(
                "hype select (+ parquet, stats) / baseline: "
                f"{summary['cli']['median'] / summary['baseline']['median']:.2f} "
                "(medians)"
            )
    finally:
        if args.keep and not args.table:
            print(f"table kept at {table_dir}")
            for p in tmp.glob("*.npy"):
                p.unlink()
            shutil.rmtree(table_dir / "select_cache", ignore_errors=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
