"""Readers for evaluation sets, on local disk or object storage (URLs, `hype.io.storage`). DESIGN §3
"Evaluation sets".

Webdataset tasks (DataComp / CLIP_benchmark layout), one folder per task:

    <folder>/classnames.txt                          one class name per line (classification)
    <folder>/zeroshot_classification_templates.txt   one prompt per line, class placeholder {c}
    <folder>/test/nshards.txt                        number of shards n
    <folder>/test/0.tar ... <n-1>.tar                samples <key>.<webp|png|jpg|jpeg> plus
        <key>.cls   class index as text                    (classification)
        <key>.npy   metadata row, e.g. WILDS [region, year, y] (WILDS and fairness tasks)
        <key>.txt   reference captions, one per line       (retrieval: Flickr, MSCOCO, synth/retrieval)

WinoGAViL (DataComp reads it from Hugging Face; hype defines this layout):

    <folder>/items.jsonl   one item per line: {"cue": "...", "candidates": [names],
                           "associations": [names ⊆ candidates], "candidate_images": [paths]}
    <folder>/images/...    candidate images; `candidate_images` are relative to <folder>; without it
                           the image of candidate c is images/<c>.<webp|png|jpg|jpeg>

Images are decoded and transformed in DataLoader worker processes, in batches, together with their
labels and metadata (one pass over the tars). A member that cannot be decoded, a sample missing its image
or label, and an unreadable tar are skipped and counted (`ReadStats`), never fatal and never silent.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from hype.data.imageprep import CORRUPT_IMAGE, ImageError, Preprocess, open_image
from hype.io import NPY_ERRORS, AnyPath, read_bytes, storage

IMAGE_EXTS = ("webp", "png", "jpg", "jpeg")  # CLIP_benchmark's order of preference
MAX_ERROR_EXAMPLES = 5


class TaskDataError(ValueError):
    """An evaluation set that is present but unusable; the message names the file and the fix."""


@dataclass
class ReadStats:
    """What a reader got through: samples used, samples skipped, unreadable tars/members, examples."""

    num_samples: int = 0
    num_skipped: int = 0
    num_read_errors: int = 0
    examples: list[str] = field(default_factory=list)

    def skip(self, message: str, *, read_error: bool = False) -> None:
        if read_error:
            self.num_read_errors += 1
        else:
            self.num_skipped += 1
        if len(self.examples) < MAX_ERROR_EXAMPLES:
            self.examples.append(message)

    def merge(self, other: ReadStats) -> None:
        self.num_samples += other.num_samples
        self.num_skipped += other.num_skipped
        self.num_read_errors += other.num_read_errors
        self.examples.extend(other.examples[: max(0, MAX_ERROR_EXAMPLES - len(self.examples))])

    def as_metrics(self) -> dict[str, int]:
        return {
            "num_samples": self.num_samples,
            "num_skipped": self.num_skipped,
            "num_read_errors": self.num_read_errors,
        }


# --- task folder files ----------------------------------------------------------------------------


def read_lines(path: AnyPath, what: str) -> list[str]:
    if not storage.is_file(path):
        raise TaskDataError(f"{path}: missing; the task folder needs its {what} (DataComp layout)")
    try:
        lines = [line.strip() for line in read_bytes(path).decode("utf-8").splitlines()]
    except UnicodeDecodeError as e:
        raise TaskDataError(f"{path}: not UTF-8 text ({e})") from None
    while lines and not lines[-1]:
        lines.pop()
    return lines


def read_classnames(folder: AnyPath) -> list[str]:
    """Class names, one per line; the line number is the class index of `.cls` labels."""
    path = folder / "classnames.txt"
    names = read_lines(path, "class names")
    blank = [i + 1 for i, n in enumerate(names) if not n]
    if blank or not names:
        where = f"blank line(s) {blank[:5]}" if blank else "no class names"
        raise TaskDataError(f"{path}: {where}; every line must name the class of that index")
    return names


def read_templates(folder: AnyPath) -> list[str]:
    """Zero-shot prompt templates with the `{c}` placeholder (str.format, like CLIP_benchmark)."""
    path = folder / "zeroshot_classification_templates.txt"
    templates = [t for t in read_lines(path, "prompt templates") if t]
    if not templates:
        raise TaskDataError(f"{path}: no templates; add lines such as 'a photo of a {{c}}.'")
    for t in templates:
        try:
            t.format(c="x")
        except (KeyError, IndexError, ValueError) as e:
            raise TaskDataError(f"{path}: template {t!r} does not format with {{c}} ({e!r})") from None
    return templates


def shard_paths(folder: AnyPath, split: str = "test") -> list[AnyPath]:
    """`<folder>/<split>/{0..n-1}.tar` from `nshards.txt`; every listed shard must exist."""
    present = storage.list_sizes(folder / split)  # one listing, not a request per shard
    nshards_file = folder / split / "nshards.txt"
    if "nshards.txt" not in present:
        raise TaskDataError(
            f"{nshards_file}: missing; write the number of shards (e.g. `echo 4 > {nshards_file}`)"
        )
    try:
        n = int(read_bytes(nshards_file).decode("utf-8", "replace").strip())
    except ValueError:
        raise TaskDataError(f"{nshards_file}: expected an integer number of shards") from None
    if n < 1:
        raise TaskDataError(f"{nshards_file}: {n} shards; the task has no data")
    paths = [folder / split / f"{i}.tar" for i in range(n)]
    missing = [p.name for p in paths if p.name not in present]
    if missing:
        raise TaskDataError(
            f"{folder / split}: {len(missing)} of {n} shards listed in nshards.txt are missing "
            f"({', '.join(missing[:5])}); download them again"
        )
    return paths


def count_samples(shards: Sequence[AnyPath]) -> int | None:
    """Number of samples with an image in the shards, from their tar headers (cheap: no data is read), for
    progress totals of tasks whose size the registry does not give; None when a tar cannot be listed."""
    from hype.io.tar import index_samples

    class Problems:
        seen = False

        def add(self, reason: str, message: str) -> None:
            self.seen = True

    total = 0
    problems = Problems()
    for shard in shards:
        total += sum(1 for _, files in index_samples(shard, problems) if any(e in files for e in IMAGE_EXTS))
    return None if problems.seen else total


# --- decoding -------------------------------------------------------------------------------------


_PIL_FORMATS = {"webp": ("WEBP",), "png": ("PNG",), "jpg": ("JPEG",), "jpeg": ("JPEG",)}


def decode_image(data: bytes, ext: str | None = None) -> Image.Image:
    """Decode now (`hype.data.imageprep.open_image`: pixel cap, 8 bits), so a truncated file fails here
    and not inside the transform. The extension is only a hint (PIL otherwise probes every plugin, a third
    of the decode time). Raises `ImageError`."""
    return open_image(data, formats=_PIL_FORMATS.get(ext or ""))[0]


def decode_npy(data: bytes) -> np.ndarray:
    # allow_pickle=False: a metadata file must never run code.
    return np.load(io.BytesIO(data), allow_pickle=False)


@dataclass
class WdsSpec:
    """What each webdataset sample must contain besides its image."""

    label: bool = True  # <key>.cls
    # <key>.npy: its first len(metadata_fields) values are kept (named by these fields); None: not read
    metadata_fields: tuple[str, ...] | None = None
    captions: bool = False  # <key>.txt, one caption per line


class WdsBatches(torch.utils.data.IterableDataset):
    """Batches of decoded samples from webdataset tars, split across DataLoader workers by shard.

    Yields dicts: `images` (b, 3, H, W) or None when b = 0, `labels` (b,) int64, `meta` (b, F) float64,
    `captions` list of caption lists, and `stats` (ReadStats of this batch, including skipped samples).
    """

    def __init__(self, shards: Sequence[AnyPath], transform: Preprocess, spec: WdsSpec, batch_size: int):
        super().__init__()
        self.shards = [str(s) for s in shards]
        self.transform = transform
        self.spec = spec
        self.batch_size = batch_size

    def __iter__(self) -> Iterator[dict]:
        import webdataset as wds

        from hype.io.tar import MEMBER_TOO_LARGE, read_samples

        # Errors raised while reading go to the stats of the batch being filled; `current` is swapped
        # for a new object at every yield, so a batch's stats never change after it left.
        current = [ReadStats()]

        class Problems:  # hype.io.tar reports a damaged tar here, then goes on with the next shard
            def add(self, reason: str, message: str) -> None:
                if reason == MEMBER_TOO_LARGE:  # one sample left out, unread: a skip, not a read error
                    current[0].skip(message)
                else:
                    current[0].skip(f"unreadable tar data: {message}", read_error=True)

        urls = [u["url"] for u in wds.split_by_worker([{"url": u} for u in self.shards])]
        samples = (
            {"__key__": key, "__url__": url, **files}
            for url in urls
            for key, files in read_samples(url, Problems())
        )
        batch: list[tuple] = []
        for sample in samples:
            item = self._decode(sample, current[0])
            if item is not None:
                batch.append(item)
                current[0].num_samples += 1
            if len(batch) >= self.batch_size:
                yield self._collate(batch, current[0])
                batch, current[0] = [], ReadStats()
        stats = current[0]
        if batch or stats.num_skipped or stats.num_read_errors:
            yield self._collate(batch, stats)

    def _decode(self, sample: dict, stats: ReadStats) -> tuple | None:
        where = f"{sample.get('__url__')}:{sample.get('__key__')}"
        ext = next((e for e in IMAGE_EXTS if e in sample), None)
        if ext is None:
            stats.skip(f"{where}: no image member ({'/'.join(IMAGE_EXTS)})")
            return None
        try:
            label = int(sample["cls"].decode().strip()) if self.spec.label else -1
        except KeyError:
            stats.skip(f"{where}: no .cls label")
            return None
        except (ValueError, UnicodeDecodeError):
            stats.skip(f"{where}: .cls is not an integer")
            return None
        meta = None
        if self.spec.metadata_fields is not None:
            if "npy" not in sample:
                stats.skip(f"{where}: no .npy metadata")
                return None
            try:
                meta = decode_npy(sample["npy"]).astype(np.float64).reshape(-1)
            except (OSError, *NPY_ERRORS) as e:
                stats.skip(f"{where}: unreadable .npy ({type(e).__name__}: {e})")
                return None
            need = len(self.spec.metadata_fields)
            if meta.shape[0] < need:
                stats.skip(
                    f"{where}: .npy has {meta.shape[0]} values, expected at least {need} "
                    f"({', '.join(self.spec.metadata_fields)})"
                )
                return None
            meta = meta[:need]
        captions = None
        if self.spec.captions:
            try:
                captions = [c.strip() for c in sample["txt"].decode("utf-8").splitlines() if c.strip()]
            except KeyError:
                stats.skip(f"{where}: no .txt captions")
                return None
            except UnicodeDecodeError:
                stats.skip(f"{where}: .txt is not UTF-8")
                return None
            if not captions:
                stats.skip(f"{where}: .txt holds no caption")
                return None
        try:
            image = self.transform.pixels(decode_image(sample[ext], ext))
        except ImageError as e:  # corrupt, or too many pixels to decode
            what = "corrupt" if e.reason == CORRUPT_IMAGE else "too large"
            stats.skip(f"{where}: {what} .{ext} ({e})")
            return None
        except Exception as e:  # PIL raises many types in the transform too; any of them means "skip"
            stats.skip(f"{where}: corrupt .{ext} ({type(e).__name__}: {e})")
            return None
        return image, label, meta, captions

    def _collate(self, batch: list[tuple], stats: ReadStats) -> dict:
        images = self.transform.batch([b[0] for b in batch], "cpu") if batch else None
        return {
            "images": images,
            "labels": torch.tensor([b[1] for b in batch], dtype=torch.int64),
            "meta": np.stack([b[2] for b in batch]) if batch and batch[0][2] is not None else None,
            "captions": [b[3] for b in batch] if self.spec.captions else None,
            "stats": stats,
        }


def wds_loader(
    folder: AnyPath,
    *,
    transform: Preprocess,
    spec: WdsSpec,
    batch_size: int,
    workers: int,
    pin_memory: bool = False,
) -> torch.utils.data.DataLoader:
    """A DataLoader over the task's shards: decoding in `workers` processes (at most one per shard)."""
    shards = shard_paths(folder)
    workers = max(0, min(workers, len(shards)))
    return torch.utils.data.DataLoader(
        WdsBatches(shards, transform, spec, batch_size),
        batch_size=None,
        num_workers=workers,
        pin_memory=pin_memory,
        prefetch_factor=4 if workers else None,
        collate_fn=_keep_stats,
    )


