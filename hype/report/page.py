"""The report page: one self-contained HTML file (inline SVG and CSS, images as data: URLs, no script).

Everything that comes from data (captions, paths, keys, JSON summaries) is untrusted web text and goes
through `html.escape`; the page also carries a Content-Security-Policy that forbids scripts and any
non-inline resource, so even a mistake in escaping could not run code or fetch anything.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

import numpy as np

from hype import __version__
from hype.report.collect import BUCKETS, ReportData
from hype.report.selection import NO_DEFICIT, SelectionView

POOL_COLOUR = "#d62728"  # HYPE App. A: the unfiltered pool in red, HYPE's subset in green
SUBSET_COLOUR = "#2ca02c"
CUT_COLOUR = "#111111"  # the selection's cut-off on each term's histogram
FLAG_COLOUR = "#d62728"  # an audit group kept at < 1/4 of the overall fraction
LABELS = {
    "eps_i": ("ε<sub>i</sub>", "image specificity"),
    "eps_t": ("ε<sub>t</sub>", "text specificity"),
    "neg_d_l": ("−d<sub>L</sub>", "negative Lorentzian distance"),
    "cos_theta": ("cos θ", "CLIP similarity"),
    "c_in": ("c<sub>IN</sub>", "ImageNet-cluster bonus"),
}
PLAIN = {"eps_i": "ε_i", "eps_t": "ε_t", "neg_d_l": "−d_L", "cos_theta": "cos θ", "c_in": "c_IN"}

CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:0;background:#fafafa;
color:#222}
main{max-width:1240px;margin:0 auto;padding:24px 28px 48px}
h1{font-size:24px;margin:0 0 4px}
h2{font-size:18px;margin:32px 0 10px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 8px}.muted{color:#666}.mono{font-family:ui-monospace,Menlo,Consolas,monospace}
.cards{display:flex;flex-wrap:wrap;gap:12px;margin:14px 0}.card{background:#fff;border:1px solid #e3e3e3;
border-radius:6px;padding:10px 14px;min-width:150px}.card b{display:block;font-size:20px}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(380px,1fr));gap:14px}
.chart{background:#fff;border:1px solid #e3e3e3;border-radius:6px;padding:8px}
.legend span{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;vertical-align:-1px}
table{border-collapse:collapse;background:#fff}
td,th{border:1px solid #e3e3e3;padding:4px 8px;text-align:right}
th{background:#f3f3f3}td.l,th.l{text-align:left}
.grid{display:grid;grid-template-columns:repeat(5,1fr);gap:10px}
.bucket{background:#fff;border:1px solid #e3e3e3;border-radius:6px;padding:6px}
.bucket h4{margin:2px 0 6px;font-size:13px}
figure{margin:0 0 8px;padding:4px;border:2px solid transparent;border-radius:4px}
figure.in{border-color:#2ca02c}figure img,.noimg{width:100%;aspect-ratio:1;object-fit:contain;background:#eee;
display:block;image-rendering:auto}
.noimg{display:flex;align-items:center;justify-content:center;color:#999;font-size:12px}
figcaption{font-size:12px;word-break:break-word;margin-top:3px}figcaption .v{color:#777;font-size:11px}
.badge{background:#2ca02c;color:#fff;border-radius:3px;padding:0 4px;font-size:10px;margin-left:4px}
.warn{background:#fff4e5;border:1px solid #f0c36d;padding:8px 12px;border-radius:6px}
"""


def e(value: object) -> str:
    """Escape untrusted text for HTML text and attribute contexts."""
    return html.escape("" if value is None else str(value), quote=True)


def tag(name: str, text: str = "", **attrs: object) -> str:
    """An SVG element; attribute names use `_` for `-` (and `cls` for `class`), values are escaped."""
    a = " ".join(f"{'class' if k == 'cls' else k.replace('_', '-')}='{e(v)}'" for k, v in attrs.items())
    return f"<{name} {a}>{text}</{name}>" if text else f"<{name} {a}/>"


def num(x: float) -> str:
    return f"{x:.2f}"


def fmt(x: float | None, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:.{digits}g}"


