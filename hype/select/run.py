"""`select_subset`: a scores table in, a DataComp subset file (+ Parquet + JSON summary) out.

Resolution order of the options: the preset (default `hype`, the paper's Eq. 1) gives the ranking rule,
weights, normalization and filters; `rank`, `weights` and `normalize` replace the preset's values;
`filters` and `intersect` add masks to the preset's; `union` files are added after ranking.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor

from hype import __version__
from hype.data.uids import to_structured, write_subset
from hype.io import read_bytes, storage
from hype.io.runs import Marker, absolute, fingerprint, input_identity
from hype.io.storage import AnyPath
from hype.select import rules
from hype.select.explain import CutWatcher, review_cut
from hype.select.nominal import nominal_rows
from hype.select.outputs import SubsetWriter, output_paths, write_json, write_summary
from hype.select.reducer import Target, describe_cut, reduce
from hype.select.request import SelectRequest, build_rules, make_target
from hype.select.union import union
from hype.table.reader import ScoresTable
from hype.table.schema import METRICS
from hype.table.stats import RunningStats

ROUNDING = "k = floor(frac * rows + 1/2) (round half up), computed exactly from the decimal --frac"


def select_subset(req: SelectRequest) -> dict:
    """Run a selection; returns the summary that is also written to `subset.json`."""
    start = time.perf_counter()
    npy, parquet, summary_path = output_paths(req.out)
    preset_name, ranker, masks = build_rules(req)
    table = ScoresTable(req.scores)
    table.require_finished()
    fp = fingerprint(_inputs(req, table, npy, [ranker, *masks]))
    done = Marker(summary_path).done(fp)
    if done is not None and storage.exists(npy) and storage.exists(parquet):
        return {**done, "summary": str(summary_path), "skipped": True}
    for m in (ranker, *masks):  # rules that read the run's other outputs (embed/, neardup/, ...)
        m.attach(table)
    warnings: list[str] = []
    nominal = nominal_rows(table, req.metadata)
    target = make_target(req, nominal)
    table.require(["uid"], "every selection")
    table.require(ranker.columns(), f"ranking rule {ranker.spec()!r}")
    for m in masks:
        table.require(m.columns(), f"filter {m.spec()!r}")
    metrics = table.present_metrics()
    cached = _read_pool_cache(table)
    # The ranking rule's terms get their histograms even with the cache (which keeps only quantiles): the
    # main deficit of each dropped row is its terms' pool percentiles (`review_cut`). Those columns are
    # read by the rank pass anyway; the histograms cost 2 MB each.
    pool_stats = {m: RunningStats() for m in (ranker.terms() if cached else metrics)}
    score_stats = RunningStats()
    writer = SubsetWriter(parquet, metrics)
    watch = CutWatcher(writer)  # the last kept row: the cut of `explain.cut_pass`
    bits: list = []
    try:
        result = reduce(
            table,
            ranker,
            masks,
            target,
            watch,
            carry=metrics,
            pool_stats=pool_stats,
            score_stats=score_stats,
            workers=req.workers,
            progress=req.progress,
            eligible_bits=bits,
            keep_spool=True,  # the columns downloaded from a bucket serve `review_cut`'s pass too
        )
        arr = writer.uid_array()
    except BaseException:
        writer.abort()
        table.release_spool()
        raise
    unions = []
    for path in req.union:
        hi, lo, info = union(arr["f0"], arr["f1"], path)
        arr = to_structured(hi, lo)
        unions.append(info)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hype-upload") as pool:
        closed = pool.submit(writer.close)  # the Parquet file's upload (to a bucket) overlaps the subset's
        arr = write_subset(npy, arr)
        closed.result()
    pool = cached or {m: st.to_dict() for m, st in pool_stats.items()}
    if not cached:
        _write_pool_cache(table, pool)
    pool["score"] = score_stats.to_dict()
    # Without a mask a row would be kept at or above this score: the threshold (--threshold, --keep-all),
    # else the lowest kept score (the cut could only rise with more eligible rows).
    cut = target.threshold if target.threshold is not None else describe_cut(result)["score"]
    summary = {
        "subset": str(npy),
        "parquet": str(parquet),
        # absolute (URLs as given): `hype explain --subset` finds the table from any folder
        "scores": [absolute(f) for f in table.folders] if len(table.folders) > 1 else absolute(table.folder),
        "pool_rows": result.pool_rows,
        # rows of a later --scores whose uid an earlier one holds: counted, read once (several runs only)
        **({"duplicates_across_runs": table.duplicates} if isinstance(table.source, list) else {}),
        "eligible_rows": result.eligible_rows,
        "selected_rows": result.kept_rows,
        "subset_rows": int(len(arr)),
        "target": _describe_target(target, result.k),
        "preset": preset_name,
        "rank": ranker.describe(),
        "filters": [
            {
                **m.describe(),
                "removed_rows": result.removed_by[m.spec()],
                **m.after_selection(table, ranker, masks, cut),
            }
            for m in masks
        ],
        "union": unions,
        "cut": describe_cut(result),
        "tie_break": "score descending, then uid ascending",
        "metrics": {
            name: {
                "pool": pool[name],
                "subset": writer.stats[name].to_dict(),
            }
            for name in [*metrics, "score"]
        },
        "warnings": warnings,
        "nominal_rows": nominal,
        "fractions": _fractions(result, nominal),
        **review_cut(table, ranker, masks, target, watch, bits, pool, req, arr, result, pool_stats),
        "passes": [*result.passes, "explain"],
        "seconds": round(time.perf_counter() - start, 3),
        "hype_version": __version__,
    }
    summary = write_summary(summary_path, fp, summary)  # last: the selection's completion marker
    summary["summary"] = str(summary_path)
    return summary


def _inputs(req: SelectRequest, table: ScoresTable, npy: AnyPath, rules: list) -> dict:
    """What a selection's outputs depend on (its run-contract fingerprint): the scores table's identity,
    the uid and metadata files it reads, the files its rules read (a normsim target: same path, other
    content is another selection), and every option that changes its outputs (not --workers or
    progress)."""
    files = [*req.intersect, *req.union, *([req.metadata] if req.metadata else [])]
    options = {k: v for k, v in vars(req).items() if k not in ("scores", "out", "workers", "progress")}
    read = [i for r in rules for i in r.inputs()]
    return {
        "table": table.identity(),
        "files": [input_identity(f) for f in files],
        "options": options,
        "out": absolute(npy),
        **({"rule_inputs": read} if read else {}),  # absent when none: other selections keep their marks
    }


def _pool_cache_path(table: ScoresTable) -> AnyPath | None:
    """Per-metric pool statistics depend only on the scores table: cached next to it, so repeated
    selections skip computing them."""
    return table.cache_path("pool-stats", ".json")


def _read_pool_cache(table: ScoresTable) -> dict | None:
    path = _pool_cache_path(table)
    if path is None:
        return None
    try:
        data = json.loads(read_bytes(path))
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and set(data) == set(table.present_metrics())
    return data if ok else None


def _write_pool_cache(table: ScoresTable, pool: dict) -> None:
    path = _pool_cache_path(table)
    if path is None:
        return
    try:
        write_json(path, pool)
    except OSError:
        pass  # a read-only run directory: recompute next time


def _fractions(result, nominal: int | None) -> dict:
    """The kept fraction of the scored rows, of the eligible ones and of the nominal pool (metadata uids)."""
    kept = result.kept_rows
    return {
        "of_scored": kept / result.pool_rows,
        "of_eligible": kept / result.eligible_rows if result.eligible_rows else None,
        "of_nominal": kept / nominal if nominal else None,
    }


def _describe_target(target: Target, k: int | None) -> dict:
    if target.threshold is not None:
        return (
            {"mode": "keep_all"}
            if math.isinf(target.threshold)
            else {"mode": "threshold", "threshold": target.threshold}
        )
    if target.frac is not None:
        return {
            "mode": "frac",
            "frac": float(target.frac),
            "frac_of": target.frac_of,
            "k": k,
            "rounding": ROUNDING,
        }
    return {"mode": "top_k", "k": k}


def format_summary(s: dict) -> str:
    """The short human summary printed at the end of `hype select`."""
    t = s["target"]
    pct = 100.0 * s["selected_rows"] / s["pool_rows"]
    how = {
        "frac": f"--frac {t.get('frac')} of the {t.get('frac_of')}, round half up",
        "top_k": f"--top-k {t.get('k')}",
        "threshold": f"score >= {t.get('threshold')}",
        "keep_all": "every eligible row",
    }[t["mode"]]
    rank = s["rank"]
    cls = rules.RULES.get(rank["rule"])
    rule = cls.headline(rank) if cls is not None else rank["rule"]
    lines = [
        f"selected {s['selected_rows']:,} of {s['pool_rows']:,} scored samples ({pct:.2f}%; {how}) "
        f"with preset {s['preset']}, ranked by {rule}"
    ]
    if s.get("skipped"):
        lines.append(f"  already done: {s['summary']} records it for the same scores (nothing rewritten)")
    cut = s["cut"]
    if cut["score"] is not None:
        tie = ""
        if cut["rows_at_cut_score"] > cut["kept_at_cut_score"]:
            tie = f"; {cut['kept_at_cut_score']} of {cut['rows_at_cut_score']} rows tied at it, kept by uid"
        lines.append(f"  cut: score >= {cut['score']:.6g}{tie}")
    for f in s["filters"]:
        spec = f["rule"] + (f" {f['path']}" if "path" in f else "")
        lines.append(f"  filter {spec}: removed {f['removed_rows']:,} rows")
    if s["filters"]:
        lines.append(f"  eligible after filters: {s['eligible_rows']:,}")
    for u in s["union"]:
        lines.append(f"  union {u['path']}: +{u['added_rows']:,} rows")
    lines.append(f"  {'metric':<10} {'pool mean':>11} {'subset mean':>12}")
    for name, st in s["metrics"].items():
        pool = st["pool"]["mean"] if st["pool"] and st["pool"].get("count") else float("nan")
        sub = st["subset"].get("mean", float("nan"))
        lines.append(f"  {name:<10} {pool:>11.4f} {sub:>12.4f}")
    fr = s.get("fractions")
    if fr:
        nominal = (
            f", {100 * fr['of_nominal']:.2f}% of the {s['nominal_rows']:,} nominal (metadata uids)"
            if fr.get("of_nominal") is not None
            else ""
        )
        eligible = f"{100 * fr['of_eligible']:.2f}%" if fr.get("of_eligible") is not None else "-"
        lines.append(f"  kept {100 * fr['of_scored']:.2f}% of scored, {eligible} of eligible{nominal}")
    lines += [f"  warning: {w}" for w in s.get("warnings", [])]
    lines.append(
        f"wrote {s['subset']} ({s['subset_rows']:,} uids), {s['parquet']}, {s['summary']} "
        f"in {s['seconds']:.1f} s"
    )
    return "\n".join(lines)


__all__ = ["SelectRequest", "select_subset", "format_summary", "METRICS"]
