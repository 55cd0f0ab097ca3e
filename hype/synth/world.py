"""`make_world`: the whole synthetic world (clean set, noisy pool, eval tasks, truth) in one folder.

Determinism: each part draws from its own named RNG stream (`SeedSequence(seed, spawn_key=(crc32(name),))`),
so changing `size` changes the pool and nothing else, and the same arguments give byte-identical files.
The world is built in a hidden sibling folder and renamed into place at the end, so `out` is either the
previous state or a complete world, never half of one; `world.json` is written last inside it: the world's
completion marker (the run contract, `hype.io.runs`), with the fingerprint of the settings that make it.
A rerun with the same settings finds that marker and returns at once; other settings need --overwrite.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from os import PathLike
from pathlib import Path

import pyarrow as pa

from hype import __version__
from hype.data.uids import save_subset
from hype.executor import PoolExecutor, Progress, Stage
from hype.io import blake2b128_bytes, check_own_folder, replace_tree, sha256_bytes, write_text
from hype.io.runs import fingerprint, is_done, write_marker
from hype.io.tar import read_samples, write_tar
from hype.synth.eval_tasks import (
    OBJECT_CLASSES,
    RETRIEVAL_TASK,
    TASK_NAMES,
    TASKS,
    EvalItem,
    plan_classification,
    plan_reference,
    plan_retrieval,
    render_items,
    task_folder,
)
from hype.synth.grounding import grounding
from hype.synth.noise import NOISE_KINDS, NoiseSpecError, parse_noise
from hype.synth.pool import Sample, plan_clean, plan_pool, render_sample
from hype.synth.render import EVAL_IMAGE_EXT
from hype.synth.rng import stream
from hype.synth.shards import FileWriter, ShardSample, write_img2dataset_shard, write_parquet

FORMAT_VERSION = 1
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
METADATA_ROWS_PER_FILE = 100_000
MAX_SHARD_SIZE = 10_000  # keys are {shard:05d}{index:04d}, like img2dataset's
PROXY_FOLDER = "proxy"  # the proxy task set, beside eval/ (`_make_proxy`)
PROXY_MARKER = "proxy.json"
PROXY_KEY = "p"  # the proxy's sample keys start with it; eval's start with "s"


class SynthError(ValueError):
    """Bad arguments or an output folder that cannot be used; the message says how to fix it."""


TRUTH_SCHEMA = pa.schema(
    [
        ("uid", pa.string()),
        ("key", pa.string()),
        ("shard", pa.int32()),
        ("noise", pa.string()),
        ("text_level", pa.int8()),
        ("image_level", pa.int8()),
        ("shape", pa.string()),
        ("color", pa.string()),
        ("count", pa.int8()),
        ("size", pa.string()),
        ("position", pa.string()),
        ("background", pa.string()),
        ("caption", pa.string()),
        ("source_uid", pa.string()),
        ("true_caption", pa.string()),
        ("image_kind", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
    ]
)

METADATA_SCHEMA = pa.schema(
    [
        ("uid", pa.string()),
        ("url", pa.string()),
        ("text", pa.string()),
        ("original_width", pa.int32()),
        ("original_height", pa.int32()),
        ("sha256", pa.string()),
    ]
)


def _check_args(
    size: int, seed: int, clean_size: int, eval_size: int, reference_per_class: int, shard_size: int
):
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise SynthError(msg)

    need(
        isinstance(size, int) and size > 0,
        f"--size must be a positive number of pool samples (e.g. 2000), got {size}",
    )
    need(isinstance(seed, int) and seed >= 0, f"--seed must be a non-negative integer (e.g. 0), got {seed}")
    need(clean_size > 0, f"--clean-size must be positive (leave it out to use --size), got {clean_size}")
    need(
        eval_size > 0, f"--eval-size must be a positive number of images per task (e.g. 500), got {eval_size}"
    )
    need(
        reference_per_class > 0,
        f"--reference-per-class must be positive (e.g. 20), got {reference_per_class}",
    )
    need(
        0 < shard_size <= MAX_SHARD_SIZE,
        f"--shard-size must be in 1..{MAX_SHARD_SIZE} (keys hold 4 index digits), e.g. 256; got {shard_size}",
    )


def _prepare_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise SynthError(f"--out {out} is a file; give a folder path")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise SynthError(
                f"--out {out} exists and is not empty; pass --overwrite to replace it or choose another --out"
            )
        if not (out / "world.json").is_file():
            # --overwrite deletes the folder: only ever do that to a world this command made.
            raise SynthError(
                f"--out {out} is not empty and holds no world.json, so it is not a synthetic world; "
                "--overwrite only replaces a previous world. Pick another --out or empty it yourself."
            )


def _truth_row(s: Sample, key: str, shard: int, width: int, height: int) -> dict:
    sc = s.scene
    return {
        "uid": s.uid,
        "key": key,
        "shard": shard,
        "noise": s.noise,
        "text_level": s.text_level,
        "image_level": s.image_level,
        "shape": sc.shape,
        "color": sc.color,
        "count": sc.count,
        "size": sc.size,
        "position": sc.position,
        "background": sc.background,
        "caption": s.caption,
        "source_uid": s.source_uid,
        "true_caption": s.true_caption,
        "image_kind": "crop" if sc.crop is not None else sc.kind,
        "width": width,
        "height": height,
    }


def _table(rows: list[dict], schema: pa.Schema) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=schema)


# ---- jobs: one output tar each, pure functions of their arguments (so any worker count gives the same
# bytes); top-level so that they pickle into worker processes.


def _shard_job(
    folder: Path, shard: int, samples: list[Sample], base_url: str | None, images: Path | None
) -> tuple[list[dict], list[dict]]:
    """Render and write one img2dataset shard (+ raw image files); returns (truth rows, metadata rows)."""
    batch, truth, meta = [], [], []
    # Raw image files are written by threads while the next samples render: creating many small files
    # is latency-bound on virtual and network file systems.
    with FileWriter() as writer:
        for j, s in enumerate(samples):
            key = f"{shard:05d}{j:04d}"
            jpeg, w, h = render_sample(s)
            url = f"{base_url}/images/{s.uid}.jpg" if base_url is not None else f"synth://clean/{s.uid}.jpg"
            ground = grounding(s.scene, s.caption, s.width, s.height, s.dup_seed)
            item = ShardSample(key, s.uid, url, s.caption, jpeg, w, h, ground)
            batch.append(item)
            truth.append(_truth_row(s, key, shard, w, h))
            meta.append(
                {
                    "uid": s.uid,
                    "url": url,
                    "text": s.caption,
                    "original_width": w,
                    "original_height": h,
                    "sha256": item.sha256,
                }
            )
            if images is not None:
                writer.write(images / f"{s.uid}.jpg", jpeg)
        write_img2dataset_shard(folder, shard, batch)
    return truth, meta


def _wds_job(path: Path, items: list[EvalItem], image_ext: str) -> None:
    write_tar(path, render_items(items, image_ext))


def _default_workers() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


class _Jobs(Stage):
    """The render jobs as a stage: a task is `(fn, args)`, its result `fn(*args)`."""

    name = "synth"

    def label(self, task: tuple[Callable, tuple]) -> str:
        return task[0].__name__

    def run(self, task: tuple[Callable, tuple]) -> object:
        fn, args = task
        return fn(*args)


def _run_jobs(jobs: list[tuple[Callable, tuple]], workers: int, progress: bool) -> list:
    """Run `(fn, args)` jobs, in `workers` processes when > 1; results come back in job order. The
    first failure stops the run and is raised (the world is built in a temporary folder: all or nothing)."""
    # fork starts workers in milliseconds; the pool forks them all at the first job, before any thread of
    # this process exists (the progress bar starts at the first result), so none is copied mid-lock.
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    executor = PoolExecutor(workers, retries=0, fail_fast=True, start_method=method)
    bar = Progress("synth", enabled=progress, leave=False, lazy=True)
    result = executor.map(_Jobs(), jobs, progress=bar)
    result.raise_first_failure()
    return result.results


def _wds_jobs(
    folder: Path, items: list[EvalItem], per_tar: int, image_ext: str
) -> list[tuple[Callable, tuple]]:
    folder.mkdir(parents=True, exist_ok=True)
    n = math.ceil(len(items) / per_tar)
    write_text(folder / "nshards.txt", f"{n}\n")
    return [
        (_wds_job, (folder / f"{i}.tar", items[i * per_tar : (i + 1) * per_tar], image_ext)) for i in range(n)
    ]


def _shard_jobs(
    folder: Path, samples: list[Sample], shard_size: int, base_url: str | None, images: Path | None
) -> list[tuple[Callable, tuple]]:
    folder.mkdir(parents=True, exist_ok=True)
    if images is not None:
        images.mkdir(parents=True, exist_ok=True)
    return [
        (_shard_job, (folder, i, samples[i * shard_size : (i + 1) * shard_size], base_url, images))
        for i in range(math.ceil(len(samples) / shard_size))
    ]


@dataclass(frozen=True)
class _Args:
    """`make_world`'s arguments, checked and resolved."""

    out: Path
    size: int
    seed: int
    clean_size: int
    eval_size: int
    reference_per_class: int
    shard_size: int
    fractions: dict[str, float]
    base_url: str
    workers: int