def render(
    data: ReportData,
    *,
    run_summary: Mapping | None,
    subset_summary: Mapping | None,
    thumbs: Mapping[str, int],
    sections: Sequence[str] = (),
    selection: SelectionView | None = None,
) -> str:
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        # No script may run and nothing may be fetched: images are data: URLs, styles are inline.
        "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; img-src data:; "
        "style-src 'unsafe-inline'\">",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        "<title>HYPE report</title>",
        f"<style>{CSS}</style></head><body><main>",
        "<h1>HYPE report</h1>",
        f"<div class='muted'>scores <span class='mono'>{e(data.run_dir)}</span>"
        + (f" · subset <span class='mono'>{e(data.subset_path)}</span>" if data.subset_path else "")
        + f" · hype {e(__version__)} · {e(datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC'))}"
        + "</div>",
        _cards(data),
        _histograms(data),
        _stats_table(data),
        _correlation(data),
        *(_bucket_grid(data, m) for m in data.buckets),
        _selection_sections(selection),
        _thumb_note(thumbs),
        *sections,  # optional sections of other modules (hype.report.decontam)
        _summary_section("Selection", subset_summary, "subset.json next to the subset file"),
        _summary_section("Scoring run", run_summary, "summary.json of the run directory"),
        "</main></body></html>",
    ]
    return "\n".join(p for p in parts if p)


def _cards(d: ReportData) -> str:
    cards = [("scored samples", f"{d.pool_rows:,}")]
    if d.subset_path:
        pct = 100 * d.subset_in_pool / max(d.pool_rows, 1)
        cards += [
            ("subset rows", f"{d.subset_rows:,}"),
            ("subset uids in scores", f"{d.subset_in_pool:,} ({pct:.1f}%)"),
            ("subset uids not scored", f"{d.subset_unique - d.subset_in_pool:,}"),
        ]
    body = "".join(
        f"<div class='card'><span class='muted'>{e(k)}</span><b>{e(v)}</b></div>" for k, v in cards
    )
    return f"<div class='cards'>{body}</div>"


def _histograms(d: ReportData) -> str:
    legend = f"<span style='background:{POOL_COLOUR};opacity:.6'></span>pool (all scored samples)"
    if d.subset_path:
        legend += f"<span style='background:{SUBSET_COLOUR};opacity:.6'></span>subset"
    if any(v is not None for v in d.cutoffs.values()):
        legend += f"<span style='background:{CUT_COLOUR}'></span>cut-off of the selection (see below)"
    charts = "".join(f"<div class='chart'>{_histogram_svg(d, m)}</div>" for m in d.metrics)
    return (
        "<h2>Metric distributions</h2><p class='muted'>Share of samples per bin (HYPE App. A); dotted lines "
        f"mark the means; values beyond the pool's 0.1–99.9% range fall in the edge bins.</p>"
        f"<div class='legend'>{legend}</div><div class='charts'>{charts}</div>"
    )


def _histogram_svg(d: ReportData, m: str) -> str:
    w, h, left, right, top, bottom = 380, 230, 46, 22, 26, 34
    pw, ph = w - left - right, h - top - bottom
    edges = d.edges[m]
    pool = d.pool_hist[m] / max(d.pool_hist[m].sum(), 1)
    series = [("pool", pool, POOL_COLOUR)]
    if d.subset_path and d.subset_hist[m].sum():
        series.append(("subset", d.subset_hist[m] / d.subset_hist[m].sum(), SUBSET_COLOUR))
    ymax = max(float(s.max()) for _, s, _ in series) or 1.0
    lo, hi = float(edges[0]), float(edges[-1])
    bw = pw / (len(edges) - 1)

    def x_of(v: float) -> float:
        return left + (min(max(v, lo), hi) - lo) / (hi - lo) * pw

    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' class='hist' data-metric='{e(m)}' "
        f"viewBox='0 0 {w} {h}' width='100%'>"
    ]
    _, name = LABELS.get(m, (e(m), ""))
    subtitle = tag("tspan", e(name), fill="#777", font_weight="400", font_size="12")
    out.append(tag("text", f"{_svg_label(m)} {subtitle}", x=left, y=16, font_size=14, font_weight=600))
    out.append(tag("line", x1=left, y1=top + ph, x2=left + pw, y2=top + ph, stroke="#999"))
    out.append(tag("line", x1=left, y1=top, x2=left, y2=top + ph, stroke="#999"))
    for cls, share, colour in series:
        for i, v in enumerate(share):
            if v <= 0:
                continue
            bh = v / ymax * ph
            x, y, bar_w = num(left + i * bw), num(top + ph - bh), num(max(bw - 1, 0.5))
            out.append(
                tag(
                    "rect",
                    cls=f"bar {cls}",
                    x=x,
                    y=y,
                    width=bar_w,
                    height=num(bh),
                    fill=colour,
                    fill_opacity="0.55",
                )
            )
    means = [("pool", d.pool_stats[m].get("mean"), POOL_COLOUR)]
    if d.subset_path and d.subset_stats.get(m, {}).get("count"):
        means.append(("subset", d.subset_stats[m].get("mean"), SUBSET_COLOUR))
    for cls, mean, colour in means:
        if mean is not None and math.isfinite(mean):
            x = num(x_of(mean))
            line = {"x1": x, "y1": top, "x2": x, "y2": top + ph, "stroke": colour}
            out.append(tag("line", cls=f"mean {cls}", **line, stroke_width="1.5", stroke_dasharray="3,3"))
    if m in d.cutoffs:
        out.extend(_cutoff_mark(d.cutoffs[m], lo, hi, x_of, top, ph, left + pw))
    for t in np.linspace(lo, hi, 5):
        x = num(x_of(float(t)))
        out.append(tag("line", x1=x, y1=top + ph, x2=x, y2=top + ph + 4, stroke="#999"))
        label = e(fmt(float(t), 3))
        out.append(tag("text", label, x=x, y=top + ph + 16, font_size=11, text_anchor="middle", fill="#444"))
    for frac in (0.0, 0.5, 1.0):
        y = num(top + ph - frac * ph + 4)
        label = f"{100 * frac * ymax:.1f}%"
        out.append(tag("text", label, x=left - 4, y=y, font_size=10, text_anchor="end", fill="#444"))
    out.append("</svg>")
    return "".join(out)


