"""Aggregate scores and the end-of-run table.

Aggregates follow DataComp's aggregate_scores.py: each group in the suite's `aggregates` (ImageNet,
ImageNet dist. shifts, VTAB, Retrieval) is the plain mean of its tasks' main metrics, and the average is
the plain mean over all scored tasks (38 for DataComp). With datasets missing, the means are taken over
the tasks present and carry their count, e.g. "(35/38, partial)".
"""

from __future__ import annotations

from hype.eval.tasks import Suite


def main_metric(line: dict | None) -> float | None:
    if not line:
        return None
    value = line.get("metrics", {}).get("main_metric")
    return float(value) if isinstance(value, (int, float)) else None


def aggregate(suite: Suite, results: dict[str, dict]) -> list[dict]:
    """Rows {"name", "value", "count", "total"} for each group aggregate, then the average."""
    rows = []
    groups = [(name, [t for t in suite.scored if t.group == g]) for g, name in suite.aggregates.items()]
    groups.append((suite.average_name, list(suite.scored)))
    for name, tasks in groups:
        values = [v for v in (main_metric(results.get(t.key)) for t in tasks) if v is not None]
        rows.append(
            {
                "name": name,
                "value": sum(values) / len(values) if values else None,
                "count": len(values),
                "total": len(tasks),
            }
        )
    return rows


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def format_table(summary: dict) -> str:
    """The human summary printed at the end of `hype eval`."""
    rows = []
    for t in summary["tasks"]:
        m = t.get("metrics") or {}
        status = t["status"]
        note = {"cached": "cached", "done": "", "missing": "MISSING", "failed": "FAILED"}[status]
        skipped = m.get("num_skipped", 0) + m.get("num_read_errors", 0) if m else 0
        rows.append(
            (
                t["dataset"],
                t["main_metric_name"] or "(unscored)",
                _fmt(t.get("main_metric")) if status in ("done", "cached") else "-",
                str(m.get("num_samples", "-")) if m else "-",
                str(skipped) if m else "-",
                note + (f" skipped {skipped}" if skipped and not note else ""),
            )
        )
    head = ("task", "main metric", "score", "samples", "skipped", "")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(5)]
    line = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
    out = [line.format(*head[:5]), line.format(*("-" * w for w in widths))]
    out += [(line.format(*r[:5]) + ("  " + r[5] if r[5] else "")).rstrip() for r in rows]
    for suite, aggs in summary["aggregates"].items():
        out.append("")
        out.append(f"{suite}:")
        width = max(len(a["name"]) for a in aggs)
        for a in aggs:
            partial = ", partial" if a["count"] < a["total"] else ""
            out.append(f"  {a['name']:<{width}}  {_fmt(a['value']):>6}  ({a['count']}/{a['total']}{partial})")
    if summary["missing"]:
        out.append("")
        out.append(f"missing datasets ({len(summary['missing'])}), skipped; lay them out under --data-dir:")
        for m in summary["missing"]:
            out.append(f"  {m['key']}: {m['reason']}")
    if summary["failed"]:
        out.append("")
        out.append(f"failed tasks ({len(summary['failed'])}):")
        for f in summary["failed"]:
            out.append(f"  {f['key']}: {f['error']}")
    examples = [(t["key"], e) for t in summary["tasks"] for e in t.get("skip_examples", [])]
    if examples:
        out.append("")
        out.append("skipped samples (first examples):")
        out += [f"  {k}: {e}" for k, e in examples[:10]]
    if summary.get("hint"):
        out += ["", f"hint: {summary['hint']}"]
    out.append("")
    out.append(
        f"{summary['counts']['done']} evaluated, {summary['counts']['cached']} cached, "
        f"{summary['counts']['missing']} missing, {summary['counts']['failed']} failed in "
        f"{summary['elapsed_s']:.1f} s; results: {summary['out']}"
    )
    return "\n".join(out)
