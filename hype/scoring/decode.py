"""Parallel, prefetched per-sample decoding for the embed stages (DESIGN §4.4: in the embedding worker).

A reader thread streams the tar (`hype.data.samples.iter_tar_samples`) and hands chunks of raw samples
to a pool of decode workers, keeping a bounded window in flight; results come back in tar order. Per
sample a worker parses the json (uid), the caption and the image, decodes and resizes it to each
model's input (uint8), or returns the reason it must be skipped. Tokenization and normalization happen
per batch in the embedding process.

Workers are processes by default (spawned once per stage set-up): decoding then never competes with
the model for the GIL. This module imports only Pillow and NumPy, so they start in well under a second.
`threads` is the lighter alternative for small machines. Both give identical results.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from hype.data.imageprep import ImageError, Preprocess, decode_rgb
from hype.data.samples import (
    BAD_CAPTION,
    BAD_JSON,
    NO_CAPTION,
    NO_IMAGE,
    NO_UID,
    RawSample,
    SampleSkip,
    SkipStats,
    iter_tar_samples,
    uid_from_meta,
)

NO_CLASS = "no_class"  # a labelled reference image without a readable .cls
DECODE_MODES = ("processes", "threads")
CHUNK = 16  # samples per task sent to a decode worker


@dataclass
class Decoded:
    """A sample ready for the models: uint8 pixels per preprocessing geometry."""

    where: str  # shard:key, for messages
    key: str
    uid: str
    text: str
    width: int
    height: int
    pixels: dict  # Preprocess.geometry -> (size, size, 3) uint8
    label: int | None = None


@dataclass
class Skipped:
    reason: str
    message: str


@dataclass(frozen=True)
class DecodeSpec:
    """What a decode worker needs (picklable; no model)."""

    preps: tuple[Preprocess, ...]
    draft: bool
    labelled: bool  # reference-class images (`.cls`) instead of pool samples (`.json` + `.txt`)
    label_required: bool = True  # False: any image of a webdataset folder (evaluation sets: `.cls` optional)

    def __call__(self, sample: RawSample) -> Decoded | Skipped:
        if self.labelled:
            label = _label(sample)
            if label is None and self.label_required:
                return Skipped(NO_CLASS, f"{sample.where}: no readable .cls member")
            uid, text, meta = "", "", {}
        else:
            label = None
            try:
                meta = sample.meta()
            except (ValueError, UnicodeDecodeError) as e:
                return Skipped(BAD_JSON, f"{sample.where}: unreadable .json ({e})")
            if meta is None:
                return Skipped(NO_UID, f"{sample.where}: no .json member (it holds the uid)")
            try:
                uid = uid_from_meta(meta, sample.where)  # the one uid reading (hype.data.uids)
            except SampleSkip as e:
                return Skipped(e.reason, str(e))
            try:
                text = sample.caption()
            except UnicodeDecodeError as e:
                return Skipped(BAD_CAPTION, f"{sample.where}: caption is not UTF-8 ({e})")
            if text is None:
                return Skipped(NO_CAPTION, f"{sample.where}: no .txt member")
        data = sample.image_bytes()
        if data is None:
            return Skipped(NO_IMAGE, f"{sample.where}: no jpg/jpeg/png/webp member")
        draft = max(p.size for p in self.preps) if self.draft else None
        try:
            img, (w, h) = decode_rgb(data, draft)
        except ImageError as e:
            return Skipped(e.reason, f"{sample.where}: {e}")
        pixels: dict = {}
        for prep in self.preps:
            if prep.geometry not in pixels:  # models at the same resolution share the resize
                pixels[prep.geometry] = prep.pixels(img)
        width, height = _dim(meta.get("original_width"), w), _dim(meta.get("original_height"), h)
        return Decoded(sample.where, sample.key, uid, text, width, height, pixels, label)

    def chunk(self, samples: list[RawSample]) -> list[Decoded | Skipped]:
        return [self(s) for s in samples]


def _dim(value, fallback: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else fallback


def _label(sample: RawSample) -> int | None:
    data = sample.files.get("cls")
    try:
        return int(data.decode().strip()) if data is not None else None
    except (UnicodeDecodeError, ValueError):
        return None


def _exit_with_parent(parent: int) -> None:
    """Decode-process initializer: exit when the embedding process is gone (killed with SIGKILL, say).

    A pool's workers share its queues' pipes, so they never see EOF when the parent dies; without this
    they would linger forever.
    """

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="hype-parent-watch", daemon=True).start()


# torch's OpenMP threads spin while they wait for work; with decode processes on the same cores that
# spinning takes the cycles decoding needs (bench/score_embed.py on 2 cores: 0.83 -> 0.885 of the
# model-only ceiling; the ceiling itself does not change). It only takes effect before OpenMP starts,
# so the CLI commands and the Ray actors set it before torch runs; a user's own setting wins.
SHARED_CORE_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def share_cores_with_decoders() -> dict[str, str]:
    """Set `SHARED_CORE_ENV` in this process's environment unless already set; returns the values."""
    for key, value in SHARED_CORE_ENV.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in SHARED_CORE_ENV}


