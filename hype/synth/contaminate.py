"""A contaminated pool shard: copies of evaluation images, for measuring decontamination
(`hype score --decontaminate`; tests/test_decontam.py and bench/decontam.py).

Each chosen evaluation image is written once per kind of copy, as a pool sample (`.json` with a uid,
`.txt`, the image):
    exact    the evaluation file's bytes
    jpeg     re-encoded as JPEG, quality 75
    resized  scaled to 75% of its side (Lanczos), PNG
    crop10   10% of each side cut off (a random 90% x 90% window), PNG
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from os import PathLike
from pathlib import Path

import numpy as np
from PIL import Image

from hype.data.samples import IMAGE_EXTS, SkipStats, iter_tar_samples
from hype.io import blake2b128_bytes

KINDS = ("exact", "jpeg", "resized", "crop10")


def _copy(data: bytes, ext: str, kind: str, rng: np.random.Generator) -> tuple[bytes, str]:
    if kind == "exact":
        return data, ext
    img = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = img.size
    if kind == "resized":
        img = img.resize((max(1, round(w * 0.75)), max(1, round(h * 0.75))), Image.Resampling.LANCZOS)
    elif kind == "crop10":
        cw, ch = max(1, round(w * 0.9)), max(1, round(h * 0.9))
        x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        img = img.crop((x, y, x + cw, y + ch))
    elif kind != "jpeg":
        raise ValueError(f"unknown kind of copy {kind!r}; one of {', '.join(KINDS)}")
    buf = io.BytesIO()
    if kind == "jpeg":
        img.save(buf, format="JPEG", quality=75)
        return buf.getvalue(), "jpg"
    img.save(buf, format="PNG")
    return buf.getvalue(), "png"


def eval_images(eval_tars: list[str | PathLike]) -> list[tuple[str, str, bytes, str]]:
    """(tar, key, image bytes, extension) of every image in the tars, in order."""
    out = []
    for tar in eval_tars:
        for s in iter_tar_samples(str(tar), SkipStats()):
            ext = next((e for e in IMAGE_EXTS if e in s.files), None)
            if ext is not None:
                out.append((str(tar), s.key, s.files[ext], ext))
    return out


def write_copies(
    images: list[tuple[str, str, bytes, str]],
    out: str | PathLike,
    kinds: tuple[str, ...] = KINDS,
    seed: int = 0,
    root: str | PathLike | None = None,
) -> list[dict]:
    """Write one pool sample per (image, kind) into the tar `out`; returns the truth rows
    {uid, kind, eval_shard, eval_key, key}.

    A copy's uid hashes its kind, its source's key and its source shard's path relative to `root` (default:
    the sources' common folder; pass the world's folder when its copies are written in several calls), never
    the absolute path: a world's copies get the same uids wherever the world is written, and so the same
    k-means sample and the same groups (bench/neardup_injected.py)."""
    if root is None:
        root = os.path.commonpath([os.path.dirname(os.path.abspath(im[0])) for im in images] or ["."])
    rng = np.random.default_rng(seed)
    truth = []
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w") as tar:
        for n, (shard, key, data, ext) in enumerate(images):
            name = Path(os.path.relpath(os.path.abspath(shard), os.path.abspath(root))).as_posix()
            if name.startswith("../"):
                raise ValueError(f"{shard} is not under root {root}: pass a folder that holds every source")
            for kind in kinds:
                uid = blake2b128_bytes(f"copy|{kind}|{name}|{key}".encode())
                skey = f"c{n:06d}{kind}"
                body, body_ext = _copy(data, ext, kind, rng)
                members = {
                    "json": json.dumps({"uid": uid, "key": skey}).encode(),
                    "txt": f"a copied evaluation image ({kind})".encode(),
                    body_ext: body,
                }
                for member_ext, payload in members.items():
                    info = tarfile.TarInfo(f"{skey}.{member_ext}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
                truth.append({"uid": uid, "kind": kind, "eval_shard": shard, "eval_key": key, "key": skey})
    return truth