def _svg_label(m: str) -> str:
    return {
        "eps_i": "ε<tspan baseline-shift='sub' font-size='10'>i</tspan>",
        "eps_t": "ε<tspan baseline-shift='sub' font-size='10'>t</tspan>",
        "neg_d_l": "−d<tspan baseline-shift='sub' font-size='10'>L</tspan>",
        "cos_theta": "cos θ",
        "c_in": "c<tspan baseline-shift='sub' font-size='10'>IN</tspan>",
    }.get(m, e(m))


def _stats_table(d: ReportData) -> str:
    names = ["pool mean", "pool std", "pool p05", "pool p50", "pool p95"]
    if d.subset_path:
        names += ["subset mean", "subset std", "subset p50"]
    rows = ["<tr><th class='l'>metric</th>" + "".join(f"<th>{n}</th>" for n in names) + "</tr>"]
    for m in d.metrics:
        p = d.pool_stats[m]
        q = p.get("quantiles", {})
        values = [p.get("mean"), p.get("std"), q.get("p05"), q.get("p50"), q.get("p95")]
        if d.subset_path:
            s = d.subset_stats.get(m, {})
            values += [s.get("mean"), s.get("std"), s.get("quantiles", {}).get("p50")]
        cells = "".join(f"<td>{fmt(v)}</td>" for v in values)
        rows.append(f"<tr><td class='l'>{LABELS.get(m, (e(m),))[0]}</td>{cells}</tr>")
    return "<h3>Summary statistics</h3><table>" + "".join(rows) + "</table>"


def _correlation(d: ReportData) -> str:
    if d.correlation is None:
        return ""
    ms = d.metrics
    cell, left, top = 64, 70, 26
    w, h = left + cell * len(ms) + 10, top + cell * len(ms) + 10
    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' class='corr' viewBox='0 0 {w} {h}' "
        f"width='{w}' height='{h}'>"
    ]
    for j, m in enumerate(ms):
        centre, middle = left + j * cell + cell / 2, top + j * cell + cell / 2 + 4
        out.append(tag("text", _svg_label(m), x=centre, y=top - 8, font_size=12, text_anchor="middle"))
        out.append(tag("text", _svg_label(m), x=left - 8, y=middle, font_size=12, text_anchor="end"))
    for i in range(len(ms)):
        for j in range(len(ms)):
            r = float(d.correlation[i, j])
            x, y = left + j * cell, top + i * cell
            out.append(tag("rect", cls="cell", x=x, y=y, width=cell - 2, height=cell - 2, fill=_diverging(r)))
            ink = "#fff" if math.isfinite(r) and abs(r) > 0.6 else "#222"
            at = {"x": x + cell / 2 - 1, "y": y + cell / 2 + 4}
            out.append(tag("text", fmt(r, 2), **at, font_size=13, text_anchor="middle", fill=ink))
    out.append("</svg>")
    return (
        "<h2>Metric correlations</h2><p class='muted'>Pearson correlation over the scored pool.</p>"
        + "".join(out)
    )


