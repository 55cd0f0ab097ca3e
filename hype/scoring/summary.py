"""The run summary of `hype score`: `RUN_DIR/summary.json` (read by `hype report`) and its text form.

`status` is `running` from the moment a run holds the lock (before it changes anything), `complete`
once every part of the scores table is written, `failed` when the run stopped short: shards failed after
their retries (they are listed; rerunning retries them) or an error (`error`). `hype select` reads the
scores table only when it is `complete`: until then its parts may be missing or left by an earlier run.
Sample counts come from the per-shard markers, so they cover reused shards as well as new ones.
"""

from __future__ import annotations

import json

from hype.data.samples import EMPTY_SHARD, MISSING_SHARD, UNREADABLE_SHARD, SkipStats
from hype.scoring.config import ScoreConfig
from hype.scoring.rundir import RunDir

SHARD_REASONS = (UNREADABLE_SHARD, MISSING_SHARD, EMPTY_SHARD)


# summary.json's keys in this order (a stage's fields fill their places: `hype.scoring.context.StageSpec`'s
# `summary`); keys of a stage that is not listed here follow, in the stages' order.
LAYOUT: dict[str, tuple[str, ...]] = {
    "status": (),
    "run_dir": (),
    "scores_dir": (),
    "pool": (),
    "executor": (),
    "models": (),
    "metadata": (),
    "shards": (
        "total",
        "empty",
        "unreadable",
        "unreadable_examples",
        "missing",
        "missing_examples",
        "storage_retries",
        "failed",
    ),
    "samples": (
        "read",
        "embedded",
        "scored",
        "skipped",
        "skipped_by_reason",
        "skip_examples",
        "duplicates",
        "empty_captions",
    ),
    "reference": (),
    "specificity": (),
    "c_in": (),
    "stages": (),
    "seconds": (),
    "samples_per_s": (),
    "warnings": (),
    "error": (),
    "decontam": (),
    "neardup": (),
}


def build_summary(
    cfg: ScoreConfig,
    run: RunDir,
    plan: dict,
    *,
    status: str,
    stages: dict,
    warnings: list[str],
    failures: list[dict],
    seconds: float,
    executor: str,
    metadata: dict | None = None,
    error: str | None = None,
    fields: list[dict] = (),
) -> dict:
    """The run's own fields and the stages' `fields` (merged in order: a nested dict key by key), laid out
    as `LAYOUT`."""
    out = {
        "status": status,
        "run_dir": str(run.root),
        "scores_dir": str(run.scores),
        "pool": plan.get("pool"),
        "executor": executor,
        "models": {"meru": cfg.meru, "clip": cfg.clip, "metadata": cfg.metadata.dir},
        # --metadata: its files and rows, and where the CLIP features and cos θ came from
        "metadata": metadata,
        "shards": {
            "total": plan.get("shards", 0),
            "empty": list(plan.get("empty_shards", [])),
            "failed": failures,
        },
        "stages": stages,  # this invocation's work; reused shards count in shards_reused
        "seconds": round(seconds, 3),
        "warnings": list(warnings),
    }
    if error is not None:
        out["error"] = error
    for part in fields:
        for key, value in part.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = out[key] | value
            else:
                out[key] = value
    return _laid_out(out)


def _laid_out(out: dict) -> dict:
    """`out` with its keys (and those of the sections `LAYOUT` lists) in `LAYOUT`'s order."""
    first = {k: out[k] for k in LAYOUT if k in out} | out
    for key, inner in LAYOUT.items():
        if inner and isinstance(first.get(key), dict):
            first[key] = {k: first[key][k] for k in inner if k in first[key]} | first[key]
    return first


