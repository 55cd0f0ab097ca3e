"""The report's decontamination section: per task, the pool samples `hype score --decontaminate` found near
an evaluation image, pool thumbnail and evaluation thumbnail side by side with their cosine (the strongest
`per_task` matches of each task; counts for all). Images come from the tars as the other grids' do
(`hype.report.thumbs`); every text is escaped (`hype.report.page.e`).
"""

from __future__ import annotations

from dataclasses import dataclass
from os import PathLike

from hype.report.page import e, fmt
from hype.report.thumbs import attach_thumbnails
from hype.scoring.decontam import read_matches

CSS = (
    ".pairs{display:grid;grid-template-columns:repeat(auto-fill,minmax(260px,1fr));gap:10px}"
    ".pair{background:#fff;border:1px solid #e3e3e3;border-radius:6px;padding:6px}"
    ".pair .two{display:grid;grid-template-columns:1fr 1fr;gap:6px}"
    ".pair img,.pair .noimg{width:100%;aspect-ratio:1;object-fit:contain;background:#eee;display:block}"
)


@dataclass
class Thumb:
    """A sample whose thumbnail `attach_thumbnails` reads (`shard`, `key` -> `image`)."""

    shard: str
    key: str
    image: str | None = None


@dataclass
class Pair:
    task: str
    uid: str
    similarity: float
    copy_similarity: float | None  # None: matched on CLIP features alone
    pool: Thumb
    eval: Thumb


def matches_section(run_dir: str | PathLike, pool: str | None = None, per_task: int = 4) -> tuple[str, dict]:
    """(the HTML section, thumbnail counts); ("", {}) when the run was not decontaminated."""
    found = read_matches(run_dir)
    if found is None:
        return "", {}
    t = found.table
    pairs: list[Pair] = []
    shown: dict[str, int] = {}
    columns = (t.column(c).to_pylist() for c in t.column_names)
    for uid, shard, key, task, eshard, ekey, sim, copy in zip(*columns, strict=True):
        if shown.get(task, 0) < per_task:  # sorted by task, then similarity descending
            shown[task] = shown.get(task, 0) + 1
            copy = None if copy is None or copy != copy else copy  # NaN: no copy check
            pairs.append(Pair(task, uid, sim, copy, Thumb(shard, key), Thumb(eshard, ekey)))
    counts = attach_thumbnails([p.pool for p in pairs], run_dir, pool)
    eval_counts = attach_thumbnails([p.eval for p in pairs], run_dir)
    return render_section(pairs, found.marker, found.per_task()), {
        k: counts[k] + eval_counts[k] for k in counts
    }


def render_section(pairs: list[Pair], marker: dict, per_task: dict[str, int]) -> str:
    tasks = marker.get("tasks") or {}
    rows = "".join(
        f"<tr><td class='l mono'>{e(task)}</td>"
        f"<td>{int((tasks.get(task) or {}).get('eval_images', 0)):,}</td>"
        f"<td>{per_task.get(task, 0):,}</td></tr>"
        for task in sorted(set(tasks) | set(per_task))
    )
    by_task: dict[str, list[str]] = {}
    for p in pairs:
        by_task.setdefault(p.task, []).append(
            f"<div class='pair'><div class='two'>{_img(p.pool, 'pool sample ' + p.uid)}"
            f"{_img(p.eval, 'evaluation image ' + p.eval.key)}</div>"
            f"<div class='muted'>cos {p.similarity:.4f}"
            + ("" if p.copy_similarity is None else f" · copy {p.copy_similarity:.3f}")
            + f" · <span class='mono'>{e(p.uid)}</span> ~ "
            f"<span class='mono'>{e(p.eval.key)}</span></div></div>"
        )
    grids = "".join(
        f"<h3>{e(task)}</h3><div class='pairs'>{''.join(items)}</div>" for task, items in by_task.items()
    )
    return (
        f"<style>{CSS}</style><h2>Evaluation-set matches (decontamination)</h2>"
        "<p class='muted'>Pool samples whose CLIP image feature has cosine ≥ "
        f"{fmt(marker.get('threshold'), 4)} "
        f"with an image of an evaluation task ({e(marker.get('eval_dir', ''))})"
        + (
            f" and whose pixels are a copy of it (copy similarity ≥ {fmt(check.get('threshold'), 3)})"
            if (check := marker.get("copy_check"))
            else ""
        )
        + ": "
        f"{int(marker.get('flagged_samples', 0)):,} of {int(marker.get('pool_samples', 0)):,} samples. "
        "<span class='mono'>hype select --filter decontaminate</span> drops them. Left: pool; right: "
        "evaluation image.</p>"
        "<table><tr><th class='l'>task</th><th>evaluation images</th><th>matched pool samples</th></tr>"
        f"{rows}</table>{grids}"
    )


def _img(t: Thumb, alt: str) -> str:
    if t.image and t.image.startswith("data:image/"):
        return f"<img src='{e(t.image)}' alt='{e(alt)}'>"
    return "<div class='noimg'>image unavailable</div>"
