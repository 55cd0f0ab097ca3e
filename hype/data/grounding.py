"""GRIT's grounding in a webdataset sample's JSON, read the way HyCoCLIP prepares it (SPEC §2.6).

GRIT (Kosmos-2's grounded image-text pairs) stores in each sample's `.json` the rows `noun_chunks` and
`ref_exps`: `[start, end, x1, y1, x2, y2, score]`, a character span of `caption` and the box of what it
names, normalised by the image's width and height. HyCoCLIP's preparation (its
`utils/prepare_GRIT_webdataset.py`) takes noun chunks, then referring expressions, keeps the first box of
each distinct phrase, scales the box to pixels with `int(v * size)`, and keeps a crop only when its area
exceeds 32 x 32 pixels; a sample left without a box is dropped. Training then draws one box per sample.
"""

from __future__ import annotations

import math

MIN_BOX_AREA = 32 * 32  # HyCoCLIP's cutoff, in pixels of the stored image
NO_GROUNDING = "no_grounding"  # the skip reason of a sample with no usable box

Box = tuple[int, int, int, int]


def _row(row: object, caption: str, width: int, height: int) -> tuple[str, Box] | None:
    """(phrase, pixel box) of one GRIT row, or None when the row is malformed."""
    if not isinstance(row, (list, tuple)) or len(row) < 6:
        return None
    try:
        start, end, *xyxy = (float(v) for v in row[:6])
    except (TypeError, ValueError):
        return None
    if not all(math.isfinite(v) for v in (start, end, *xyxy)) or not 0 <= start < end <= len(caption):
        return None
    x1, y1, x2, y2 = (min(max(v, 0.0), 1.0) for v in xyxy)
    return caption[int(start) : int(end)], (
        int(x1 * width),
        int(y1 * height),
        int(x2 * width),
        int(y2 * height),
    )


def grit_boxes(
    meta: dict, caption: str, width: int, height: int, min_area: int = MIN_BOX_AREA
) -> list[tuple[str, Box]]:
    """The (phrase, pixel box) pairs HyCoCLIP trains on, in its order. Spans index the JSON's own
    `caption` where it has one (GRIT's), else `caption`; malformed rows are ignored."""
    text = meta.get("caption") if isinstance(meta.get("caption"), str) else caption
    seen: set[str] = set()
    out = []
    for key in ("noun_chunks", "ref_exps"):
        rows = meta.get(key)
        for row in rows if isinstance(rows, list) else ():
            got = _row(row, text, width, height)
            if got is None or got[0] in seen:
                continue
            seen.add(got[0])
            x1, y1, x2, y2 = got[1]
            if (x2 - x1) * (y2 - y1) > min_area:
                out.append(got)
    return out