def embed_fields(embed_stats: list[dict]) -> dict:
    """The embed stage's fields: the pool's samples and shards as its markers count them (reused shards
    included)."""
    skips = SkipStats()
    read = embedded = empty_captions = 0
    for s in embed_stats:
        skips.merge(s.get("skipped") or {})
        c = s.get("counts") or {}
        read += int(c.get("samples", 0))
        embedded += int(c.get("embedded", 0))
        empty_captions += int(c.get("empty_captions", 0))
    per_sample = {r: n for r, n in sorted(skips.counts.items()) if r not in SHARD_REASONS}
    return {
        "shards": {
            "unreadable": int(skips.counts.get(UNREADABLE_SHARD, 0)),
            "unreadable_examples": list(skips.examples.get(UNREADABLE_SHARD, [])),
            # listed, then gone when read: scored as empty; a rerun reads it again if it comes back
            "missing": int(skips.counts.get(MISSING_SHARD, 0)),
            "missing_examples": list(skips.examples.get(MISSING_SHARD, [])),
            # transient storage errors (5xx, resets, throttling) retried while reading the shards
            "storage_retries": sum(int(s.get("storage_retries", 0)) for s in embed_stats),
        },
        "samples": {
            "read": read,
            "embedded": embedded,
            "skipped": sum(per_sample.values()),
            "skipped_by_reason": per_sample,
            "skip_examples": {r: skips.examples.get(r, []) for r in per_sample},
            "empty_captions": empty_captions,
        },
    }


def reference_fields(reference: dict | None, run: RunDir, plan: dict) -> dict | None:
    """Where S_i/S_t came from: selected from the pool or a --reference file; in a grown run frozen: the
    run's own file, made when it was first scored (`hype.scoring.grow`), from its first pool."""
    if reference is None:
        return None
    out = {"source": reference.get("source"), **(reference.get("meta") or {}), "file": str(run.reference)}
    grown = plan.get("grown")
    if grown:
        first = (grown.get("pools") or [None])[0] if reference.get("source") == "selected" else None
        out |= {"frozen": True, "digest": reference.get("digest"), "first_pool": first}
    return out


def reference_line(ref: dict) -> str:
    """The summary's line on the reference sets (`reference_fields`)."""
    if ref.get("source") == "selected":
        made = f"N={ref.get('n_top')}, M={ref.get('m')} ({'hinged L_e' if ref.get('hinge') else 'raw E'})"
        made = f"selected from {ref.get('first_pool') or 'the pool'}: {made}"
    else:
        made = f"from {ref.get('source')}"
    if not ref.get("frozen"):
        return made + (f" -> {ref['file']}" if ref.get("source") == "selected" else "")
    return f"frozen as the pool grew: {ref['file']} (digest {ref.get('digest')}), first {made}"


def kmeans_note(clusters: dict) -> str:
    """Which rows c_IN's k-means trained on, in words ("trained on N caption-filtered rows of M")."""
    if clusters.get("centroids"):
        return f"not run: {clusters['k']:,} centroids from {clusters['centroids']}"
    n, eligible, pool = clusters.get("train_points"), clusters.get("train_eligible"), clusters.get("pool")
    if n is None or eligible is None or pool is None:
        return "trained (rows not recorded)"
    which = "caption-filtered rows" if clusters.get("train_rows") == "caption-filtered" else "rows"
    if n == eligible:
        note = f"trained on {n:,} {which} of {pool:,}"
    else:
        note = f"trained on {n:,} of the {eligible:,} {which} of {pool:,} (at most points_per_centroid·K)"
    return note + ("" if which == "caption-filtered rows" else " (caption filter off)")


