"""`normsim`: NormSim (Wang et al., NeurIPS 2024, "CLIPLoss and Norm-Based Data Selection Methods for
Multimodal Contrastive Learning"): how close an image is to a target set, the p-norm of its similarities to
the target's image embeddings,

    normsim_p(i) = || (x_i·t)_{t∈T} ||_p   (p = 2: (Σ_t (x_i·t)²)^½;  p = inf: max_t |x_i·t|)

x_i: the pool's unit CLIP image embeddings (`RUN_DIR/embed/` clip_img); T: `target=`, a folder (or file) of
precomputed features of the run's CLIP, `.npy` (rows x d float) or `.parquet` (a `clip_img` column, e.g.
another run's embed/ tables), and/or of images: image files (jpg, jpeg, png, webp) and webdataset `.tar`
shards, embedded with the CLIP the run recorded (its config.yaml, checked against its card) by `hype
score`'s own evaluation-image embed stage (the class-image stage, `.cls` optional: same decoding,
preprocessing and precision settings), one tar (or `IMAGES_PER_TAR` loose images, packed into a temporary
tar) at a time, and kept in the run's `select_cache/` keyed by the images' bytes, the CLIP and its
settings, so the next selection with the same images does not embed them again. Everything is streamed a
block at a time. Never the evaluation images: a target inside the
run's `decontam.eval_dir` (or holding it) is refused. Exact as `hype.filters.embeddings` says; blocks have a
fixed size (per file), so the sum's order is the same on any machine.
"""

from __future__ import annotations

import io
import itertools
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from hype.config import ConfigError, parse_yaml
from hype.data.samples import IMAGE_EXTS
from hype.filters.embeddings import (
    PoolEmbeddings,
    PoolRule,
    float32_dot_error,
    grid_values32,
    max_norm,
)
from hype.io import (
    NPY_ERRORS,
    StorageError,
    blake2b128_file,
    overlap,
    read_bytes,
    read_json,
    read_parquet,
    storage,
    write_bytes,
    write_json,
)
from hype.io.runs import fingerprint, input_identity
from hype.scoring.embed_format import fixed_list_to_numpy, read_embeddings
from hype.select.errors import SelectError
from hype.select.rules import RULES

BLOCK = 4096  # target rows per block: fixed, so the float64 sums run in one order everywhere
CHUNK_BYTES = 32 << 20  # one block of similarities (pool rows x BLOCK), float64
PAIRS = 8192  # (row, target) pairs recomputed exactly at a time by p=inf: bounds memory when many tie
IMAGES_PER_TAR = 1024  # loose target images embedded at a time: bounds the temporary tar and its features
FEATURES = (".npy", ".parquet")
IMAGES = tuple(f".{e}" for e in IMAGE_EXTS)


@RULES.register
class NormSim(PoolRule):
    name: ClassVar[str] = "normsim"
    summary: ClassVar[str] = "NormSim: p-norm of an image's CLIP similarities to a target set's images"
    PARAMS: ClassVar = {
        "target": (
            str,
            "",
            "folder or file of target images (jpg/png/webp, webdataset .tar) or of their CLIP image features "
            "(.npy rows x d, .parquet clip_img)",
        ),
        "p": (str, "inf", "2 | inf: the norm over the target set"),
        "max_gb": (float, 16.0, "refuse a pool whose image embeddings (as read and on the grid) exceed this"),
    }

    def __init__(self, **params: Any):
        super().__init__(**params)
        if self.params["p"] not in ("2", "inf"):
            raise SelectError(f"rule 'normsim': p={self.params['p']!r}; use p=2 or p=inf")
        if not self.params["target"]:
            raise SelectError(
                "rule 'normsim' needs a target: normsim:target=FOLDER of images, .tar shards or "
                ".npy/.parquet features"
            )

    def inputs(self) -> list[dict]:
        """The target's files (path, size, mtime or ETag), as one fingerprint: other images or features
        under the same path are another selection."""
        files = sorted(f for group in target_files(self.params["target"]) for f in group)
        return [
            {"normsim_target": self.params["target"], "files": fingerprint(list(map(input_identity, files)))}
        ]

    def attach(self, table) -> None:
        for folder in table.folders:  # before anything is read
            refuse_evaluation_images(self.params["target"], folder.parent)
        super().attach(table)

    def pool_values(self, table, pool: PoolEmbeddings) -> np.ndarray:
        x = pool.arrays["clip_img"]
        found: dict = {}  # images embedded now and those the embed stage could not use, for an image target
        blocks = target_blocks(self.params["target"], x.shape[1], [f.parent for f in table.folders], found)
        values, rows = norm_sim(x, blocks, self.params["p"])
        self.found = {"target_rows": rows, **found}
        return values


