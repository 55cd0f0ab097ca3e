"""Copy detection from pixels: is one image a (re-encoded, resized, slightly cropped) copy of another? The
verification step of `hype score --decontaminate` (`hype.scoring.stage_decontam`) and of the near-duplicate
stage (`hype.scoring.stage_neardup`): the CLIP nearest neighbours are candidates, this decides. NumPy and
Pillow only (threadpoolctl sets BLAS's threads); `tar_work_images` reads a shard's images for both.

An image is kept as a square RGB uint8 "work image" of the check's `work_side` (`WORK_SIDE`, 128 px, 48
KiB; `work_image`: area-resampled, or enlarged bilinearly on an axis under the side) and described, for
the whole image and for windows covering `scales` of each side at `steps` x `steps` offsets, by two
thumbnails, each with its mean removed and unit L2 norm:
    colour  RGB intensities at `colour_size` px: which colours are where;
    edges   the horizontal and vertical differences of the luminance at `edge_size` px: where the edges
            are (a smooth background, a gradient or a flat colour, has none: it no longer dominates).
Two thumbnails' normalised cross-correlation (NCC) is their dot product. A third term compares each
colour channel's contrast: the NCC is blind to it (the colour thumbnail is normalised over its three
channels together, so an orange and a yellow object on white, whose blue contrast dominates, correlate at
0.96): per channel, the dot product of the two images' parts over the larger part's energy (the channel's
NCC times the ratio of its two contrasts), each with `contrast_slack` of the whole energy added above and
below (JPEG's chroma quantisation moves a faint channel's contrast by 20-50%: the slack keeps it from
deciding), the lowest of the three channels. The copy
similarity of two images is, over the windows of either image matched against the other's whole image
(so a pool image that is a crop of an evaluation image and one that contains it are both found), the best
window's lowest of the three: a copy must agree in colour layout, in each channel's contrast and in edges
at once. A pair that scores `refine_from` (0.6) or more is searched again with anisotropic windows: every
(width, height) pair of the `fine_scales` (97.5% to 85% of a side in steps of 2.5%), 1,849 windows. A
near-duplicate cropped unevenly (more off one axis than the other) is no square window, and on a striped
background the edges agree only when the window's scale is within ~1% (a 5% step puts the stripes out of
phase): the square search alone passed 87% / 83% of two synthetic worlds' true copies at 0.9, the second
search 97% / 95% (bench/copy_check_recall.py). Searching only the pairs that come close keeps its cost to
those (a few % of CLIP candidates; every true copy): ~2.9x the square search's time on CLIP neighbours.
Decontamination does without it (`stage_decontam.search_of`): its evaluation copies already pass, and the
second search there only flagged more look-alikes.
With `local_step` (both stages' checks) a pair at `local_from` (0.75) or more is searched a third time
around each side's best window: every offset and side within 2 steps of 0.75% of a side of the best's, per
axis (625 windows, each pair's own; those the image's edge clamps onto one another, once: 36 around the
whole image). The second search's grid is 2.5% of a side; a jittered copy on stripes cropped between its
windows scored 0.80-0.90 (tests/test_copydetect.py). On two synthetic worlds' candidates it passes 2 points
more of the true pairs at equal look-alikes passed (bench/RESULTS.md).
Without it, the square windows at 40-px edges (7 offsets per axis: 1.7% of a side apart at scale 0.9,
two-thirds of an edge pixel) scored 10% crops of 96-px images of four random ellipses under 0.9 for 42 of
100 (17 with small images enlarged bilinearly); with it, for none.

Exact on any machine: every sum that BLAS computes here is a sum of integers below 2^53 in float64, so its
value does not depend on the order BLAS adds in (the kernel the CPU gets, the blocking, the batch's shape).
The area weights are integers over `WEIGHT_ONE` (the resampled pixel sums are exact, then rounded to
float32 once), and the thumbnails are rounded to integers over `UNIT_ONE` before their dot products
(any partial sum of a dot product of two rows is at most ~2^40 in magnitude: by Cauchy-Schwarz, as
the rows' norms are ~2^20, whatever the thumbnail size).
The remaining sums (a row's mean and norm) are numpy's own, along a contiguous row: their order depends on
the row's length only. So a pair's copy similarity is the same bytes whether it is computed alone, in a
block of any size, on any thread count or CPU kernel (tests/test_copydetect.py, against numpy's int64
sums one pair at a time).

Why it is robust: thumbnails average away JPEG's block and chroma noise (the edges use the luminance,
which JPEG keeps at full resolution) and any resampling filter; resizing the whole image changes nothing at
that scale; a crop keeping s of each side at offset o is matched by the window of the nearest scale and
offset. Why it separates: different scenes with the same colours and background (the hard case of
bench/decontam.py: synthetic scenes drawn from one small grammar, which a small CLIP cannot tell apart)
have objects of other shapes, sizes or places, so their edge maps correlate far less than a copy's do.
It is not robust to flips, rotations, crops of more than ~15% of a side or overlays: those are not the
copies it was built for.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import lru_cache

import numpy as np
from PIL import Image
from threadpoolctl import threadpool_limits

from hype.data.imageprep import ImageError, decode_rgb
from hype.data.samples import SkipStats, iter_tar_samples
from hype.executor import usable_cpus

# An image is kept as this square RGB uint8 (48 KiB) until its pairs are checked. 128 px, so that the
# edges can be 40 px: on two worlds' candidate pairs, at 0.95 of the true pairs, 28-px edges on 64-px images
# passed 58 / 83 look-alikes that are no crop of each other, 40 px on 128-px images 40 / 30 (56 px loses
# copies: JPEG and resizing at that scale), and 24 / 16 with small images enlarged bilinearly (Pillow's BOX
# enlarges as a nearest neighbour: a 47-px image's edges become steps of 2 and 3 pixels, placed differently
# in its copy; bench/RESULTS.md, #37 item 5's seventh pass).
WORK_SIDE = 128
# In the fingerprints: change it when `work_image` changes.
WORK_FORMAT = f"rgb-{WORK_SIDE}-box-or-bilinear-up"
LUMA = np.array([299.0, 587.0, 114.0])  # ITU-R BT.601 (JPEG's luminance) x 1000: integer sums stay exact
WEIGHT_ONE = 1 << 16  # an area weight is an integer over this: pixel sums < 255,000 * 2^32 < 2^53, exact
UNIT_ONE = 1 << 20  # thumbnail entries are integers over this (exact in float32); dot products < 2^51

Descriptor = tuple[np.ndarray, np.ndarray]  # (colour rows, edge rows), row 0 the whole image


@dataclass(frozen=True)
class CopyCheck:
    """Settings of the pixel check (recorded in the matches' fingerprint)."""

    work_side: int = WORK_SIDE  # the work image's side (`work_image`)
    colour_size: int = 16  # colour thumbnail side in pixels
    edge_size: int = 40  # edge thumbnail side in pixels (28 on 64-px work images before #37 item 5's
    # seventh pass; finer edges pass fewer look-alikes at the same copies found, bench/RESULTS.md)
    scales: tuple[float, ...] = (0.95, 0.9, 0.85)  # window side / image side, besides the whole image
    steps: int = 7  # window offsets per axis per scale
    threshold: float = 0.9  # copy similarity at or above which a candidate is a copy
    contrast_slack: float = 0.3  # share of the colour energy added to each channel's contrast ratio
    anisotropic: bool = False  # windows of every (width scale, height scale) pair, not only square ones
    # A pair whose similarity is `refine_from` or more is searched again with anisotropic windows at
    # `fine_scales` (`fine`): a jittered copy's crop differs per axis and a striped background's edges need
    # the window's scale within ~1% (bench/copy_check_recall.py). None: no second search.
    refine_from: float | None = 0.6
    fine_scales: tuple[float, ...] = (0.975, 0.95, 0.925, 0.9, 0.875, 0.85)
    # A pair whose similarity is `local_from` or more after those searches is searched a third time around
    # each side's best window (`local_spans`): every offset and side within `local_radius` steps of
    # `local_step` of the best's, per axis. The second search's grid is 2.5% of a side, and on a striped
    # background the edges agree only within ~1% (bench/copy_check_recall.py). None: no third search.
    # 0.75: with 40-px edges a copy on stripes can score 0.8 before it (0.85 with 28-px edges).
    local_step: float | None = 0.0075
    local_radius: int = 2
    local_from: float = 0.75

    def __post_init__(self) -> None:
        if not (32 <= self.work_side <= 256 and self.work_side % 8 == 0):
            raise ValueError(f"copy check work_side {self.work_side}: 32 to 256 pixels, a multiple of 8")
        for name in ("colour_size", "edge_size"):
            if not 4 <= getattr(self, name) <= self.work_side // 2:
                size, most = getattr(self, name), self.work_side // 2
                raise ValueError(f"copy check {name} {size}: thumbnail size 4 to {most} pixels")
        if not 0.0 <= self.contrast_slack <= 1.0:
            raise ValueError(f"copy check contrast_slack {self.contrast_slack}: a share in [0, 1]")
        if not all(0.5 <= s < 1.0 for s in self.scales + self.fine_scales) or self.steps < 1:
            raise ValueError(
                f"copy check windows {self.scales}, {self.fine_scales} x {self.steps}: scales in [0.5, 1), "
                "steps >= 1"
            )
        if self.refine_from is not None and not 0.0 <= self.refine_from <= 1.0:
            raise ValueError(f"copy check refine_from {self.refine_from}: a similarity in [0, 1] (or None)")
        step, r = self.local_step, self.local_radius
        if step is not None and not (0.0 < step <= 0.05 and 1 <= r <= 4):
            raise ValueError(
                f"copy check local_step {step} x local_radius {r}: a step in (0, 0.05] of a side, 1 to 4 "
                "steps (or local_step None)"
            )

    def fine(self) -> CopyCheck:
        """The second search's settings: anisotropic windows at `fine_scales`, no further search."""
        return replace(self, scales=self.fine_scales, anisotropic=True, refine_from=None, local_step=None)

    def settings(self) -> dict:
        """The settings as recorded in a fingerprint; without a third search, as before it existed (so a
        run made before it is still complete)."""
        out = asdict(self)
        if self.local_step is None:
            for name in ("local_step", "local_radius", "local_from"):
                del out[name]
        return out | {
            "descriptor": "RGB NCC + per-channel contrast + luminance-gradient NCC, min",
            "sums": "exact",
        }


Span = tuple[float, float]  # (offset, side) of one axis, fractions of the side
Group = tuple[list[Span], list[Span]]  # (row spans, column spans): its windows are every pair of them


def _axis_groups(check: CopyCheck) -> list[list[Span]]:
    """The groups of windows, each the spans of both axes whose every (row span, column span) is a
    window: the whole image, then each scale's `steps` offsets; anisotropic, one group of them all (every
    pair of scales: a crop of one axis only is a window), else one group per scale (square windows)."""
    spans = [[(0.0, 1.0)]] + [
        [
            (float(o), s)
            for o in (np.linspace(0.0, 1.0 - s, check.steps) if check.steps > 1 else [(1.0 - s) / 2])
        ]
        for s in check.scales
    ]
    return [[span for group in spans for span in group]] if check.anisotropic else spans


def windows(check: CopyCheck) -> np.ndarray:
    """(n, 4) boxes (x0, y0, x1, y1) as fractions of the side; row 0 is the whole image."""
    return _boxes([(g, g) for g in _axis_groups(check)])


def _boxes(groups: list[Group]) -> np.ndarray:
    """(n, 4) boxes of `groups`' windows in `thumbnails`' order (row spans outer, column spans inner)."""
    boxes = [(x, y, x + sx, y + sy) for ys, xs in groups for y, sy in ys for x, sx in xs]
    return np.asarray(boxes, dtype=np.float64)


def local_spans(offset: float, side: float, check: CopyCheck) -> list[Span]:
    """The third search's spans of one axis around a best window's (`CopyCheck.local_step`): offset and
    side each moved by -r..r steps, the side kept in [0.5, 1] and the span inside the image."""
    step, r = check.local_step, check.local_radius
    out = []
    for j in range(-r, r + 1):
        s = min(max(side + j * step, 0.5), 1.0)
        out += [(min(max(offset + i * step, 0.0), 1.0 - s), s) for i in range(-r, r + 1)]
    return out


def _distinct(spans: list[Span]) -> list[Span]:
    """`spans` without repeats, in their order."""
    return list(dict.fromkeys(spans))


def _area_weights(spans: list[Span], out: int, side: int) -> np.ndarray:
    """(len(spans) * out, side) integers over `WEIGHT_ONE`: for each span (offset, side) of an axis, output
    pixel i averages the `side` input pixels over the span split in `out` equal parts (area resampling:
    overlap lengths, so a sub-pixel shift of the window is a smooth change). All spans at once: each
    span's rows are the same elementwise operations and the same row sums as one span alone."""
    lo = np.array([o for o, _ in spans], dtype=np.float64)[:, None]
    hi = lo + np.array([s for _, s in spans], dtype=np.float64)[:, None]
    edges = (lo + (hi - lo) * np.arange(out + 1) / out) * side  # (spans, out + 1)
    j = np.arange(side)
    overlap = np.minimum(edges[:, 1:, None], j + 1) - np.maximum(edges[:, :-1, None], j)
    overlap = np.clip(overlap, 0.0, None).reshape(len(spans) * out, side)
    w = np.rint(overlap / overlap.sum(axis=1, keepdims=True) * WEIGHT_ONE)
    w[np.arange(len(w)), w.argmax(axis=1)] += WEIGHT_ONE - w.sum(axis=1)  # each row sums to WEIGHT_ONE
    return w


ColumnBlocks = list[tuple[int, int, np.ndarray]]  # (lo, hi, weights of input pixels lo..hi-1)


@lru_cache(maxsize=16)
def _window_weights(check: CopyCheck, size: int, whole_only: bool) -> list[tuple[np.ndarray, ColumnBlocks]]:
    """`_group_weights` of the check's windows (`_axis_groups`), or of the whole image alone."""
    groups = [_axis_groups(check)[0][:1]] if whole_only else _axis_groups(check)
    return _group_weights([(g, g) for g in groups], size, check.work_side)


def _group_weights(groups: list[Group], size: int, side: int) -> list[tuple[np.ndarray, ColumnBlocks]]:
    """Per group of windows (ky row spans, kx column spans, its windows every pair of them) the resampling
    weights of its spans, float64 integers over `WEIGHT_ONE`: the rows' (ky * size, side), and the
    columns' in blocks (`_column_blocks`)."""
    return [
        (_area_weights(ys, size, side), _column_blocks(_area_weights(xs, size, side), size))
        for ys, xs in groups
    ]


def _column_blocks(weights: np.ndarray, size: int) -> ColumnBlocks:
    """(kx * size, side) column weights as blocks of `per` output columns of every span (block b: columns
    b * per to (b + 1) * per - 1 of each, `per` the smallest divisor of `size` of at least a fifth of it),
    each only over the input pixels [lo, hi) that its columns weigh: an output column averages a few
    pixels, so the product skips most of the zeros (the second search's 40-px edges: ~42 pixels of 128)."""
    side = weights.shape[1]
    per = next(d for d in range(1, size + 1) if size % d == 0 and 5 * d >= size)
    spans = weights.reshape(-1, size, side)  # (span, column, pixel)
    out = []
    for first in range(0, size, per):
        block = spans[:, first : first + per].reshape(-1, side)  # (span, column in the block)
        used = np.flatnonzero(block.any(axis=0))
        lo, hi = int(used[0]), int(used[-1]) + 1
        out.append((lo, hi, np.ascontiguousarray(block[:, lo:hi].T)))
    return out


def work_image(data: bytes, side: int = WORK_SIDE, upsample: bool = True) -> np.ndarray:
    """An encoded image as (side, side, 3) uint8 (`CopyCheck.work_side`), area-resampled (BOX); with
    `upsample` (`WORK_FORMAT`), an image smaller than `side` on either axis is resized bilinearly instead:
    Pillow's BOX enlarges as a nearest neighbour would, so a 47-px image's edges on 128 px are steps of 2
    and 3 pixels, placed differently in a copy (bench/RESULTS.md). Raises `ImageError` (the project's
    decoder and its pixel limit) for a file that cannot be decoded."""
    img, _ = decode_rgb(data, draft_size=side)
    smooth = upsample and min(img.size) < side
    resample = Image.Resampling.BILINEAR if smooth else Image.Resampling.BOX
    return np.asarray(img.resize((side, side), resample), dtype=np.uint8)


def occurrences(keys: list[str]) -> list[tuple[str, int]]:
    """(key, n) of each row of an embedded shard, n the rows before it with the same key: a key repeated in
    a tar names several images, and the n-th row of a key is its n-th image in file order."""
    seen: dict[str, int] = {}
    out = []
    for key in keys:
        out.append((key, seen.get(key, 0)))
        seen[key] = out[-1][1] + 1
    return out


def tar_work_images(
    tar: str, wanted: set[tuple[str, int]], side: int = WORK_SIDE, upsample: bool = True
) -> tuple[dict[tuple[str, int], np.ndarray], int]:
    """{(key, n): work image} (`work_image`'s `side` and `upsample`) of the `wanted` samples of one tar
    (`occurrences`; read once, in file order), and how many of them could not be decoded (they match
    nothing)."""
    keys = {key for key, _ in wanted}
    seen: dict[str, int] = {}
    out = {}
    for sample in iter_tar_samples(tar, SkipStats()):
        data = sample.image_bytes() if sample.key in keys else None
        if data is None:
            continue
        name = (sample.key, seen.get(sample.key, 0))
        seen[sample.key] = name[1] + 1
        if name in wanted:
            try:
                out[name] = work_image(data, side, upsample)
            except ImageError:
                pass
    return out, len(wanted - set(out))


_GRID_VALUES = 1 << 17  # float64 values of `_resample`'s grid at once (1 MiB)


def _resample(image: np.ndarray, groups: list[tuple[np.ndarray, ColumnBlocks]], size: int) -> np.ndarray:
    """(windows, channels, size, size) float32: every window of a (side, side, channels) image of
    integers (float64, < 2^18) in `windows` order, times WEIGHT_ONE^2 (`groups`: `_group_weights`). Per
    group of ky x kx windows: the ky row spans of every channel's plane, then those rows against each block
    of the kx column spans' columns (`_column_blocks`). Their sums are integers, exact whatever order BLAS
    adds them in and whichever zero terms it skips; float32 rounds them once."""
    side, c = image.shape[1:]
    planes = np.ascontiguousarray(image.transpose(0, 2, 1)).reshape(side, c * side)
    counts = [(len(wy) // size, blocks[0][2].shape[1] * len(blocks) // size) for wy, blocks in groups]
    out = np.empty((sum(ky * kx for ky, kx in counts), c, size, size), np.float32)
    at = 0
    for (wy, blocks), (ky, kx) in zip(groups, counts, strict=True):
        rows = (wy @ planes).reshape(ky * size * c, side)  # (ky row spans, size, c, side)
        nb, width = len(blocks), kx * size // len(blocks)
        # a few row spans at a time, through one grid (fresh memory costs page faults: ~10 ms per 100 MB)
        step = max(1, _GRID_VALUES // (size * c * kx * size))
        grid = np.empty((min(step, ky) * size * c, kx * size))  # (y span, row, c) x (block, x span, column)
        for y0 in range(0, ky, step):
            y1 = min(y0 + step, ky)
            part = grid[: (y1 - y0) * size * c]
            for b, (lo, hi, w) in enumerate(blocks):
                np.matmul(
                    rows[y0 * size * c : y1 * size * c, lo:hi], w, out=part[:, b * width : (b + 1) * width]
                )
            mine = out[at + y0 * kx : at + y1 * kx].reshape(y1 - y0, kx, c, size, nb, size // nb)
            mine[...] = part.reshape(y1 - y0, size, c, nb, kx, size // nb).transpose(0, 4, 2, 1, 3, 5)
        at += ky * kx
    return out


def _unit_rows(x: np.ndarray, out: np.ndarray) -> None:
    """`out` (float64): the rows of `x` (float32, changed in place) with their mean removed, scaled to unit
    norm and rounded to integers over `UNIT_ONE` (exact in float32, and in float64 for the products); a
    row with (almost) no variation stays zero: a flat image has no layout to compare and matches nothing.
    Each row's sums run along the row (numpy's pairwise sum: an order set by the row's length alone)."""
    x = x.reshape(len(x), -1)
    x -= x.mean(axis=1, keepdims=True)
    norms = np.sqrt(np.add.reduce(np.square(x), axis=1, keepdims=True))
    x *= UNIT_ONE / np.maximum(norms, 1e-12)
    np.rint(x, out=out)
    out[norms[:, 0] <= 1e-2] = 0.0


_ROWS_AT_ONCE = 32  # windows whose thumbnails are finished together (their float32 rows stay in cache)


def thumbnails(
    work: np.ndarray, check: CopyCheck, whole_only: bool = False, groups: list[Group] | None = None
) -> Descriptor:
    """The (colour, edge) thumbnail rows of a work image's windows (row 0: the whole image; `whole_only`:
    that row alone; `groups`: these windows instead of the check's), float64 integers over `UNIT_ONE` (the
    type of the products in `terms`). Each window's rows are its own: the same bytes whatever the other
    windows (its sums run along its rows, in blocks of `_ROWS_AT_ONCE` windows)."""
    if work.shape != (check.work_side, check.work_side, 3):
        raise ValueError(f"work image {work.shape}, the check's is ({check.work_side}, {check.work_side}, 3)")
    weights = lambda size: (  # noqa: E731
        _window_weights(check, size, whole_only)
        if groups is None
        else _group_weights(groups, size, check.work_side)
    )
    pixels = work.astype(np.float64)
    colour = _resample(pixels, weights(check.colour_size), check.colour_size)
    luma = _resample((pixels @ LUMA)[:, :, None], weights(check.edge_size), check.edge_size)[:, 0]
    n, size = len(colour), check.edge_size
    half = size * (size - 1)  # the horizontal differences, then the vertical ones
    out = np.empty((n, colour[0].size)), np.empty((n, 2 * half))
    edges = np.empty((min(n, _ROWS_AT_ONCE), 2, half), np.float32)
    for lo in range(0, n, _ROWS_AT_ONCE):
        hi = min(lo + _ROWS_AT_ONCE, n)
        c = colour[lo:hi].reshape(hi - lo, 3, -1)
        c *= np.float32(1.0 / (255.0 * WEIGHT_ONE**2))
        c -= c.mean(axis=2, keepdims=True)  # each channel's: a tint or brightness is no layout
        _unit_rows(c, out[0][lo:hi])
        y, e = luma[lo:hi], edges[: hi - lo]
        y *= np.float32(1.0 / (1000.0 * 255.0 * WEIGHT_ONE**2))
        np.subtract(y[:, :, 1:], y[:, :, :-1], out=e[:, 0].reshape(hi - lo, size, size - 1))
        np.subtract(y[:, 1:, :], y[:, :-1, :], out=e[:, 1].reshape(hi - lo, size - 1, size))
        _unit_rows(e, out[1][lo:hi])
    return out


def terms(wholes: Descriptor, windows_: Descriptor, check: CopyCheck) -> tuple[np.ndarray, ...]:
    """(colour NCC, lowest channel contrast, edge NCC), each (m, windows) float64, of m whole-image
    descriptors against one image's windows (module docstring): products and sums of integers, exact
    whatever m and the BLAS kernel, then scaled."""
    (wc, we), (vc, ve) = ([x.astype(np.float64, copy=False) for x in d] for d in (wholes, windows_))
    one = float(UNIT_ONE) ** 2
    side = wc.shape[1] // 3
    parts = [(wc[:, c * side : (c + 1) * side], vc[:, c * side : (c + 1) * side]) for c in range(3)]
    dots = [w @ v.T for w, v in parts]  # per channel: the colour NCC is their sum
    slack = check.contrast_slack * one
    contrast = [
        (dot + slack)
        / np.maximum(
            np.maximum(np.square(w).sum(axis=1)[:, None], np.square(v).sum(axis=1)[None, :]) + slack, 1.0
        )
        for dot, (w, v) in zip(dots, parts, strict=True)
    ]
    return (dots[0] + dots[1] + dots[2]) / one, np.minimum.reduce(contrast), (we @ ve.T) / one


def _match(wholes: Descriptor, windows_: Descriptor, check: CopyCheck) -> np.ndarray:
    """(m,) best window agreement (the lowest of the `terms`) of m whole-image descriptors with one image's
    windows."""
    return _best(wholes, windows_, check)[0]


def _best(wholes: Descriptor, windows_: Descriptor, check: CopyCheck) -> tuple[np.ndarray, np.ndarray]:
    """`_match` and, for each of the m rows, its best window's index (the first of equals)."""
    agree = np.minimum.reduce(terms(wholes, windows_, check))
    at = agree.argmax(axis=1)
    return agree[np.arange(len(at)), at].astype(np.float32), at


def copy_similarity(a: Descriptor, b: Descriptor, check: CopyCheck) -> float:
    """Copy similarity of two images' `thumbnails` (either one may be the crop of the other)."""
    whole = lambda d: (d[0][:1], d[1][:1])  # noqa: E731
    return float(max(_match(whole(a), b, check)[0], _match(whole(b), a, check)[0]))


def pair_similarities(
    a: np.ndarray,
    b: np.ndarray,
    pairs: np.ndarray,
    check: CopyCheck,
    workers: int = 0,
    enough: float | None = None,
) -> np.ndarray:
    """`copy_similarity` of the work images a[i] and b[j] for each row (i, j) of `pairs`; the pairs at
    `check.refine_from` or more searched again with `check.fine()`'s windows, and those then at
    `check.local_from` or more (with `check.local_step`) a third time around each side's best window
    (`local_spans`). A pair's similarity is the highest of its searches: a function of the pair alone,
    whatever the threshold. In the first two searches every image's windows are computed once for all its
    pairs and then dropped: memory is the whole-image thumbnails of the images in `pairs` plus one image's
    windows per worker (the fine search's 1,849: ~55 MiB in float64 at the near-duplicate stage's 40-px
    edges); the third search's windows (at most 625 at radius 2, ~19 MiB) are each pair's own.

    The images are spread over `workers` threads (0: the CPUs this process may use), each running BLAS on
    one thread: the products are small (a few rows against 148 windows), and BLAS's own threads on such
    products spin against each other and against any other load (4x slower per product on 2 busy cores,
    bench/copy_check.py). The result does not depend on the thread count nor on how the pairs are grouped:
    every product is exact (module docstring), and whether a pair is searched again, and where, depends on
    its own similarities alone.

    `enough`: a pair at `enough` or more after a search is not searched further, its value then a lower
    bound of its similarity (the further searches only raise it): for a caller that only asks whether a
    pair reaches a threshold at or below `enough` (the near-duplicate stage), the same answers for less
    work; a pair under `enough` gets its similarity, the same bytes as without it."""
    pairs, workers = np.asarray(pairs, dtype=np.int64).reshape(-1, 2), workers or usable_cpus()
    limit = np.inf if enough is None else enough  # a pair under it is searched further
    out, boxes = _search(a, b, pairs, check, workers)
    best = out.max(axis=1)
    if check.refine_from is not None and len(
        near := np.flatnonzero((best >= check.refine_from) & (best < limit))
    ):
        fine, fine_boxes = _search(a, b, pairs[near], check.fine(), workers)
        better = fine > out[near]  # per side: the second search's best window where it is better
        boxes[near] = np.where(better[:, :, None], fine_boxes, boxes[near])
        out[near] = np.maximum(out[near], fine)
    out = out.max(axis=1)
    if check.local_step is not None and len(
        near := np.flatnonzero((out >= check.local_from) & (out < limit))
    ):
        out[near] = np.maximum(out[near], _local(a, b, pairs[near], boxes[near], check, workers))
    return out


def _search(
    a: np.ndarray, b: np.ndarray, pairs: np.ndarray, check: CopyCheck, workers: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per pair and side s (0: a[i]'s windows against b[j]'s whole image, 1: the converse) the best
    agreement with `check`'s windows, (pairs, 2) float32, and that window's box, (pairs, 2, 4). Each image's
    windows are computed once, against the whole images of all its pairs' other sides: when `a is b` (the
    near-duplicate stage's pairs within one set), once for both sides."""
    out, boxes = np.full((len(pairs), 2), -1.0, np.float32), np.zeros((len(pairs), 2, 4))
    if not len(pairs):
        return out, boxes
    every, n = windows(check), len(pairs)
    shift = 0 if a is b else len(a)  # images numbered a's then b's (one numbering when they are one)
    image = lambda i: a[i] if shift == 0 or i < shift else b[i - shift]  # noqa: E731
    # one entry per pair and side (entry e: pair e % n, side e // n): its windowed image and the other
    windowed = np.concatenate([pairs[:, 0], pairs[:, 1] + shift])
    whole = np.concatenate([pairs[:, 1] + shift, pairs[:, 0]])
    with threadpool_limits(1), ThreadPoolExecutor(workers) as pool:
        used, rows = _wholes(pool, image, np.unique(whole), check)
        order = np.argsort(windowed, kind="stable")
        groups = np.split(order, np.flatnonzero(np.diff(windowed[order])) + 1)
        jobs = [(rows, np.searchsorted(used, whole[g]), image(windowed[g[0]])) for g in groups]
        for group, (found, at) in zip(groups, pool.map(_best_window, jobs, [check] * len(jobs)), strict=True):
            out[group % n, group // n], boxes[group % n, group // n] = found, every[at]
    return out, boxes


def _wholes(pool: ThreadPoolExecutor, image: Callable, used: np.ndarray, check: CopyCheck) -> tuple:
    """(used, (colour rows, edge rows)): the whole-image thumbnails of `image(i)` for i in `used`, kept in
    float32 (exact: integers of at most 2^20) for as long as the search holds them."""
    rows = list(pool.map(lambda i: thumbnails(image(i), check, whole_only=True), used.tolist()))
    return used, tuple(np.concatenate([r[p] for r in rows], dtype=np.float32) for p in range(2))


def _best_window(job: tuple, check: CopyCheck) -> tuple[np.ndarray, np.ndarray]:
    """One image's windows against the whole-image rows `at` of the other side's images."""
    rows, at, image = job
    return _best((rows[0][at], rows[1][at]), thumbnails(image, check), check)


def _local(
    a: np.ndarray, b: np.ndarray, pairs: np.ndarray, boxes: np.ndarray, check: CopyCheck, workers: int
) -> np.ndarray:
    """The third search (`pair_similarities`): per pair, the best of both sides' windows around that
    side's best box (`local_spans` of each axis) against the other side's whole image."""
    fine = check.fine()

    def one(job: tuple[int, int]) -> float:
        k, side = job
        image, other = (a, b)[side][pairs[k, side]], (b, a)[side][pairs[k, 1 - side]]
        x0, y0, x1, y1 = boxes[k, side].tolist()
        # each window once: where the image's edge clamps the spans (a best box at the whole image: 6 of
        # 25 per axis distinct) the repeats are the same windows, and only the best agreement is kept
        group = (_distinct(local_spans(y0, y1 - y0, check)), _distinct(local_spans(x0, x1 - x0, check)))
        found = _match(
            thumbnails(other, fine, whole_only=True), thumbnails(image, fine, groups=[group]), fine
        )
        return float(found[0])

    jobs = [(k, side) for k in range(len(pairs)) for side in (0, 1)]
    with threadpool_limits(1), ThreadPoolExecutor(workers) as pool:
        found = np.fromiter(pool.map(one, jobs), np.float32, len(jobs))
    return found.reshape(-1, 2).max(axis=1)