def format_summary(s: dict) -> str:
    """A short human summary."""
    smp, sh = s["samples"], s["shards"]
    lines = []
    head = {"complete": "scored", "failed": "FAILED", "running": "interrupted"}.get(s["status"], s["status"])
    scored = smp["scored"] if smp["scored"] is not None else smp["embedded"]
    lines.append(
        f"hype score: {head}: {scored:,} samples from {sh['total']} shards in {s['seconds']:.1f} s"
        + (f" ({s['samples_per_s']:,.1f} samples/s)" if s.get("samples_per_s") else "")
    )
    lines.append(f"  scores      {s['scores_dir']}/part-*.parquet")
    meta = s.get("metadata")
    if meta:
        lines.append(
            f"  metadata    {meta['rows']:,} uids in {meta['files']} parquet file"
            f"{'' if meta['files'] == 1 else 's'}; CLIP features from "
            f"{meta['features']}, cos θ from {meta['cos_theta']}"
        )
    if smp["skipped"]:
        reasons = ", ".join(f"{r} {n:,}" for r, n in smp["skipped_by_reason"].items())
        lines.append(f"  skipped     {smp['skipped']:,} ({reasons})")
        for r, ex in smp["skip_examples"].items():
            if ex:
                lines.append(f"              e.g. {r}: {ex[0]}")
    if sh["unreadable"] or sh["empty"]:
        lines.append(
            f"  bad shards  {sh['unreadable']} unreadable/truncated (samples before the damage kept), "
            f"{len(sh['empty'])} empty"
        )
    if sh.get("missing"):
        lines.append(
            f"  missing     {sh['missing']} shard(s) gone since the pool was listed, e.g. "
            f"{sh['missing_examples'][0] if sh['missing_examples'] else '?'}; rerun once they are back"
        )
    if smp.get("duplicates"):
        lines.append(
            f"  duplicates  {smp['duplicates']:,} repeated uids dropped (kept the first by shard order)"
        )
    if smp.get("empty_captions"):
        lines.append(f"  empty captions {smp['empty_captions']:,} (scored)")
    ref = s.get("reference")
    if ref:
        lines.append(f"  reference   {reference_line(ref)}")
    c = s["c_in"]
    if c["enabled"]:
        lines.append(
            f"  c_IN        K={c['k']} clusters, {c['targets']} targets from {c['class_images']:,} class "
            f"images; {c['samples_c_in']:,} samples with c_IN=10"
            + ("" if c["caption_filter"] else " (caption filter off)")
        )
        lines.append(f"              k-means {c['kmeans']}")
    else:
        lines.append("  c_IN        off (no --class-features/--class-images): 0 for every sample")
    dc = s.get("decontam")
    if dc:
        check = dc.get("copy_check")
        verified = f", copies by pixels (>= {check['threshold']})" if check else ""
        lines.append(
            f"  decontam    {dc['flagged_samples']:,} samples within cosine {dc['threshold']}{verified} "
            f"of an image of {len(dc['tasks'])} evaluation task(s) -> {s['run_dir']}/decontam/matches.parquet"
        )
    parts = []
    for name, m in s["stages"].items():
        rate = f", {m['samples_per_s']:,.0f}/s" if m.get("samples_per_s") else ""
        reused = f", {m['shards_reused']} reused" if m.get("shards_reused") else ""
        parts.append(f"{name} {m['seconds']:.1f}s{rate}{reused}")
    lines.append("  stages      " + " · ".join(parts))
    for key in (k for k in s if k not in LAYOUT):  # a registered stage's own fields, as they are
        lines.append(f"  {key:<11} {json.dumps(s[key], separators=(', ', ': '), default=str)}")
    if sh["failed"]:
        lines.append(f"  FAILED      {len(sh['failed'])} shard(s); rerun the same command to retry them:")
        lines += [f"              {f['shard']} ({f.get('stage')}): {f['error']}" for f in sh["failed"][:5]]
    nd = s.get("neardup")
    if nd:
        lines.append(
            f"  neardup     {nd['members']:,} samples in {nd['groups']:,} groups at cosine >= "
            f"{nd['threshold']}"
            + (f", copy similarity >= {cc['threshold']}" if (cc := nd.get("copy_check")) else "")
            + f"; keeper {nd['keeper']}: {nd['removed']:,} to remove (hype select --filter dedup)"
            + (f"; searched within {nd['k']:,} {p} clusters" if (p := nd.get("partition")) else "")
        )
    for w in s["warnings"]:
        lines.append(f"  warning     {w}")
    return "\n".join(lines)
