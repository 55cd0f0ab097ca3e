"""Thumbnails of a few samples, read straight from the pool tars (headers, then only the wanted images).

A sample's tar is the scores table's `shard` column, as given to `hype score`: used as is, else relative
to the run directory, else (with `--pool`) looked up by file name in the pool folder(s). Any of them may
be a URL; a tar on object storage is read by ranges (its headers, then only the wanted images).
"""

from __future__ import annotations

import base64
import io
from collections import defaultdict
from collections.abc import Iterable
from os import PathLike

from hype.data.samples import IMAGE_EXTS, ImageDecodeError, SkipStats, decode_image
from hype.io import AnyPath, open_input, storage
from hype.io.tar import index_samples

THUMB_PX = 160


def resolve_shard(shard: str, run_dir: AnyPath, pool_dirs: list[AnyPath]) -> AnyPath | None:
    p = storage.location(shard)
    relative = [] if storage.is_url(p) or p.is_absolute() else [storage.join(run_dir, shard)]
    for candidate in (p, *relative, *(d / p.name for d in pool_dirs)):
        if storage.is_file(candidate):
            return candidate
    return None


def attach_thumbnails(samples: Iterable, run_dir: str | PathLike, pool: str | None = None) -> dict:
    """Set `sample.image` (a data: URL) for every sample whose image can be read; returns counts."""
    run_dir = storage.location(run_dir)
    pool_dirs = [storage.location(p) for p in (pool.split("::") if pool else [])]
    pool_dirs = [p if storage.is_dir(p) else p.parent for p in pool_dirs]
    by_shard: dict[AnyPath | None, list] = defaultdict(list)
    for s in samples:
        by_shard[resolve_shard(s.shard, run_dir, pool_dirs) if s.shard else None].append(s)
    counts = {"shown": 0, "missing_shard": 0, "missing_sample": 0, "undecodable": 0}
    for path, group in by_shard.items():
        if path is None:
            counts["missing_shard"] += len(group)
            continue
        wanted: dict[str, list] = defaultdict(list)  # a sample can sit in the grids of both ε_i and ε_t
        for s in group:
            wanted[s.key].append(s)
        stats = SkipStats()
        with open_input(path) as f:
            for key, members in index_samples(path, stats):
                found = wanted.pop(key, None)
                if found is not None:
                    ext = next((e for e in IMAGE_EXTS if e in members), None)
                    if ext is None:
                        counts["missing_sample"] += len(found)
                        continue
                    off, size = members[ext]
                    f.seek(off)
                    try:
                        image = thumbnail(f.read(size))
                    except ImageDecodeError:
                        counts["undecodable"] += len(found)
                        continue
                    for s in found:
                        s.image = image
                    counts["shown"] += len(found)
                if not wanted:
                    break
        counts["missing_sample"] += sum(len(v) for v in wanted.values())
    return counts


def thumbnail(data: bytes, px: int = THUMB_PX) -> str:
    img = decode_image(data)
    img.thumbnail((px, px))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