def _keep_stats(batch: dict) -> dict:
    # The default collate would turn ReadStats into something else; batches arrive ready-made.
    return batch


# --- WinoGAViL ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WinoItem:
    cue: str
    candidates: tuple[str, ...]
    associations: tuple[str, ...]
    images: tuple[str, ...]  # paths or URLs as text: a URL's filesystem object must not cross a fork


def read_winogavil(folder: AnyPath) -> tuple[list[WinoItem], ReadStats]:
    """Items of `<folder>/items.jsonl`; malformed lines are skipped and counted."""
    path = folder / "items.jsonl"
    if not storage.is_file(path):
        raise TaskDataError(f"{path}: missing; WinoGAViL needs items.jsonl (see hype/eval/readers.py)")
    stats, items = ReadStats(), []
    images = set(storage.list_sizes(folder / "images"))  # one listing, not a request per candidate
    for number, raw in enumerate(read_bytes(path).decode("utf-8").splitlines(), 1):
        if not raw.strip():
            continue
        try:
            items.append(_wino_item(json.loads(raw), folder, images))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            stats.skip(f"{path}:{number}: {type(e).__name__}: {e}")
    return items, stats


def _wino_item(obj: Any, folder: AnyPath, images_present: set[str]) -> WinoItem:
    if not isinstance(obj, dict):
        raise TypeError("not a JSON object")
    candidates = tuple(str(c) for c in obj["candidates"])
    associations = tuple(str(a) for a in obj["associations"])
    if not candidates or not associations:
        raise ValueError("needs non-empty candidates and associations")
    stray = [a for a in associations if a not in candidates]
    if stray:
        raise ValueError(f"associations not among the candidates: {stray}")
    if "candidate_images" in obj:
        images = tuple(str(folder / str(p)) for p in obj["candidate_images"])
        if len(images) != len(candidates):
            raise ValueError(f"{len(images)} candidate_images for {len(candidates)} candidates")
    else:
        images = tuple(str(_find_image(folder / "images", c, images_present)) for c in candidates)
    return WinoItem(str(obj["cue"]), candidates, associations, images)


