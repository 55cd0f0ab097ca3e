"""Copy detection from pixels: is one image a (re-encoded, resized, slightly cropped) copy of another? The
verification step of `hype score --decontaminate` (`hype.scoring.stage_decontam`): the CLIP nearest
neighbours are candidates, this decides. NumPy and Pillow only.

An image's descriptor is a stack of small RGB thumbnails (`size` x `size`, each channel's mean removed,
unit L2 norm, area-resampled from a 64 x 64 copy of the image):
the whole image, then windows of it covering `scales` of each side at `steps` x `steps` offsets. The copy
similarity of two images is the best normalised cross-correlation of one image's whole thumbnail with any
window of the other, in both directions (so a pool image that is a crop of an evaluation image and one
that contains it are both found).

Why it is robust: thumbnails of 16 px average away JPEG's block and chroma noise and any resampling
filter; resizing the whole image changes nothing at that scale; a crop keeping s of each side at offset o
is matched by the window of the nearest scale and offset (grid step (1 - s) / (steps - 1) of the side, a
fraction of a thumbnail pixel). Why it separates: the mean and contrast are normalised away but the
layout is not, so two different scenes, even with the same colours and objects, correlate far less than
a copy does (bench/decontam.py measures both sides). It is not robust to flips, rotations, heavy crops
(more than ~15% of a side) or overlays: those are not the copies it was built for.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

import numpy as np
from PIL import Image

from hype.data.imageprep import decode_rgb

WORK_SIDE = 64  # an image is kept as this square RGB uint8 (12 KiB) until its pairs are checked


@dataclass(frozen=True)
class CopyCheck:
    """Settings of the pixel check (recorded in the matches' fingerprint)."""

    size: int = 16  # thumbnail side in pixels
    scales: tuple[float, ...] = (0.95, 0.9, 0.85)  # window side / image side, besides the whole image
    steps: int = 7  # window offsets per axis per scale
    threshold: float = 0.9  # copy similarity at or above which a candidate is a copy

    def __post_init__(self) -> None:
        if not 4 <= self.size <= WORK_SIDE // 2:
            raise ValueError(f"copy check thumbnail size {self.size}: use 4 to {WORK_SIDE // 2} pixels")
        if not all(0.5 <= s < 1.0 for s in self.scales) or self.steps < 1:
            raise ValueError(
                f"copy check windows {self.scales} x {self.steps}: scales in [0.5, 1), steps >= 1"
            )

    def settings(self) -> dict:
        return asdict(self) | {"work_side": WORK_SIDE, "descriptor": "RGB thumbnails, NCC"}


def windows(check: CopyCheck) -> np.ndarray:
    """(n, 4) boxes (x0, y0, x1, y1) as fractions of the side; row 0 is the whole image."""
    boxes = [(0.0, 0.0, 1.0, 1.0)]
    for s in check.scales:
        offsets = np.linspace(0.0, 1.0 - s, check.steps) if check.steps > 1 else [(1.0 - s) / 2]
        boxes += [(x, y, x + s, y + s) for y in offsets for x in offsets]
    return np.asarray(boxes, dtype=np.float64)


def _area_weights(lo: float, hi: float, out: int) -> np.ndarray:
    """(out, WORK_SIDE): output pixel i averages the input over [lo, hi] split in `out` equal parts (area
    resampling: exact overlap lengths, so a sub-pixel shift of the window is a smooth change)."""
    edges = (lo + (hi - lo) * np.arange(out + 1) / out) * WORK_SIDE
    j = np.arange(WORK_SIDE)
    overlap = np.clip(np.minimum(edges[1:, None], j + 1) - np.maximum(edges[:-1, None], j), 0.0, None)
    return overlap / overlap.sum(axis=1, keepdims=True)


@lru_cache(maxsize=8)
def _window_weights(check: CopyCheck) -> tuple[np.ndarray, np.ndarray]:
    boxes = windows(check)
    wx = np.stack([_area_weights(b[0], b[2], check.size) for b in boxes]).astype(np.float32)
    wy = np.stack([_area_weights(b[1], b[3], check.size) for b in boxes]).astype(np.float32)
    return wx, wy


def work_image(data: bytes) -> np.ndarray:
    """An encoded image as (WORK_SIDE, WORK_SIDE, 3) uint8; raises `ImageError` (the project's decoder and
    its pixel limit) for a file that cannot be decoded."""
    img, _ = decode_rgb(data, draft_size=WORK_SIDE)
    return np.asarray(img.resize((WORK_SIDE, WORK_SIDE), Image.Resampling.BOX), dtype=np.uint8)


def thumbnails(work: np.ndarray, check: CopyCheck) -> np.ndarray:
    """(windows, 3 * size * size) float32 rows of a work image, each channel's mean removed, unit norm (a flat
    image has no layout to compare: its rows stay zero and it matches nothing)."""
    wx, wy = _window_weights(check)
    n, t = wx.shape[:2]
    rows = wy @ (work.astype(np.float32) / 255.0).reshape(WORK_SIDE, WORK_SIDE * 3)  # (n, t, side * 3)
    rows = rows.reshape(n, t, WORK_SIDE, 3).transpose(0, 3, 1, 2).reshape(n, 3 * t, WORK_SIDE)
    x = (rows @ wx.transpose(0, 2, 1)).reshape(n, 3, t * t)  # (window, channel, pixel)
    x -= x.mean(axis=2, keepdims=True)
    x = x.reshape(n, -1)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return np.where(norms > 1e-2, x / np.maximum(norms, 1e-12), 0.0).astype(np.float32)


def copy_similarity(a: np.ndarray, b: np.ndarray) -> float:
    """Best NCC of either image's whole thumbnail with any window of the other (`thumbnails` rows)."""
    return float(max((b @ a[0]).max(), (a @ b[0]).max()))
