"""PIL rendering of scenes, and deterministic image encoding.

Shapes are drawn at 2x and box-downsampled: cheap anti-aliasing that keeps small objects recognisable.
Encoders are called with fixed parameters and no metadata, so identical pixels give identical bytes.
"""

from __future__ import annotations

import io
import math
from dataclasses import replace

import numpy as np
from PIL import Image, ImageDraw, ImageEnhance, features

from hype.synth.scenes import COLORS, Obj, Scene

_SS = 2  # supersampling factor

EVAL_IMAGE_EXT = "webp" if features.check("webp") else "png"


def _background(scene: Scene, w: int, h: int) -> Image.Image:
    bg = scene.background
    if bg == "white":
        return Image.new("RGB", (w, h), (255, 255, 255))
    if bg == "black":
        return Image.new("RGB", (w, h), (0, 0, 0))
    if bg == "tinted":  # the scorer set's generic images: a gradient between two colours
        c0, c1, axis = scene.bg_params
        t = np.linspace(0.0, 1.0, h if axis == 0 else w, dtype=np.float32)
        ramp = (np.outer(1 - t, c0) + np.outer(t, c1)).round().astype(np.uint8)  # (n, 3)
        arr = np.broadcast_to(ramp[:, None, :] if axis == 0 else ramp[None, :, :], (h, w, 3))
        return Image.fromarray(np.ascontiguousarray(arr), "RGB")
    # Neutral backgrounds are built as one grey channel and expanded once: several times faster.
    if bg == "gradient":
        lo, hi, axis = scene.bg_params
        ramp = np.linspace(lo, hi, h if axis == 0 else w, dtype=np.float32).round().astype(np.uint8)
        grey = np.broadcast_to(ramp[:, None] if axis == 0 else ramp[None, :], (h, w))
    elif bg == "striped":
        c0, c1, frac, orient = scene.bg_params
        half = max(4.0, frac * min(w, h)) / 2
        ys, xs = np.arange(h, dtype=np.float32)[:, None], np.arange(w, dtype=np.float32)[None, :]
        coord = ys if orient == 0 else xs if orient == 1 else xs + ys
        stripe = np.where((np.floor(coord / half) % 2).astype(bool), np.uint8(c1), np.uint8(c0))
        grey = np.broadcast_to(stripe, (h, w))
    else:
        raise ValueError(f"unknown background {bg!r}")
    return Image.fromarray(np.ascontiguousarray(grey, dtype=np.uint8), "L").convert("RGB")


def _polygon(shape: str, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    if shape == "square":
        pts = [(math.cos(a), math.sin(a)) for a in np.radians([45, 135, 225, 315])]
        scale = r
    elif shape == "diamond":
        # Taller than wide, so it does not read as a tilted square.
        pts = [(0, -1), (0.62, 0), (0, 1), (-0.62, 0)]
        scale = r
    elif shape == "triangle":
        pts = [(math.cos(a), math.sin(a)) for a in np.radians([-90, 30, 150])]
        cy += 0.15 * r  # the centroid sits low in the bounding box; recentre visually
        scale = r * 1.1
    elif shape == "hexagon":
        pts = [(math.cos(a), math.sin(a)) for a in np.radians(np.arange(0, 360, 60))]
        scale = r
    elif shape == "star":
        pts = []
        for i in range(10):
            a = math.radians(-90 + 36 * i)
            rr = 1.0 if i % 2 == 0 else 0.42
            pts.append((rr * math.cos(a), rr * math.sin(a)))
        scale = r * 1.05
    elif shape == "cross":
        t = 0.34
        pts = [(-t, -1), (t, -1), (t, -t), (1, -t), (1, t), (t, t), (t, 1), (-t, 1), (-t, t), (-1, t)]
        pts += [(-1, -t), (-t, -t)]
        scale = r
    else:
        raise ValueError(f"unknown polygon shape {shape!r}")
    ca, sa = math.cos(math.radians(angle)), math.sin(math.radians(angle))
    return [(cx + scale * (x * ca - y * sa), cy + scale * (x * sa + y * ca)) for x, y in pts]


def _draw_obj(draw: ImageDraw.ImageDraw, obj: Obj, w: int, h: int) -> None:
    cx, cy, r = obj.cx * w, obj.cy * h, obj.r * min(w, h)
    color = COLORS[obj.color]
    if obj.shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=color)
    elif obj.shape == "ring":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), outline=color, width=max(2, round(0.38 * r)))
    else:
        draw.polygon(_polygon(obj.shape, cx, cy, r, obj.angle), fill=color)