_END = object()


def ordered_map(pool: Executor, fn: Callable, items: Iterable, window: int) -> Iterator:
    """`map(fn, items)` on the pool, in order, with at most `window` tasks in flight (prefetch).

    `items` is iterated by a reader thread (reading overlaps decoding and the model); an error while
    iterating is raised here. Stopping early (an exception in the consumer) stops the reader.
    """
    pending: queue.Queue = queue.Queue(maxsize=max(1, window))
    stop = threading.Event()

    def put(obj) -> bool:
        while not stop.is_set():
            try:
                pending.put(obj, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for item in items:
                if not put(pool.submit(fn, item)):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put(e)
        finally:
            put(_END)

    reader = threading.Thread(target=read, name="hype-tar-reader", daemon=True)
    reader.start()
    try:
        while (got := pending.get()) is not _END:
            if isinstance(got, BaseException):
                raise got
            yield got.result()
    finally:
        stop.set()
        reader.join()


def _chunks(items: Iterable, n: int) -> Iterator[list]:
    chunk: list = []
    for item in items:
        chunk.append(item)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


class DecodePool:
    """Decode workers (processes or threads) for one embedding worker; create once, reuse per shard."""

    def __init__(self, spec: DecodeSpec, workers: int, mode: str = "processes"):
        if mode not in DECODE_MODES:
            raise ValueError(f"decode mode must be one of {', '.join(DECODE_MODES)}, got {mode!r}")
        self.spec, self.workers, self.mode = spec, max(1, workers), mode
        self._pool: Executor | None = None

    def _executor(self) -> Executor:
        if self._pool is None:
            if self.mode == "processes":
                # spawn, not fork: the embedding process runs torch and (on Ray) gRPC threads.
                ctx = multiprocessing.get_context("spawn")
                self._pool = ProcessPoolExecutor(
                    self.workers, mp_context=ctx, initializer=_exit_with_parent, initargs=(os.getpid(),)
                )
            else:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="hype-decode")
        return self._pool

    def decode(self, path: str, stats: SkipStats, prefetch: int) -> Iterator[Decoded | Skipped]:
        """The shard's samples, decoded, in tar order; tar-level problems are added to `stats` at the end."""
        tar_stats = SkipStats()  # written by the reader thread only; merged when it is done
        window = max(2 * self.workers, prefetch // CHUNK)
        try:
            chunks = _chunks(iter_tar_samples(path, tar_stats), CHUNK)
            for results in ordered_map(self._executor(), self.spec.chunk, chunks, window):
                yield from results
        except BrokenProcessPool:  # a decode process died (e.g. a crash inside an image decoder)
            self.close()  # the retry (or the next shard) starts a fresh pool
            raise
        finally:
            stats.merge(tar_stats)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
