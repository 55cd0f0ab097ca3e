"""The training input pipeline: webdataset shards -> shuffled, decoded, augmented, tokenized batches.

`TrainStream` is an infinite `IterableDataset` (DataComp semantics: training runs for a fixed number of
samples seen, whatever the size of the data or subset). Each (rank, DataLoader worker) pair draws its
own stream from its own seed:

- `resampled=True` (DataComp's `--dataset-resampled`): every worker draws shards with replacement from the
  whole list, so any number of ranks x workers works with any number of shards;
- `resampled=False`: the shards are split into disjoint slices, one per rank x worker, each reshuffled
  every epoch (needs at least as many shards as ranks x workers).

Stages inside a worker: read tar -> keep subset samples (each as often as its uid appears in the subset)
-> shuffle buffer of raw bytes (cheap memory) -> decode and augment -> batch. Every skipped sample is
counted (`hype.data.samples.SkipStats`) and the counts travel with each batch to the training process.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from hype.data.grounding import NO_GROUNDING, grit_boxes
from hype.data.samples import RawSample, SkipStats, decode_pair, iter_tar_samples, sample_uid
from hype.data.subset_index import SubsetIndex

CAPTION_TRANSFORM_FAILED = "caption_transform_failed"

CaptionTransform = Callable[[str, dict], str]


class DataError(RuntimeError):
    """The data yields no usable sample at all (e.g. every image is corrupt or the subset matches none)."""


@dataclass
class _Progress:
    shards_read: int = 0
    passed: int = 0  # raw samples kept by the subset filter (repeats included)
    tried: int = 0  # samples out of the shuffle buffer and decoded, usable or not
    good: int = 0  # samples decoded into a training pair
    judge_at: int | None = None  # samples passed in the first `_give_up_after` shard reads


class TrainStream(IterableDataset):
    """Infinite stream of batches `{"images", "tokens", "skips", "shards_read"}` of `batch_size` samples
    (with `grounding_min_area`, also `box_images` and `box_tokens`: one GRIT box per sample, HyCoCLIP).

    `skips` and `shards_read` are what this worker saw since its previous batch, so the consumer can
    sum them. `generation` (the step a run starts or resumes at) enters the seed, so a resumed run draws
    fresh samples instead of replaying the beginning of the stream.
    """

    def __init__(
        self,
        shards: Sequence[str],
        *,
        batch_size: int,
        image_transform: Callable[[Image.Image], torch.Tensor],
        tokenize: Callable[[list[str]], torch.Tensor],
        caption_transform: CaptionTransform | None = None,
        needs_meta: bool = False,
        subset: SubsetIndex | None = None,
        resampled: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        generation: int = 0,
        shuffle_buffer: int = 2000,
        data_spec: str = "",
        grounding_min_area: int | None = None,
        unboxed: str = "skip",
    ):
        if not shards:
            raise ValueError("TrainStream needs at least one shard")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.shards = list(shards)
        self.batch_size = batch_size
        self.image_transform = image_transform
        self.tokenize = tokenize
        self.caption_transform = caption_transform
        self.needs_meta = needs_meta
        self.subset = subset
        self.resampled = resampled
        self.seed, self.rank, self.world_size, self.generation = seed, rank, world_size, generation
        self.shuffle_buffer = max(1, shuffle_buffer)
        self.data_spec = data_spec or f"{len(self.shards)} shards"
        # HyCoCLIP: each sample also yields one of its GRIT boxes (crop + phrase); None: plain pairs.
        self.grounding_min_area = grounding_min_area
        self.unboxed = unboxed  # skip: a sample without a box is skipped; whole: kept, masked (box_mask)

    # --- shard order --------------------------------------------------------------------------------

    def _worker(self) -> tuple[int, int]:
        info = get_worker_info()
        return (0, 1) if info is None else (info.id, info.num_workers)

    def _shard_order(self, rng: np.random.Generator, worker: int, num_workers: int) -> Iterator[str]:
        if self.resampled:
            n = len(self.shards)
            while True:
                yield self.shards[int(rng.integers(n))]
        slot, slots = self.rank * num_workers + worker, self.world_size * num_workers
        mine = self.shards[slot::slots]
        if not mine:
            raise DataError(
                f"{self.data_spec}: {len(self.shards)} shards cannot be split over {self.world_size} "
                f"rank(s) x {num_workers} worker(s); set data.resampled=true or use fewer data.workers"
            )
        while True:
            for i in rng.permutation(len(mine)):
                yield mine[int(i)]

    def _give_up_after(self, num_workers: int) -> int:
        # Shard reads whose samples, once all decoded, must hold one usable sample, or the data is declared
        # unusable. With resampling, 5 draws per shard reach all but ~0.7% of the shards.
        per_worker = (
            len(self.shards) if self.resampled else -(-len(self.shards) // (self.world_size * num_workers))
        )
        return 5 * max(per_worker, 1)

    # --- stages -------------------------------------------------------------------------------------

    def _raw(self, rng, worker, num_workers, stats: SkipStats, prog: _Progress) -> Iterator[RawSample]:
        limit = self._give_up_after(num_workers)
        for shard in self._shard_order(rng, worker, num_workers):
            for sample in iter_tar_samples(shard, stats):
                repeats = 1
                if self.subset is not None:
                    uid = sample_uid(sample, stats)
                    repeats = 0 if uid is None else self.subset.count(uid)
                for _ in range(repeats):
                    prog.passed += 1
                    yield sample
            prog.shards_read += 1
            if prog.shards_read == limit:
                # Judged on decoded samples, not on reads: the shuffle buffer holds up to `shuffle_buffer`
                # samples back, more than a few small shards hold, so none may be decoded yet.
                prog.judge_at = prog.passed
                if prog.passed == 0:
                    raise DataError(self._nothing_usable(prog, stats))

    def _check_usable(self, prog: _Progress, stats: SkipStats) -> None:
        """Stop once all samples of the first `_give_up_after` shard reads were decoded, none usable."""
        if prog.good == 0 and prog.judge_at is not None and prog.tried >= prog.judge_at:
            raise DataError(self._nothing_usable(prog, stats))

    def _nothing_usable(self, prog: _Progress, stats: SkipStats) -> str:
        if prog.passed == 0 and self.subset is not None:
            return (
                f"subset {self.subset.source} matched none of the samples in {prog.shards_read} shard reads "
                f"of {self.data_spec}; check that --subset was made for this --data"
            )
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(stats.counts.items())) or "none"
        examples = "; ".join(m for msgs in stats.examples.values() for m in msgs[:1])
        return (
            f"{self.data_spec}: no usable sample in {prog.tried} samples of {prog.shards_read} shard reads "
            f"(skipped: {counts})" + (f"; e.g. {examples}" if examples else "")
        )

    def _shuffled(self, items: Iterator[RawSample], rng: np.random.Generator) -> Iterator[RawSample]:
        # Reservoir of undecoded samples. Emission starts once `initial` items are in, and while the
        # buffer is below its size two items go in per item out, so it fills up quickly.
        size = self.shuffle_buffer
        initial = min(size, 100)
        buf: list[RawSample] = []
        for item in items:
            buf.append(item)
            if len(buf) < size:
                nxt = next(items, None)
                if nxt is not None:
                    buf.append(nxt)
            if len(buf) >= initial:
                i = int(rng.integers(len(buf)))
                buf[i], buf[-1] = buf[-1], buf[i]
                yield buf.pop()

    def _caption(self, sample: RawSample, caption: str, stats: SkipStats) -> str | None:
        if self.caption_transform is None:
            return caption
        try:
            meta = (sample.meta() or {}) if self.needs_meta else {}
            return self.caption_transform(caption, meta)
        except Exception as e:  # a user hook: count and skip the sample, never crash the worker
            stats.add(CAPTION_TRANSFORM_FAILED, f"{sample.where}: {type(e).__name__}: {e}")
            return None

    def _box(self, sample: RawSample, image: Image.Image, caption: str, rng, stats: SkipStats):
        """One GRIT box of the sample drawn by `rng`: (crop, phrase); None when it has none (a skip,
        counted, unless unboxed samples are kept whole)."""
        try:
            meta, why = sample.meta() or {}, "no noun_chunks/ref_exps box above the area cutoff"
        except ValueError as e:
            meta, why = {}, f"unreadable .json ({e})"
        boxes = grit_boxes(meta, caption, image.width, image.height, self.grounding_min_area)
        if boxes:
            phrase, box = boxes[int(rng.integers(len(boxes)))]
            return image.crop(box), phrase
        if self.unboxed == "skip":
            stats.add(NO_GROUNDING, f"{sample.where}: {why}")
        return None

    def __iter__(self) -> Iterator[dict]:
        worker, num_workers = self._worker()
        rng = np.random.default_rng([self.seed, self.rank, worker, self.generation])
        stats, prog = SkipStats(), _Progress()
        images: list[torch.Tensor] = []
        captions: list[str] = []
        box_images: list[torch.Tensor] = []
        box_texts: list[str] = []
        has_box: list[bool] = []
        shards_reported = 0
        for sample in self._shuffled(self._raw(rng, worker, num_workers, stats, prog), rng):
            prog.tried += 1
            pair = decode_pair(sample, stats)
            caption = None if pair is None else self._caption(sample, pair[1], stats)
            box, grounded = None, self.grounding_min_area is not None
            if caption is not None and grounded:
                box = self._box(sample, pair[0], pair[1], rng, stats)
                caption = None if box is None and self.unboxed == "skip" else caption
            if pair is None or caption is None:
                self._check_usable(prog, stats)
                continue
            images.append(self.image_transform(pair[0]))
            captions.append(caption)
            if grounded:
                # An unboxed sample kept whole carries its whole pair as a placeholder box, masked out.
                box_images.append(images[-1] if box is None else self.image_transform(box[0]))
                box_texts.append(caption if box is None else box[1])
                has_box.append(box is not None)
            prog.good += 1
            if len(images) == self.batch_size:
                batch = {
                    "images": torch.stack(images),
                    "tokens": self.tokenize(captions),
                    "skips": stats.take(),
                    "shards_read": prog.shards_read - shards_reported,
                }
                if grounded:
                    batch.update(
                        box_images=torch.stack(box_images),
                        box_tokens=self.tokenize(box_texts),
                        box_mask=torch.tensor(has_box),
                    )
                yield batch
                shards_reported = prog.shards_read
                images, captions, box_images, box_texts, has_box = [], [], [], [], []


def ignore_stop_signals(worker_id: int = 0) -> None:
    """DataLoader `worker_init_fn`: leave Ctrl-C and SIGTERM to the main process, which stops cleanly
    (checkpoint, then loader shutdown) instead of losing its workers mid-step."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def make_loader(
    stream: TrainStream, *, workers: int, pin_memory: bool = False, prefetch: int = 2
) -> DataLoader:
    """A DataLoader over already-batched `stream` items (`batch_size=None`)."""
    kwargs = {}
    if workers > 0:
        kwargs = {
            "persistent_workers": True,
            "prefetch_factor": prefetch,
            "worker_init_fn": ignore_stop_signals,
        }
    return DataLoader(stream, batch_size=None, num_workers=workers, pin_memory=pin_memory, **kwargs)
