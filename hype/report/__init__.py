"""`hype report`: one self-contained HTML page about a scored pool and, optionally, a subset of it.

Histograms per metric for pool vs subset (HYPE App. A), the metrics' correlation matrix, thumbnail grids
per 20% percentile bucket of ε_i and ε_t (HYPE Fig. 3), and the run's and the selection's summaries.
Given a subset whose subset.json records its selection: each term's cut-off on its histogram, a gallery
of dropped samples per main deficit and the audits of the cut (`hype.report.selection`).
"""

from __future__ import annotations

from os import PathLike

from hype.data.errors import SelectError
from hype.io import read_json, storage, write_text
from hype.report.collect import collect
from hype.report.decontam import matches_section
from hype.report.page import render
from hype.report.selection import selection_view
from hype.report.thumbs import attach_thumbnails


def write_report(
    run_dir: str | PathLike,
    out: str | PathLike,
    *,
    subset: str | PathLike | None = None,
    pool: str | None = None,
    per_bucket: int = 6,
    gallery: int = 6,
    bins: int = 40,
    workers: int = 2,
    progress: bool = True,
) -> dict:
    """Write the report to `out`; returns what it holds (counts) for the CLI summary. Each path may be a
    URL (`hype.io.storage`)."""
    out = storage.location(out)
    if out.suffix.lower() not in (".html", ".htm"):
        raise SelectError(f"--out {out}: the report is an HTML page; name it e.g. report.html")
    storage.check_reachable(out)  # a missing bucket: before the passes over the scores, not after
    data = collect(run_dir, subset, bins=bins, per_bucket=per_bucket, workers=workers, progress=progress)
    run_summary = read_json(storage.join(run_dir, "summary.json"))
    subset_summary = read_json(storage.location(subset).with_suffix(".json")) if subset else None
    view = selection_view(
        run_dir, subset_summary, metrics=data.metrics, per_term=gallery, workers=workers, progress=progress
    )
    if view is not None:
        data.cutoffs = dict(view.cutoffs)
    samples = [s for buckets in data.buckets.values() for bucket in buckets for s in bucket]
    samples += [s for group in (view.gallery.values() if view else ()) for s in group]
    thumbs = attach_thumbnails(samples, run_dir, pool)
    decontam, decontam_thumbs = matches_section(run_dir, pool)  # RUN_DIR/decontam/: --decontaminate
    page = render(
        data,
        run_summary=run_summary,
        subset_summary=subset_summary,
        thumbs=thumbs,
        selection=view,
        sections=[decontam],
    )
    write_text(out, page)
    return {
        "out": str(out),
        "bytes": len(page.encode("utf-8")),
        "pool_rows": data.pool_rows,
        "subset_rows": data.subset_rows,
        "subset_in_scores": data.subset_in_pool,
        "metrics": data.metrics,
        "thumbnails": thumbs,
        **({"decontam_thumbnails": decontam_thumbs} if decontam else {}),
        "run_summary": run_summary is not None,
        "cutoffs": data.cutoffs,
        "gallery": sum(len(g) for g in view.gallery.values()) if view else 0,
        "audit": bool(view and view.audit and any("groups" in a for a in view.audit.values())),
    }


__all__ = ["write_report"]