def norm_sim(x: np.ndarray, blocks: Iterator[np.ndarray], p: str) -> tuple[np.ndarray, int]:
    """(NormSim_p of each row of unit `x` against the target rows of `blocks`, the target's row count).
    Every similarity is the exact grid dot product (`hype.filters.embeddings`): p=2 sums their squares,
    each block's products in float64; p=inf, the maximum, screens each block in float32 (half the time of
    float64, the pool's grid values held in float32) and recomputes exactly only the pairs that could be a
    row's maximum (`_max_abs`), so its bytes are those of the maximum over all exact products."""
    xg, acc, rows = grid_values32(x), np.zeros(len(x)), 0
    x_norm = max_norm(xg)
    step = max(1, CHUNK_BYTES // (8 * BLOCK))  # pool rows per similarity block
    for block in blocks:
        tg = grid_values32(block)
        tg64 = tg.astype(np.float64)
        err = float32_dot_error(x.shape[1], x_norm, max_norm(tg))
        for s in range(0, len(x), step):
            if p == "2":  # products of values on the 2^-b grid: exact in float64, whatever BLAS does
                sims = xg[s : s + step].astype(np.float64) @ tg64.T
                acc[s : s + step] += np.add.reduce(sims * sims, axis=1)
            else:
                _max_abs(xg[s : s + step], tg, tg64, acc[s : s + step], err)
        rows += len(block)
    if rows == 0:
        raise SelectError("rule 'normsim': the target has no rows")
    return (np.sqrt(acc) if p == "2" else acc), rows


def _max_abs(xg: np.ndarray, tg: np.ndarray, tg64: np.ndarray, acc: np.ndarray, err: float) -> None:
    """acc = max(acc, max_t |x·t|) in place over the rows of `xg` and targets `tg` (float32 grid values;
    `tg64` the same in float64), exactly: a float32 product is within `err` of the exact one, so a row's
    exact maximum is among its targets within 2·err of its float32 maximum, and only those within `err`
    of `acc` can raise it; those pairs alone are recomputed in float64 (exact), PAIRS at a time."""
    approx = np.abs(xg @ tg.T)
    bar = np.maximum(approx.max(axis=1) - 2 * err, acc - err)
    rows, cols = np.nonzero(approx >= bar[:, None])
    for s in range(0, len(rows), PAIRS):
        r, c = rows[s : s + PAIRS], cols[s : s + PAIRS]
        np.maximum.at(acc, r, np.abs(np.add.reduce(xg[r].astype(np.float64) * tg64[c], axis=1)))


def target_blocks(target: str, dim: int, runs: list, found: dict) -> Iterator[np.ndarray]:
    """The target's unit feature rows, BLOCK at a time: feature files in name order (a local .npy
    memory-mapped: one block in memory), then its images embedded with the CLIP of `runs` (one tar's
    features in memory; `found` gets the counts of images embedded now and of those that could not be);
    each file checked, every problem one line."""
    feats, tars, images = target_files(target)
    for f in feats:
        yield from _unit_blocks(_read_features(f), f, dim)
    if tars or images:
        yield from _image_blocks(tars, images, dim, runs, found)


def target_files(target: str) -> tuple[list, list, list]:
    """(feature files, tars, images) of `target` (a file or a folder's files), each in name order."""
    files = [target] if storage.is_file(target) else sorted(storage.glob(f"{target.rstrip('/')}/*"))
    feats = [f for f in files if f.endswith(FEATURES)]
    tars = [f for f in files if f.endswith(".tar")]
    images = [f for f in files if f.lower().endswith(IMAGES)]
    if not (feats or tars or images):
        raise SelectError(
            f"rule 'normsim': no images (jpg, png, webp), .tar shards or .npy/.parquet features in {target}; "
            "pass their folder"
        )
    return feats, tars, images


def _unit_blocks(feats: np.ndarray, where: str, dim: int) -> Iterator[np.ndarray]:
    """Rows of `feats` (from `where`) in float64 blocks of BLOCK, checked and made unit length."""
    if feats.ndim != 2 or feats.shape[1] != dim or feats.dtype.kind != "f":
        raise SelectError(
            f"rule 'normsim': {where} holds {feats.dtype} features of shape {feats.shape}, not rows of the "
            f"run's CLIP width {dim}; embed the target with the CLIP that scored the run"
        )
    for s in range(0, len(feats), BLOCK):
        block = np.asarray(feats[s : s + BLOCK], np.float64)
        if not np.isfinite(block).all():
            raise SelectError(f"rule 'normsim': {where} has NaN or inf in rows {s}..{s + len(block) - 1}")
        yield block / np.maximum(np.linalg.norm(block, axis=1, keepdims=True), 1e-12)  # unit, as the pool


def _image_blocks(tars: list, images: list, dim: int, runs: list, found: dict) -> Iterator[np.ndarray]:
    """Blocks of the CLIP image features of the target's tars, then of its loose images (packed
    IMAGES_PER_TAR at a time into a temporary tar), one embed output at a time; read back from the run's
    cache (`_cache_folder`) when the same files were embedded with the same CLIP and settings before, else
    written there as they are made."""
    from hype.scoring.rundir import RunDir, make_tasks
    from hype.scoring.stage_decontam import EvalEmbedStage

    with tempfile.TemporaryDirectory(prefix="hype-normsim-") as tmp:
        run = RunDir(f"{tmp}/run", stages=(EvalEmbedStage.name,))
        run.create()
        stage, embedder = _target_stage(runs, run)
        cache = _cache_folder(runs, tars, images, embedder)
        done = None if cache is None else _cache_step(read_json, cache / "done.json")[1]
        done = done if done is not None and {"parts", "target_images_skipped"} <= set(done) else None
        found["target_images_embedded"] = 0
        if done is not None:  # the same images, CLIP and settings: their features as they were written
            found["target_images_skipped"] = int(done["target_images_skipped"])
            for i in range(int(done["parts"])):
                yield from _unit_blocks(_read_features(str(cache / f"{i:06d}.npy")), str(cache), dim)
            return
        found["target_images_skipped"] = 0
        try:
            _embedding(stage.setup)
            for i, path in enumerate(itertools.chain(tars, _packed(images, tmp))):  # one tar at a time
                (task,) = make_tasks([path])
                stats = _embedding(lambda task=task: stage.run(task))
                found["target_images_skipped"] += int(stats["counts"]["skipped"])
                out = run.shard_output(stage.name, task)
                feats = read_embeddings(out, "clip_img")
                found["target_images_embedded"] += len(feats)
                out.unlink()
                if (
                    cache is not None
                    and not _cache_step(write_bytes, cache / f"{i:06d}.npy", _npy_bytes(feats))[0]
                ):
                    cache = None  # the run folder cannot hold it: embedded again next time
                yield from _unit_blocks(feats, path, dim)
        finally:
            stage.teardown()
        if cache is not None:  # last: the folder's completion marker
            marker = {"parts": i + 1, "target_images_skipped": found["target_images_skipped"]}
            _cache_step(write_json, cache / "done.json", marker)


def _cache_step(step, *args) -> tuple[bool, object]:
    """`step(*args)`, a read or write of the target's cache: (True, its value), or (False, None) when the
    run folder cannot hold the cache (read-only, or `select_cache` not a folder): a cache only saves work,
    so the selection goes on."""
    try:
        return True, step(*args)
    except (OSError, StorageError):
        return False, None


def _cache_folder(runs: list, tars: list, images: list, embedder: dict):
    """RUN_DIR/select_cache/normsim-<key>/ (beside the select cache of the scores): the target's features,
    one .npy per embedded tar, and done.json; the key digests every target file's bytes (blake2b-128),
    in order, with the CLIP's digest and the embed settings. None (no cache) for several runs, whose
    selection no one folder owns."""
    if len(runs) != 1:
        return None
    files = [
        [f.rsplit(".", 1)[-1].lower(), _embedding(lambda f=f: blake2b128_file(f))] for f in tars + images
    ]
    key = fingerprint({"embedder": embedder, "tars": len(tars), "files": files})
    return runs[0] / "select_cache" / f"normsim-{key[:20]}"


def _npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def _embedding(step):
    """`step()` of the target's embed stage; an unreadable tar or model is one line."""
    try:
        return step()
    except (OSError, ValueError) as e:  # ShardReadError, ModelError, a checkpoint's errors
        raise SelectError(f"rule 'normsim': cannot embed the target's images ({e})") from None


def _packed(images: list, tmp: str) -> Iterator[str]:
    """Temporary tars of IMAGES_PER_TAR loose images each, one on disk at a time; members are numbered
    (`<n>.<ext>`), so images that share a stem stay separate samples."""
    for s in range(0, len(images), IMAGES_PER_TAR):
        path = f"{tmp}/images-{s // IMAGES_PER_TAR:06d}.tar"
        with tarfile.open(path, "w") as tar:
            for i, f in enumerate(images[s : s + IMAGES_PER_TAR], start=s):
                data = _embedding(lambda f=f: read_bytes(f))
                info = tarfile.TarInfo(f"{i:09d}.{f.rsplit('.', 1)[-1].lower()}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        yield path
        Path(path).unlink()


def _target_stage(runs: list, run):
    """(The evaluation-image embed stage of `hype score` (the class-image stage, `.cls` optional) with the
    CLIP and embed settings the scored runs recorded, what identifies its features: the CLIP's digest and
    those settings); a model that is not the one their card records, or runs scored with different CLIPs,
    are refused."""
    from hype.scoring.config import ScoreConfig
    from hype.scoring.embed import model_ref
    from hype.scoring.errors import ScoreError
    from hype.scoring.stage_decontam import EvalEmbedStage
    from hype.scoring.stage_embed import EmbedSettings

    configs = [(r, _run_config(r)) for r in runs]
    clips = {(c or {}).get("clip") for _, c in configs}
    if len(clips) != 1 or None in clips:
        raise SelectError(
            f"rule 'normsim': a target of images is embedded with the CLIP the run recorded, but the runs' "
            f"config.yaml files name {sorted(map(str, clips))}; pass the target's features (.npy) instead"
        )
    run_dir, config = configs[0]
    try:
        cfg = ScoreConfig.from_dict(config, f"{run_dir}/config.yaml")
        clip = model_ref(cfg.clip, "clip")
    except (ScoreError, ConfigError) as e:
        raise SelectError(f"rule 'normsim': the run's CLIP cannot embed the target ({e})") from None
    card = (read_json(f"{run_dir}/card.json") or {}).get("models") or {}
    if card.get("clip") not in (None, clip.digest):
        raise SelectError(
            f"rule 'normsim': {cfg.clip} is no longer the CLIP that scored {run_dir} (its card.json records "
            f"digest {card['clip']}); restore that model, or pass the target's features (.npy) made with it"
        )
    kw = EmbedSettings.of(cfg).kwargs()
    stage = EvalEmbedStage(run, clip=clip, **kw, device=cfg.device, threads=cfg.threads)
    return stage, {"clip": clip.digest, **kw}


def _read_features(path: str) -> np.ndarray:
    try:
        if path.endswith(".parquet"):
            return fixed_list_to_numpy(read_parquet(path, columns=["clip_img"]).column("clip_img"))
        if not storage.is_url(path):
            return np.load(path, mmap_mode="r", allow_pickle=False)  # data, never code
        return np.load(io.BytesIO(read_bytes(path)), allow_pickle=False)
    except (*NPY_ERRORS, OSError, StorageError, KeyError) as e:
        raise SelectError(
            f"rule 'normsim': {path} is not a .npy array or a Parquet file with a clip_img column ({e})"
        ) from None
    except Exception as e:  # pyarrow's errors (a damaged or foreign Parquet file)
        raise SelectError(
            f"rule 'normsim': {path} is not a readable Parquet file ({type(e).__name__})"
        ) from None


def _run_config(run_dir) -> dict | None:
    """The config a run recorded (config.yaml), or None when it has none that reads."""
    try:
        config = parse_yaml(read_bytes(f"{run_dir}/config.yaml"), f"{run_dir}/config.yaml")
    except (OSError, StorageError, ConfigError):
        return None
    return config if isinstance(config, dict) else None


def refuse_evaluation_images(target: str, run_dir: Path) -> None:
    """A target that is, holds or lies inside the run's evaluation images (decontam.eval_dir) is refused:
    selecting toward the evaluation set would leak it into training."""
    config = _run_config(run_dir) or {}  # no recorded config: nothing to compare with
    eval_dir = (config.get("decontam") or {}).get("eval_dir")
    if not eval_dir:
        return
    if overlap(str(target), str(eval_dir)):
        raise SelectError(
            f"rule 'normsim': target {target} overlaps the run's evaluation images ({eval_dir}); "
            "use a target set disjoint from the evaluation tasks (e.g. ImageNet-1k train features)"
        )