def _find_image(folder: AnyPath, name: str, present: set[str]) -> AnyPath:
    for ext in IMAGE_EXTS:
        if f"{name}.{ext}" in present:
            return folder / f"{name}.{ext}"
    return folder / f"{name}.jpg"  # reported as unreadable when the item is loaded


class WinoDataset(torch.utils.data.Dataset):
    """One WinoGAViL item per index: its candidate images transformed, or the reason it is unusable."""

    def __init__(self, items: Sequence[WinoItem], transform: Preprocess):
        self.items = list(items)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        item = self.items[index]
        try:
            pixels = [
                self.transform.pixels(decode_image(read_bytes(p), os.path.splitext(p)[1][1:].lower()))
                for p in item.images
            ]
            images = self.transform.batch(pixels, "cpu")
        except Exception as e:  # a missing or corrupt candidate image makes the item unusable
            return {"item": item, "images": None, "error": f"{item.cue!r}: {type(e).__name__}: {e}"}
        return {"item": item, "images": images, "error": None}


def wino_loader(items: Sequence[WinoItem], transform: Preprocess, *, batch_size: int, workers: int):
    """Batches of whole items, about `batch_size` images each (items hold 5 to 12 candidates)."""
    per_batch = max(1, batch_size // 12)
    return torch.utils.data.DataLoader(
        WinoDataset(items, transform),
        batch_size=per_batch,
        num_workers=max(0, min(workers, os.cpu_count() or 1)),
        collate_fn=list,
    )