@dataclass(frozen=True)
class _Plan:
    """Every sample and eval item of the world, drawn before anything is rendered."""

    pool: list[Sample]
    clean: list[Sample]
    eval_items: dict[str, list[EvalItem]]
    reference: list[EvalItem]


def make_world(
    out: str | PathLike,
    size: int,
    seed: int = 0,
    *,
    clean_size: int | None = None,
    eval_size: int = 500,
    reference_per_class: int = 20,
    shard_size: int = 256,
    noise: str | Mapping[str, float] | None = None,
    base_url: str = DEFAULT_BASE_URL,
    overwrite: bool = False,
    progress: bool = False,
    workers: int | None = None,
    proxy_size: int = 0,
) -> dict:
    """Generate the synthetic world under `out`; returns a summary (what `world.json` holds, plus the
    output path and the elapsed time). Raises `SynthError` on bad arguments or an unusable `out`.

    `workers` processes render shards (default: the CPU count, at most 8); the output does not depend on it.
    `proxy_size` > 0 also makes the proxy task set `out/proxy/` (`_make_proxy`), beside an unchanged world.
    """
    t0 = time.perf_counter()
    clean_size = size if clean_size is None else clean_size
    _check_args(size, seed, clean_size, eval_size, reference_per_class, shard_size)
    if proxy_size < 0:
        raise SynthError(
            f"--proxy-size must be 0 (no proxy set) or images per task (e.g. 200), got {proxy_size}"
        )
    try:
        fractions = parse_noise(noise)
    except NoiseSpecError as e:
        raise SynthError(f"--noise: {e}") from None
    if not base_url.startswith(("http://", "https://")):
        raise SynthError(f"--base-url must start with http:// or https://, got {base_url!r}")
    args = _Args(
        out=Path(os.path.abspath(out)),  # "." and "dir/" have no usable name for the sibling temp folder
        size=size,
        seed=seed,
        clean_size=clean_size,
        eval_size=eval_size,
        reference_per_class=reference_per_class,
        shard_size=shard_size,
        fractions=fractions,
        base_url=base_url.rstrip("/"),
        workers=_default_workers() if workers is None else int(workers),
    )
    fp = _fingerprint(args)
    if not overwrite and (world := is_done(args.out / "world.json", fp)) is not None:
        summary = {**world, "skipped": True}  # built before with these settings: nothing to do
    else:
        summary = _make(args, overwrite, progress, fp)
    if proxy_size:
        summary["proxy"] = _make_proxy(args, proxy_size, fp, progress)
    elapsed = round(time.perf_counter() - t0, 3)
    return {**summary, "out": str(args.out), "workers": args.workers, "elapsed_s": elapsed}