def _diverging(r: float) -> str:
    if not math.isfinite(r):
        return "#dddddd"
    r = max(-1.0, min(1.0, r))
    a, b = (np.array([255, 255, 255]), np.array([178, 24, 43]) if r > 0 else np.array([33, 102, 172]))
    c = a + (b - a) * abs(r)
    return "#" + "".join(f"{int(round(v)):02x}" for v in c)


def _bucket_grid(d: ReportData, m: str) -> str:
    sym, name = LABELS.get(m, (e(m), ""))
    edges = d.bucket_edges[m]
    cols = []
    for k, samples in enumerate(d.buckets[m]):
        lo_p, hi_p = 100 * k // BUCKETS, 100 * (k + 1) // BUCKETS
        figs = []
        for s in samples:
            img = (
                f"<img src='{e(s.image)}' alt='sample {e(s.uid)}'>"
                if s.image and s.image.startswith("data:image/")
                else "<div class='noimg'>image unavailable</div>"
            )
            badge = "<span class='badge'>in subset</span>" if s.in_subset else ""
            cls = " class='in'" if s.in_subset else ""
            values = " · ".join(
                f"{PLAIN.get(k2, k2)} {fmt(v, 3)}"
                for k2, v in s.values.items()
                if k2 in ("eps_i", "eps_t", "cos_theta")
            )
            figs.append(
                f"<figure{cls}>{img}<figcaption>{_caption(s.text)}{badge}"
                f"<br><span class='v'>{e(values)}</span></figcaption></figure>"
            )
        cols.append(
            f"<div class='bucket'><h4>{lo_p}–{hi_p}% "
            f"<span class='muted'>({fmt(edges[k], 3)} … {fmt(edges[k + 1], 3)})</span></h4>"
            + ("".join(figs) or "<div class='muted'>no samples</div>")
            + "</div>"
        )
    return (
        f"<h2>Samples by percentile of {sym} ({e(name)})</h2><p class='muted'>Five groups of 20% of the pool "
        f"(HYPE Fig. 3), a fixed pseudo-random sample of each, in ascending order of {sym}; "
        "green frames mark samples in the subset.</p>"
        f"<div class='grid'>{''.join(cols)}</div>"
    )


def _caption(text: str) -> str:
    if not text.strip():
        return "<span class='cap muted'><i>(empty caption)</i></span>"
    return f"<span class='cap'>{e(_clip(text))}</span>"


def _clip(text: str, n: int = 160) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _thumb_note(thumbs: Mapping[str, int]) -> str:
    missing = sum(v for k, v in thumbs.items() if k != "shown")
    if not missing:
        return ""
    detail = ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in thumbs.items() if k != "shown" and v)
    return (
        f"<p class='warn'>{missing} thumbnail(s) could not be shown ({e(detail)}). Pass --pool with the "
        "folder of the pool shards if they moved since scoring.</p>"
    )


def _summary_section(title: str, summary: Mapping | None, where: str) -> str:
    if not summary:
        return f"<h2>{e(title)}</h2><p class='muted'>No {e(where)} found.</p>"
    rows = []
    for key, value in _flatten(summary):
        cls = (
            " style='background:#fff4e5'" if "skip" in key.lower() and value not in ("0", "{}", "[]") else ""
        )
        rows.append(f"<tr{cls}><td class='l mono'>{e(key)}</td><td class='l'>{e(value)}</td></tr>")
    return f"<h2>{e(title)}</h2><p class='muted'>From the {e(where)}.</p><table>{''.join(rows)}</table>"


def _flatten(obj: Mapping, prefix: str = "", depth: int = 0) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for k, v in obj.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and depth < 2 and v:
            out.extend(_flatten(v, key + ".", depth + 1))
        else:
            text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
            out.append((key, text if len(text) <= 300 else text[:299] + "…"))
    return out


# --- the selection: cut-offs, why samples were dropped, audits of the cut (hype.report.selection) -------

SELECTION_CSS = """
.gallery{display:grid;grid-template-columns:repeat(6,1fr);gap:10px}
.gallery figure{background:#fff;border:1px solid #e3e3e3}
.audits{display:grid;grid-template-columns:repeat(auto-fill,minmax(520px,1fr));gap:14px}
.flag{color:#b01c1c}
"""