def render(scene: Scene, width: int, height: int) -> Image.Image:
    """Render `scene` to an RGB image of exactly `width` x `height` pixels."""
    if scene.kind == "blank":
        return Image.new("RGB", (width, height), tuple(scene.bg_params[0]))
    if scene.kind == "noise":
        rng = np.random.default_rng(scene.seed)
        if scene.bg_params[0] == 0:
            arr = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
            return Image.fromarray(arr)
        small = rng.integers(
            0, 256, size=(int(rng.integers(3, 9)), int(rng.integers(3, 9)), 3), dtype=np.uint8
        )
        return Image.fromarray(small).resize((width, height), Image.BICUBIC)
    if scene.crop is not None:
        return _render_crop(scene, width, height)
    w, h = width * _SS, height * _SS
    # Backgrounds have no edges worth anti-aliasing: build them at 1x and upsample (2.5x faster).
    img = _background(scene, width, height)
    img = img.resize((w, h), Image.NEAREST)
    draw = ImageDraw.Draw(img)
    for obj in scene.objects:
        _draw_obj(draw, obj, w, h)
    return img.reduce(_SS)


def _render_crop(scene: Scene, width: int, height: int) -> Image.Image:
    """The square crop around `scene.target`, `width` px a side: the whole scene is drawn at the size
    that makes the crop that wide, then cut out (shifted inwards where it would leave the scene)."""
    if width != height:
        raise ValueError(f"crops are square, got {width}x{height}")
    index, half = scene.crop
    obj = scene.objects[index]
    full = max(width, round(width / (2 * half * obj.r)))
    img = render(replace(scene, crop=None), full, full)
    x0 = min(max(0, round(obj.cx * full - width / 2)), full - width)
    y0 = min(max(0, round(obj.cy * full - width / 2)), full - width)
    return img.crop((x0, y0, x0 + width, y0 + width))


def jitter_crop(w: int, h: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """The pixels `jitter` cuts off (left, top, right, bottom): its first draws from `rng`."""
    dx0, dx1 = (int(v) for v in rng.integers(0, max(1, w // 16) + 1, size=2))
    dy0, dy1 = (int(v) for v in rng.integers(0, max(1, h // 16) + 1, size=2))
    return dx0, dy0, dx1, dy1


def jitter(img: Image.Image, rng: np.random.Generator) -> Image.Image:
    """A near-duplicate: a small crop, a brightness change, and sometimes a resize."""
    w, h = img.size
    dx0, dy0, dx1, dy1 = jitter_crop(w, h, rng)
    out = img.crop((dx0, dy0, w - dx1, h - dy1))
    out = ImageEnhance.Brightness(out).enhance(float(rng.uniform(0.88, 1.12)))
    if rng.random() < 0.4:
        f = float(rng.uniform(0.85, 1.15))
        out = out.resize((max(8, round(out.width * f)), max(8, round(out.height * f))), Image.BILINEAR)
    return out


def ellipses_png(seed: int, side: int = 96) -> bytes:
    """Four random ellipses on a random colour, PNG: an image with detail everywhere, which the scene
    grammar's single objects on flat or striped backgrounds do not have (the copy check's tests and
    bench/copy_check_detail.py)."""
    rng = np.random.default_rng(seed)
    img = Image.new("RGB", (side, side), tuple(int(v) for v in rng.integers(0, 256, 3)))
    draw = ImageDraw.Draw(img)
    for _ in range(4):
        x, y = rng.integers(0, side - 20, 2)
        w, h = rng.integers(10, 40, 2)
        box = (int(x), int(y), int(x + w), int(y + h))
        draw.ellipse(box, fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def encode_jpeg(img: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=int(quality), optimize=False, progressive=False)
    return buf.getvalue()


def encode_eval(img: Image.Image) -> bytes:
    """Eval images: lossless WebP (PNG where Pillow lacks WebP) so labels never depend on artefacts."""
    buf = io.BytesIO()
    if EVAL_IMAGE_EXT == "webp":
        img.save(buf, format="WEBP", lossless=True, quality=80, method=0, exact=True)
    else:
        img.save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


def decode(data: bytes) -> Image.Image:
    with Image.open(io.BytesIO(data)) as im:
        return im.convert("RGB")
