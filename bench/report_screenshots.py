"""README screenshots of `hype report`'s selection sections, rendered by headless Chromium.

    python bench/report_screenshots.py --scores RUN --subset SUBSET.npy --out docs/img

RUN: a `hype score` run (the demo's `score` step: `hype run demo --until score`); SUBSET: a `hype select
--audit` subset of it. Each section (the term histograms with the cut-off, the dropped samples by main
deficit, the audits of the cut) is rendered alone in the report's own page shell (same CSS and escaping,
CSP kept) and screenshotted at 1280 px wide, then stored as a palette PNG (at most 150 KB each).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

from PIL import Image

from hype.io import read_json
from hype.report import page
from hype.report.collect import collect
from hype.report.selection import selection_view
from hype.report.thumbs import attach_thumbnails

MAX_BYTES = 150_000


def shell(body: str) -> str:
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; img-src data:; "
        "style-src 'unsafe-inline'\"><title>HYPE report</title>"
        f"<style>{page.CSS}{page.SELECTION_CSS}</style></head><body><main>{body}</main></body></html>"
    )


def shoot(html: str, png: Path, height: int) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("headless Chromium is not installed (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "page.html"
        src.write_text(html)
        raw = Path(tmp) / "raw.png"
        cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp}/profile"]
        cmd += [f"--screenshot={raw}", f"--window-size=1280,{height}", "--hide-scrollbars", src.as_uri()]
        subprocess.run(cmd, capture_output=True, check=True, timeout=120)
        img = Image.open(raw).convert("RGB")
    img = _trim(img)
    for colours in (128, 64, 32):
        img.quantize(colours, method=Image.Quantize.MEDIANCUT).save(png, optimize=True)
        if png.stat().st_size <= MAX_BYTES:
            break
    print(f"{png}: {img.size[0]}x{img.size[1]}, {png.stat().st_size / 1e3:.0f} KB")


def _trim(img: Image.Image) -> Image.Image:
    """Cut the page's empty bottom."""
    import numpy as np

    a = np.asarray(img).astype(int)
    rows = np.flatnonzero((np.abs(a - a[-1, -1]).sum(axis=2) > 30).any(axis=1))
    return img.crop((0, 0, img.size[0], min(img.size[1], int(rows[-1]) + 24))) if len(rows) else img


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scores", required=True)
    ap.add_argument("--subset", required=True)
    ap.add_argument("--out", default="docs/img")
    ap.add_argument("--gallery", type=int, default=6)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = collect(args.scores, args.subset, per_bucket=0, progress=False)
    summary = read_json(Path(args.subset).with_suffix(".json"))
    view = selection_view(args.scores, summary, metrics=data.metrics, per_term=args.gallery, progress=False)
    if view is None:
        raise SystemExit(f"{args.subset}: no subset.json beside it")
    data.cutoffs = dict(view.cutoffs)
    attach_thumbnails([s for g in view.gallery.values() for s in g], args.scores)
    shoot(shell(page._histograms(data)), out / "report-cutoffs.png", 900)
    # The gallery: the named decisive terms first, at most three groups (the README shows a glimpse).
    view.gallery = dict(
        sorted(view.gallery.items(), key=lambda kv: (kv[0][0] == "none alone", kv[0][0], kv[0][1] or ""))[:3]
    )
    shoot(shell(page._decisions(view) + page._gallery(view)), out / "report-dropped.png", 1800)
    shoot(shell(page._audits(view.audit)), out / "report-audits.png", 1400)


if __name__ == "__main__":
    main()