def _cutoff_mark(
    value: float | None, lo: float, hi: float, x_of, top: float, ph: float, right: float
) -> list[str]:
    """The cut-off line on a term's histogram (with an arrow when it lies beyond the drawn range)."""
    if value is None or not math.isfinite(value):
        note = "no cut-off (none alone)"
        return [
            tag("text", e(note), cls="nocut", x=right, y=top - 8, font_size=9, text_anchor="end", fill="#555")
        ]
    x = num(x_of(value))
    beyond = "→" if value > hi else ("←" if value < lo else "")
    return [
        tag("line", cls="cutoff", x1=x, y1=top - 4, x2=x, y2=top + ph, stroke=CUT_COLOUR, stroke_width="2"),
        tag("text", e(f"cut {fmt(value, 3)}{beyond}"), x=x, y=top - 6, font_size=10, text_anchor="middle"),
    ]


def _selection_sections(view: SelectionView | None) -> str:
    if view is None:
        return ""
    parts = [f"<style>{SELECTION_CSS}</style>"]
    if view.note:
        parts.append(f"<p class='warn'>Selection: {e(view.note)}.</p>")
    if view.decisions:
        parts.append(_decisions(view))
    if view.gallery:
        parts.append(_gallery(view))
    parts.append(_audits(view.audit))
    return "\n".join(parts)


def _term_name(term: str | None) -> str:
    if term is None:
        return "–"
    return LABELS[term][0] if term in LABELS else e(term)


def _decisions(view: SelectionView) -> str:
    d = view.decisions
    cut = view.cut.get("score")
    head = (
        "<h2>Why samples were dropped</h2><p class='muted'>The cut keeps "
        f"{d.get('kept_rows', 0):,} samples (score ≥ {e(fmt(cut, 6))}); of the {d.get('dropped_rows', 0):,} "
        "eligible samples it drops, the <b>decisive term</b> is the one whose change to its pool median "
        "alone would keep the sample (<i>none alone</i>: no single term would), the <b>main term</b> the one "
        "that holds it down the most (in score units), the <b>main deficit</b> the term below its pool "
        "median on which the sample sits lowest in the pool (the lowest percentile of its contribution). "
        "The black line on each histogram above is that term's cut-off: the "
        "value at which a sample with every other term at its pool median reaches the cut.</p>"
    )
    if "decisive" not in d:
        return head + f"<p class='muted'>{e(d.get('note', 'no per-term attribution'))}</p>"
    rows = [
        "<tr><th class='l'>term</th><th>decisive for</th><th>main term of</th><th>main deficit of</th></tr>"
    ]
    main, deficit = d.get("main", {}), d.get("deficit", {})
    for term, n in d["decisive"].items():
        m = f"{main.get(term, 0):,}" if term != NONE_ALONE_LABEL else "–"
        low = f"{deficit[term]:,}" if term in deficit else "–"
        rows.append(f"<tr><td class='l'>{_term_name(term)}</td><td>{n:,}</td><td>{m}</td><td>{low}</td></tr>")
    return head + f"<table class='decisions'>{''.join(rows)}</table>"


NONE_ALONE_LABEL = "none alone"


def _gallery(view: SelectionView) -> str:
    out = [
        "<h3>Dropped samples by main deficit</h3><p class='muted'>A fixed pseudo-random sample of the "
        "dropped samples, grouped by main deficit (the term below its pool median at the lowest pool "
        "percentile; at a tight cut no single term is decisive for most), with the five values.</p>"
    ]
    for deficit in sorted(view.gallery, key=lambda k: (k == NO_DEFICIT, k)):
        title = (
            f"main deficit: {_term_name(deficit)}" if deficit != NO_DEFICIT else "no term below its median"
        )
        figs = []
        for s in view.gallery[deficit]:
            img = (
                f"<img src='{e(s.image)}' alt='sample {e(s.uid)}'>"
                if s.image and s.image.startswith("data:image/")
                else "<div class='noimg'>image unavailable</div>"
            )
            values = " · ".join(f"{PLAIN.get(k, k)} {fmt(v, 3)}" for k, v in s.values.items())
            figs.append(
                f"<figure class='dropped' data-deficit='{e(deficit)}'>{img}<figcaption>{_caption(s.text)}"
                f"<br><span class='v'>{e(values)}</span></figcaption></figure>"
            )
        out.append(f"<h4>{title}</h4><div class='gallery'>{''.join(figs)}</div>")
    return "".join(out)


