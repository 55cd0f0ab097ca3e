"""What the report shows about a selection: the cut-off on each term's histogram, a gallery of dropped
samples per main deficit, and the audits of the cut.

The selection is the one the subset's `subset.json` records (`hype.select.explain.request_from_summary`),
redone on the report's scores table by `hype explain`'s streaming passes (`explain_selection`, nothing
written): its cut score, the main deficit of a hashed sample of dropped rows (with their shard, key
and caption, for the thumbnails) and each term's cut-off value (`term_cutoffs`). The gallery groups by
main deficit, not decisive term: at a tight cut no single term's median keeps a dropped row (`none
alone` for most), while the term on which a row sits lowest in the pool is nearly always named. The audits
are read from `subset.json` as `hype select --audit` wrote them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from os import PathLike

from hype.report.collect import Sample

SAMPLED_PER_GROUP = 8  # dropped rows sampled per gallery slot: enough for most terms to show
NO_DEFICIT = "none"  # the gallery group of dropped rows with no term below its pool median


@dataclass
class SelectionView:
    cut: dict = field(default_factory=dict)
    cutoffs: dict[str, float | None] = field(default_factory=dict)
    decisions: dict = field(default_factory=dict)
    # main deficit (a term, or NO_DEFICIT) -> dropped samples (values: the five terms)
    gallery: dict[str, list[Sample]] = field(default_factory=dict)
    audit: dict | None = None
    note: str = ""


def selection_view(
    run_dir: str | PathLike,
    summary: Mapping | None,
    *,
    metrics: list[str],
    per_term: int,
    workers: int = 2,
    progress: bool = True,
) -> SelectionView | None:
    """The selection `summary` (a subset.json) records, redone on `run_dir`; None without a summary."""
    if not summary:
        return None
    audit = summary.get("audit") if isinstance(summary.get("audit"), dict) else None
    if "target" not in summary or "rank" not in summary:
        return SelectionView(audit=audit, note="the subset.json does not record a selection to redo")
    from hype.data.errors import SelectError
    from hype.select.explain import Wanted, explain_selection, request_from_summary
    from hype.select.run import SelectRequest

    try:
        fields = request_from_summary(dict(summary), str(run_dir))
        req = SelectRequest(out="unused.npy", workers=workers, progress=progress, **fields)
        sample = min(2000, max(1, per_term * SAMPLED_PER_GROUP * 6))
        wanted = Wanted(sample=sample, dropped=True, extra=("shard", "key", "text", *metrics))
        out = explain_selection(req, wanted)
    except (SelectError, KeyError, TypeError, ValueError) as e:
        return SelectionView(audit=audit, note=f"the selection could not be redone on these scores ({e})")
    view = SelectionView(
        cut=out["cut"], cutoffs=out.get("term_cutoffs", {}), decisions=out["decisions"], audit=audit
    )
    if per_term:
        for row in out["rows"]:
            slot = view.gallery.setdefault((row.get("deficit") or {}).get("term", NO_DEFICIT), [])
            if len(slot) < per_term:
                slot.append(_sample(row, metrics))
    return view


def _sample(row: dict, metrics: list[str]) -> Sample:
    extra = row.get("extra") or {}
    return Sample(
        uid=row["uid"],
        shard=extra.get("shard") or "",
        key=extra.get("key") or "",
        text=extra.get("text") or "",
        values={m: float(extra[m]) for m in metrics},
        in_subset=False,
    )