def _make(args: _Args, overwrite: bool, progress: bool, fp: str) -> dict:
    """Build the world in a hidden sibling folder and rename it into place; what world.json holds."""
    _prepare_out(args.out, overwrite)
    plan = _plan(args)
    tmp = args.out.parent / f".{args.out.name}.synth-tmp"
    check_own_folder(tmp)  # a link planted there is never filled or deleted through
    if tmp.exists():
        shutil.rmtree(tmp)  # our own leftover from an interrupted run
    tmp.mkdir(parents=True)
    try:
        world = _build(tmp, args, plan, progress, fp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_tree(tmp, args.out)  # `out` only ever holds a complete world
    return world


def _make_proxy(a: _Args, size: int, world_fp: str, progress: bool) -> dict:
    """The proxy task set `out/proxy/`: the eval task families drawn again from other streams
    (`proxy:<task>`, keys `p...` where eval's are `s...`), to choose selection weights on (`hype fit
    --proxy`) without looking at eval/. Built in a hidden folder, checked to share no image bytes and no
    key with eval/, then renamed into place; proxy/proxy.json is its marker. The world's files stay as
    they are (world.json does not mention it)."""
    out = a.out / PROXY_FOLDER
    fp = fingerprint({"world": world_fp, "proxy_size": size})
    if (done := is_done(out / PROXY_MARKER, fp)) is not None:
        return {**done, "skipped": True}
    if os.path.lexists(out) and not (out / PROXY_MARKER).is_file():
        raise SynthError(
            f"{out} exists and holds no {PROXY_MARKER}, so hype did not make it; move it away and run again"
        )
    items = {
        name: [dataclasses.replace(it, key=PROXY_KEY + it.key[1:]) for it in task]
        for name, task in _task_items(a.seed, size, "proxy").items()
    }
    tmp = a.out / f".{PROXY_FOLDER}.synth-tmp"
    check_own_folder(tmp)
    if tmp.exists():
        shutil.rmtree(tmp)  # our own leftover from an interrupted run
    tmp.mkdir()
    try:
        _run_jobs(_task_jobs(tmp, items, a.shard_size), a.workers, progress)
        disjoint = _check_disjoint(a.out / "eval", tmp)
        record = write_marker(
            tmp / PROXY_MARKER, fp, seed=a.seed, per_task=size, streams="proxy:<task>",
            tasks=list(TASK_NAMES), disjoint_from_eval=disjoint,
        )  # fmt: skip
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_tree(tmp, out)
    return record


class _Unreadable:
    """`hype.io.tar.Problems` for the world's own tars: any problem is an error."""

    def add(self, reason: str, message: str) -> None:
        raise SynthError(f"{message}; rebuild the world with --overwrite")


def _images_and_keys(root: Path) -> tuple[set[str], set[str]]:
    """The sha256 of every image and every sample key in the tars under `root`."""
    images, keys = set(), set()
    for path in sorted(root.rglob("*.tar")):
        for key, files in read_samples(path, _Unreadable()):
            keys.add(key)
            images |= {sha256_bytes(v) for ext, v in files.items() if ext in (EVAL_IMAGE_EXT, "jpg")}
    return images, keys


def _check_disjoint(eval_dir: Path, proxy: Path) -> dict:
    """Counts of the eval and proxy images; a `SynthError` when the two share an image or a key."""
    (eval_images, eval_keys), (images, keys) = _images_and_keys(eval_dir), _images_and_keys(proxy)
    common_images, common_keys = len(eval_images & images), len(eval_keys & keys)
    if common_images or common_keys:
        raise SynthError(
            f"the proxy set would share {common_images} image(s) and {common_keys} key(s) with {eval_dir}; "
            "it was not written (its streams must never repeat eval's: please report this)"
        )
    return {
        "eval_images": len(eval_images),
        "proxy_images": len(images),
        "common_images": 0,
        "common_keys": 0,
    }


def _plan(a: _Args) -> _Plan:
    """Plan everything (cheap, sequential, one RNG stream per part); rendering comes after, in parallel."""
    seed = a.seed
    return _Plan(
        pool=plan_pool(a.size, seed, stream(seed, "pool"), a.fractions),
        clean=plan_clean(a.clean_size, seed, stream(seed, "clean")),
        eval_items=_task_items(seed, a.eval_size, "eval"),
        reference=plan_reference(a.reference_per_class, stream(seed, "reference")),
    )


def replay_plan(world: str | PathLike) -> _Plan:
    """The plan of an existing world (its scenes, jitter seeds and eval items), drawn again from the
    arguments its `world.json` records: the benches' truth beyond `truth.parquet`'s columns."""
    import json

    info = json.loads((Path(world) / "world.json").read_text())
    a = info["args"]
    sizes = (a["size"], info["seed"], a["clean_size"], a["eval_size"], a["reference_per_class"])
    return _plan(_Args(Path(world), *sizes, a["shard_size"], a["noise"], a["base_url"], 1))


def _task_items(seed: int, size: int, part: str) -> dict[str, list[EvalItem]]:
    """`size` items of every synthetic task, each task drawn from its own stream `<part>:<task>`."""
    items = {t.name: plan_classification(t, size, stream(seed, f"{part}:{t.name}")) for t in TASKS}
    items[RETRIEVAL_TASK] = plan_retrieval(size, stream(seed, f"{part}:{RETRIEVAL_TASK}"))
    return items


def _build(tmp: Path, a: _Args, plan: _Plan, progress: bool, fp: str) -> dict:
    """Render and write the whole world into `tmp`, `world.json` (its marker, fingerprint `fp`) last;
    returns what it holds."""
    pool = tmp / "pool"
    pool_jobs = _shard_jobs(pool / "shards", plan.pool, a.shard_size, a.base_url, pool / "images")
    clean_jobs = _shard_jobs(tmp / "clean" / "shards", plan.clean, a.shard_size, None, None)
    eval_jobs = _eval_jobs(tmp / "eval", plan, a.shard_size)

    results = _run_jobs(pool_jobs + clean_jobs + eval_jobs, a.workers, progress)

    pool_results = results[: len(pool_jobs)]
    clean_results = results[len(pool_jobs) : len(pool_jobs) + len(clean_jobs)]
    metadata_files = _write_metadata(pool / "metadata", a, [row for r in pool_results for row in r[1]])
    write_parquet(tmp / "truth.parquet", _table([row for r in pool_results for row in r[0]], TRUTH_SCHEMA))
    clean_truth = [row for r in clean_results for row in r[0]]
    write_parquet(tmp / "clean" / "truth.parquet", _table(clean_truth, TRUTH_SCHEMA))
    # The oracle subset (every clean pool sample) is the upper bound any filter is compared against.
    (tmp / "subsets").mkdir()
    save_subset(tmp / "subsets" / "oracle_clean.npy", [s.uid for s in plan.pool if s.noise == "clean"])
    world = _world_json(a, plan, metadata_files, len(pool_jobs), len(clean_jobs))
    return write_marker(tmp / "world.json", fp, **world)


def _task_jobs(
    root: Path, items: Mapping[str, list[EvalItem]], shard_size: int
) -> list[tuple[Callable, tuple]]:
    """Lay out the synthetic tasks (CLIP_benchmark's folders) under `root`; their render jobs."""
    jobs = []
    for task in TASKS:
        folder = root / task.folder
        folder.mkdir(parents=True)
        write_text(folder / "classnames.txt", "".join(f"{c}\n" for c in task.classnames))
        write_text(
            folder / "zeroshot_classification_templates.txt", "".join(f"{t}\n" for t in task.templates)
        )
        jobs += _wds_jobs(folder / "test", items[task.name], shard_size, EVAL_IMAGE_EXT)
    retrieval = root / task_folder(RETRIEVAL_TASK)
    retrieval.mkdir(parents=True)
    # CLIP_benchmark treats a webdataset folder without this file as classification.
    write_text(retrieval / "dataset_type.txt", "retrieval\n")
    return jobs + _wds_jobs(retrieval / "test", items[RETRIEVAL_TASK], shard_size, EVAL_IMAGE_EXT)


def _eval_jobs(eval_dir: Path, plan: _Plan, shard_size: int) -> list[tuple[Callable, tuple]]:
    """Lay out the eval tasks and the reference set; their render jobs."""
    jobs = _task_jobs(eval_dir, plan.eval_items, shard_size)
    ref = eval_dir / "reference"
    ref.mkdir()
    write_text(ref / "classnames.txt", "".join(f"{c}\n" for c in OBJECT_CLASSES))
    jobs += _wds_jobs(ref / "train", plan.reference, shard_size, "jpg")
    return jobs


def _write_metadata(folder: Path, a: _Args, meta: list[dict]) -> list[str]:
    """The pool's DataComp-style metadata parquet files; returns their paths relative to the world."""
    folder.mkdir()
    files = []
    for start in range(0, len(meta), METADATA_ROWS_PER_FILE):
        rows = meta[start : start + METADATA_ROWS_PER_FILE]
        name = blake2b128_bytes(f"hype-synth:{a.seed}:metadata:{start}:{a.size}".encode())
        write_parquet(folder / f"{name}.parquet", _table(rows, METADATA_SCHEMA))
        files.append(f"pool/metadata/{name}.parquet")
    return files


def _fingerprint(a: _Args) -> str:
    """What the world's bytes depend on: the settings and the generator (not `out`, not the workers)."""
    settings = {k: v for k, v in vars(a).items() if k not in ("out", "workers")}
    return fingerprint({"format_version": FORMAT_VERSION, "generator": __version__, **settings})


def _world_json(
    a: _Args, plan: _Plan, metadata_files: list[str], pool_shards: int, clean_shards: int
) -> dict:
    noise_counts = _count(s.noise for s in plan.pool)
    return {
        "format_version": FORMAT_VERSION,
        "generator": f"hype.synth {__version__}",
        "seed": a.seed,
        "args": {
            "size": a.size,
            "clean_size": a.clean_size,
            "eval_size": a.eval_size,
            "reference_per_class": a.reference_per_class,
            "shard_size": a.shard_size,
            "noise": {k: round(v, 6) for k, v in a.fractions.items()},
            "base_url": a.base_url,
        },
        "counts": {
            "pool": a.size,
            "clean": a.clean_size,
            "eval_per_task": a.eval_size,
            "reference": len(plan.reference),
            "pool_shards": pool_shards,
            "clean_shards": clean_shards,
        },
        "noise_counts": {k: noise_counts.get(k, 0) for k in NOISE_KINDS},
        "image_kinds": _count(s.scene.kind for s in plan.pool),
        "eval_tasks": list(TASK_NAMES),
        "eval_image_ext": EVAL_IMAGE_EXT,
        "layout": {
            "pool_shards": "pool/shards/{shard:08d}.tar (+ .parquet, _stats.json)",
            "pool_images": "pool/images/{uid}.jpg (serve pool/ as the web root)",
            "pool_metadata": metadata_files,
            "clean_shards": "clean/shards/{shard:08d}.tar (+ .parquet, _stats.json)",
            "truth": "truth.parquet",
            "clean_truth": "clean/truth.parquet",
            "oracle_subset": "subsets/oracle_clean.npy",
            "eval": [f"eval/{task_folder(t)}" for t in TASK_NAMES],
            "reference": "eval/reference/train/{i}.tar (+ eval/reference/classnames.txt)",
        },
    }


def _count(items) -> dict[str, int]:
    counts: dict[str, int] = {}
    for x in items:
        counts[x] = counts.get(x, 0) + 1
    return dict(sorted(counts.items()))