AUDIT_TITLES = {
    "concept": "per concept (k-means cluster of c<sub>IN</sub>)",
    "class": "per reference class",
    "language": "per caption language",
    "size": "per image size (shorter side)",
    "domain": "per URL domain",
}
AUDIT_BARS = 15  # groups drawn per audit (the largest)


def _audits(audit: Mapping | None) -> str:
    head = (
        "<h2>Audits of the cut</h2><p class='muted'>Kept fraction per group (the largest groups); the dashed "
        "line is the overall kept fraction, red bars the groups kept at less than a quarter of it.</p>"
    )
    if not audit or ("note" in audit and len(audit) == 1):  # select without --audit writes only a note
        return (
            head + "<p class='muted'>No audit in the subset.json: run <span class='mono'>hype select "
            "--audit</span>.</p>"
        )
    charts, notes = [], []
    for name, a in audit.items():
        if not isinstance(a, Mapping):
            continue
        if "groups" not in a:
            notes.append(f"<li>{e(name)}: {e(a.get('note', ''))}</li>")
            continue
        charts.append(f"<div class='chart'>{_audit_svg(name, a)}</div>")
        if a.get("too_small"):  # groups not drawn nor flagged one by one: what they lost together
            from hype.select.audit import too_small_line

            notes.append(f"<li class='too-small'>{e(name)}: {e(too_small_line(a['too_small']))}</li>")
    flags = [f for a in audit.values() if isinstance(a, Mapping) for f in a.get("flags", [])]
    out = head + f"<div class='audits'>{''.join(charts)}</div>"
    if flags:
        out += "<h3>Flags</h3><ul class='flags'>" + "".join(
            f"<li class='flag'>{e(f)}</li>" for f in flags[:40]
        )
        out += "</ul>"
    if notes:
        out += "<ul class='muted'>" + "".join(notes) + "</ul>"
    return out


def _audit_svg(name: str, a: Mapping) -> str:
    from hype.select.audit import FLAG_RATIO, MIN_ROWS

    groups = list(a["groups"].items())[:AUDIT_BARS]
    listed = sum(v["rows"] for v in a["groups"].values()) or 1
    overall = a.get("overall", sum(v["kept"] for v in a["groups"].values()) / listed)
    bar_h, left, right, top = 18, 150, 110, 30
    w, h = 520, top + bar_h * len(groups) + 24
    pw = w - left - right
    xmax = max([overall * 1.25, *(v["kept_frac"] for _, v in groups), 1e-9])
    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' class='audit' data-audit='{e(name)}' "
        f"viewBox='0 0 {w} {h}' width='100%'>",
        tag(
            "text",
            f"{AUDIT_TITLES.get(name, e(name))}".replace("<sub>", "").replace("</sub>", ""),
            x=4,
            y=16,
            font_size=14,
            font_weight=600,
        ),
    ]
    for i, (g, v) in enumerate(groups):
        y = top + i * bar_h
        flagged = v["rows"] >= MIN_ROWS and v["kept_frac"] < FLAG_RATIO * overall
        colour = FLAG_COLOUR if flagged else SUBSET_COLOUR
        ink = {"fill": FLAG_COLOUR, "font_weight": 600} if flagged else {}  # a 0% bar has no width to colour
        out.append(tag("text", e(_clip(g, 24)), x=left - 6, y=y + 13, font_size=11, text_anchor="end", **ink))
        width = num(max(v["kept_frac"] / xmax * pw, 0.5))
        out.append(
            tag(
                "rect",
                cls="bar flagged" if flagged else "bar",
                x=left,
                y=y + 2,
                width=width,
                height=bar_h - 5,
                fill=colour,
                fill_opacity="0.75",
            )
        )
        label = f"{100 * v['kept_frac']:.1f}% of {v['rows']:,}"
        out.append(tag("text", e(label), x=left + pw + 6, y=y + 13, font_size=11, fill="#444"))
    x = num(left + overall / xmax * pw)
    y2 = top + bar_h * len(groups)
    out.append(
        tag("line", cls="overall", x1=x, y1=top - 4, x2=x, y2=y2, stroke="#222", stroke_dasharray="4,3")
    )
    out.append(
        tag(
            "text",
            e(f"overall {100 * overall:.1f}%"),
            x=x,
            y=y2 + 14,
            font_size=10,
            text_anchor="middle",
            fill="#222",
        )
    )
    if a.get("note"):
        out.append(tag("text", e(_clip(str(a["note"]), 90)), x=4, y=h - 2, font_size=9, fill="#777"))
    out.append("</svg>")
    return "".join(out)
