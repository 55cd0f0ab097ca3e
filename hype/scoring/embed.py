"""Embed stage: one input tar -> `RUN_DIR/embed/<shard id>.parquet` (format: `hype.scoring.embed_format`).

Inside one worker (DESIGN §4.4: decode and embed in the same worker): the tar is streamed member by member
(`hype.data.samples.iter_tar_samples`, robust to truncated tars), decode workers (`hype.scoring.decode`:
processes by default) parse, decode, resize and crop samples ahead of the model (a bounded window of
`prefetch_batches` batches), and the worker's main thread tokenizes and normalizes each batch and runs
MERU (image, text) and CLIP (image, text) on it. Only the shard's small stats dict leaves the worker; the
Parquet is written here, atomically, marker last.

Bad data is skipped and counted per shard with the reason and example messages (DESIGN §4.5): missing
image / caption / json, invalid json, missing or malformed uid, undecodable or oversized image,
non-finite embeddings, uids absent from the metadata, and unreadable (e.g. truncated) tars, whose
samples before the damage are kept. Empty captions are scored (they are what ε_t is for) and counted.
Batches are consecutive runs of `batch_size` samples in tar order, so a shard's output does not depend on
the worker, the retry or the executor.

`ClassEmbedStage` embeds labelled reference images (`<key>.jpg` + `<key>.cls`, e.g. the synthetic
world's `eval/reference`) with the CLIP model for c_IN, with the same machinery.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from hype.data.imageprep import Preprocess
from hype.data.samples import MISSING_SHARD, UNREADABLE_SHARD, SkipStats
from hype.executor import usable_cpus
from hype.geometry import get_geometry
from hype.io import cached_copy, storage
from hype.scoring import embed_format
from hype.scoring.decode import Decoded, DecodePool, DecodeSpec, Skipped
from hype.scoring.errors import ScoreError
from hype.scoring.rundir import (
    RunDir,
    ShardTask,
    file_identity,
    fingerprint,
)
from hype.scoring.stagebase import ShardStage, resolve_device

NONFINITE = "nonfinite_embedding"
NOT_IN_METADATA = "not_in_metadata"
# The read of the tar ended early. Also what a store that failed in a way not recognised as transient
# looks like, so such an output is never reused: every rerun reads the shard again (`_EmbedBase.done`).
READ_SHORT = (MISSING_SHARD, UNREADABLE_SHARD)
VERSION = 1  # bump when the embed output changes for the same inputs


class ModelError(ValueError):
    """A checkpoint that cannot serve as the MERU or CLIP scorer."""


class ShardReadError(OSError):
    """A shard whose read cannot be trusted (it changed meanwhile, or read as missing while it is there):
    the shard fails this attempt and is read again."""


@dataclass(frozen=True)
class ModelRef:
    """A checkpoint path and its content digest (the digest enters the fingerprints)."""

    path: str
    digest: str


def model_ref(path: str | None, role: str) -> ModelRef | None:
    """The --meru / --clip model at `path` with its digest, checked for its role's geometry."""
    if path is None:
        return None
    from hype.checkpoint import model_file_config, model_file_digest
    from hype.io import blake2b128_file

    try:
        local = cached_copy(path)  # a URL: downloaded once here, once per worker (`load_scorer`)
        geometry = model_file_config(local).get("geometry", "")
        # open_clip sources (folders, OpenAI releases) are digested with the config beside their weights.
        digest = model_file_digest(local, blake2b128_file)
    except (ValueError, OSError) as e:  # CheckpointError, ModelFileError, ConfigError
        raise ScoreError(f"--{role}: {e}") from None
    if role == "meru" and not geometry.startswith("hyperbolic"):
        raise ScoreError(f"--meru {path}: a {geometry!r} model; --meru needs a hyperbolic (MERU) checkpoint")
    if role == "clip" and geometry not in ("clip", "elliptic"):
        raise ScoreError(f"--clip {path}: a {geometry!r} model; --clip needs a CLIP (cosine) checkpoint")
    return ModelRef(path, digest)


def load_scorer(ref: ModelRef, role: str, device: str) -> torch.nn.Module:
    from hype.checkpoint import load_model_file

    model = load_model_file(cached_copy(ref.path), device=device)  # a URL: downloaded once per worker
    geometry = model.geometry.name
    if role == "meru" and not geometry.startswith("hyperbolic"):
        raise ModelError(
            f"{ref.path}: --meru needs a hyperbolic (MERU) model, this one is {geometry!r}; "
            "pass the CLIP checkpoint with --clip"
        )
    if role == "clip" and geometry not in ("clip", "elliptic"):
        raise ModelError(
            f"{ref.path}: --clip needs a CLIP (cosine) model, this one is {geometry!r}; "
            "pass MERU checkpoints with --meru"
        )
    return model


def resolve_precision(device: str, precision: str) -> str:
    """The precision the towers run in: `auto` is bf16 on a GPU, fp32 on a CPU."""
    if precision == "auto":
        return "bf16" if device_kind(device) == "cuda" else "fp32"
    return precision


def device_kind(device: str) -> str:
    """`cpu` or `cuda` (`auto` resolved in this process)."""
    return torch.device(resolve_device(device) if device == "auto" else device).type


def numerics(device: str, precision: str) -> dict:
    """What decides the arithmetic of an embedding, for the fingerprints: the resolved precision and,
    under autocast, the device kind (CPU and CUDA autocast round different ops to bf16/fp16). In fp32 the
    device changes results only at float rounding, like the thread count, so a run moves freely."""
    resolved = resolve_precision(device, precision)
    return {"precision": resolved} | ({"device": device_kind(device)} if resolved != "fp32" else {})


def _autocast(device: str, precision: str):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(resolve_precision(device, precision))
    return torch.autocast(device_type=device_kind(device), dtype=dtype, enabled=dtype is not None)


class _EmbedBase(ShardStage):
    """Shared worker machinery: the decode pool, tokenization and the batch loop."""

    def __init__(
        self,
        run: RunDir,
        *,
        batch_size: int,
        decode_workers: int,
        decode: str,
        prefetch_batches: int,
        jpeg_draft: bool,
        precision: str,
        clip_txt: bool = False,
        **kw,
    ):
        super().__init__(run, **kw)
        self.batch_size = batch_size
        self.decode_workers = decode_workers
        self.decode = decode
        self.prefetch_batches = prefetch_batches
        self.jpeg_draft = jpeg_draft
        self.precision = precision
        self.clip_txt = clip_txt  # the pool's CLIP text embeddings too (EmbedStage; for `--rank negclip`)

    def _start_decoding(self, models: dict, labelled: bool, label_required: bool = True) -> None:
        self._models = models
        self._preps = {role: Preprocess.of(m) for role, m in models.items()}
        spec = DecodeSpec(tuple(self._preps.values()), self.jpeg_draft, labelled, label_required)
        # at most the usable CPUs, whatever a config file or card asks: more only adds processes and memory
        n = min(self.decode_workers or self.threads or usable_cpus(), usable_cpus())
        self._decoder = DecodePool(spec, n, self.decode)

    def teardown(self) -> None:
        if getattr(self, "_decoder", None) is not None:
            self._decoder.close()

    def input_fingerprint(self, task: ShardTask, identity: dict) -> str:
        raise NotImplementedError

    def fingerprint(self, task: ShardTask) -> str:
        return self.input_fingerprint(task, file_identity(task.source))

    def done(self, task: ShardTask, sizes: dict | None = None) -> dict | None:
        stats = super().done(task, sizes)
        if stats is not None and any(
            (stats.get("skipped") or {}).get("counts", {}).get(r) for r in READ_SHORT
        ):
            return None  # its read ended early: checked again (the input may be back, whole)
        return stats

    def _check_read(self, task: ShardTask, before: dict, stats: SkipStats) -> dict:
        """The input's identity after the read, which must be the one the fingerprint holds; and a shard
        read as missing must be missing. Otherwise the rows read are not the shard's: `ShardReadError`."""
        after = file_identity(task.source)
        if after != before:
            raise ShardReadError(f"{task.path}: changed while it was read ({before} -> {after}); read again")
        if stats.counts.get(MISSING_SHARD) and not after.get("missing"):
            raise ShardReadError(
                f"{task.path}: read as missing, but it is there ({after}): the store was not ready "
                "(restarting?); read again"
            )
        return after

    def _samples(self, task: ShardTask, stats: SkipStats, counts: dict) -> Iterator[Decoded]:
        for out in self._decoder.decode(task.source, stats, self.prefetch_batches * self.batch_size):
            counts["samples"] += 1
            if isinstance(out, Skipped):
                stats.add(out.reason, out.message)
            else:
                yield out

    def _batches(self, items: Iterator[Decoded]) -> Iterator[list[Decoded]]:
        batch: list[Decoded] = []
        for item in items:
            batch.append(item)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch:
            yield batch

    def _images(self, batch: list[Decoded], role: str) -> torch.Tensor:
        prep = self._preps[role]
        return prep.batch([it.pixels[prep.geometry] for it in batch], self.device)

    def _tokens(self, batch: list[Decoded], role: str, cache: dict) -> torch.Tensor:
        tok = self._models[role].tokenizer()
        key = _token_key(tok)
        if key not in cache:
            cache[key] = tok([it.text for it in batch]).to(self.device)
        return cache[key]


def _token_key(tok) -> tuple:
    """Tokenizers that give the same ids share one tokenization per batch: open_clip's CLIP BPE (every hype
    model, and open_clip models without a tokenizer of their own) by context length, cleaning and special
    tokens; any other tokenizer (Hugging Face's, random token reduction) is its own."""
    from open_clip.tokenizer import SimpleTokenizer

    if type(tok) is SimpleTokenizer and tok.reduction_fn is None:
        special = tuple(tok.decoder[i] for i in tok.all_special_ids)
        return ("clip-bpe", tok.context_length, tok.clean_fn, tok.vocab_size, special)
    return ("own", id(tok))


class EmbedStage(_EmbedBase):
    name = "embed"

    def __init__(
        self,
        run: RunDir,
        *,
        meru: ModelRef,
        clip: ModelRef | None,
        metadata: dict | None = None,
        **kw,
    ):
        super().__init__(run, **kw)
        self.meru_ref, self.clip_ref = meru, clip
        self.metadata = metadata  # {"dir", "features_key" (None: parquet only), "index"} with --metadata

    def clip_from_metadata(self) -> bool:
        """CLIP features and cos θ from the metadata's .npz and scores instead of the CLIP tower."""
        return bool(self.metadata and self.metadata.get("features_key"))

    def input_fingerprint(self, task: ShardTask, identity: dict) -> str:
        return fingerprint(
            {
                "stage": self.name,
                "v": VERSION,
                "input": identity,
                "meru": self.meru_ref.digest,
                "clip": None if self.clip_from_metadata() else self.clip_ref.digest,
                "metadata": self.metadata,
                "jpeg_draft": self.jpeg_draft,
                "numerics": numerics(self.device, self.precision),
                # only when on, so that runs without it keep their fingerprints
                **({"clip_txt": True} if self.clip_txt else {}),
            }
        )

    def setup(self) -> None:
        super().setup()
        if self.clip_txt and self.clip_from_metadata():
            raise ScoreError(
                "embed.clip_txt=true needs the CLIP text tower: pass --clip (the --metadata features are "
                "image features only)"
            )
        self.device = resolve_device(self.device)
        self._meru = load_scorer(self.meru_ref, "meru", self.device)
        self._clip = None if self.clip_from_metadata() else load_scorer(self.clip_ref, "clip", self.device)
        models = {"meru": self._meru} | ({"clip": self._clip} if self._clip is not None else {})
        self._curv = float(self._meru.curv.detach())
        self._meru_dim = self._meru.config.embed_dim
        self._K = float(self._meru.config.loss.entailment_K or 0.1)  # recorded, for later stages
        self._lookup = None
        if self.metadata:
            from hype.scoring.metadata import MetadataLookup

            self._lookup = MetadataLookup(
                self.metadata["dir"], self.run_dir.metadata_index, self.metadata["features_key"]
            )
        self._clip_dim = self._clip.config.embed_dim if self._clip is not None else self._lookup.feature_dim()
        self._start_decoding(models, labelled=False)

    def run(self, task: ShardTask) -> dict:
        started = time.perf_counter()
        identity = file_identity(task.source)  # of the input as read now
        fp = self.input_fingerprint(task, identity)
        self._debug_hook(task)
        retried = storage.retry_count()
        stats, counts = SkipStats(), {"samples": 0}
        names = embed_format.PAIR_COLUMNS + embed_format.EMBEDDING_COLUMNS + self._extra()
        cols: dict[str, list] = {k: [] for k in names}
        for batch in self._batches(self._samples(task, stats, counts)):
            self._embed_batch(batch, cols, stats)
        read = self._check_read(task, identity, stats)
        dims = {"meru_img": self._meru_dim, "meru_txt": self._meru_dim}
        dims |= {"clip_img": self._clip_dim, "clip_txt": self._clip_dim}
        pairs = {k: cols[k] for k in ("uid", "key", "text", "width", "height")}
        for k in ("neg_d_l", "cos_theta"):
            pairs[k] = np.concatenate(cols[k]) if cols[k] else np.zeros(0, np.float32)
        arrays = {
            k: np.concatenate(cols[k]) if cols[k] else np.zeros((0, dims[k]), np.float32)
            for k in embed_format.EMBEDDING_COLUMNS + self._extra()
        }
        schema = embed_format.embed_schema(
            self._meru_dim, self._clip_dim, self._curv, self._K, clip_txt=self.clip_txt
        )
        table = embed_format.build_table(pairs, arrays, schema)
        return self._finish(
            task,
            fp,
            table,
            started,
            rate=counts["samples"],
            input=read | {"given": task.path},
            counts={
                "samples": counts["samples"],
                "embedded": table.num_rows,
                "skipped": stats.total,
                "empty_captions": sum(1 for t in cols["text"] if not t),
            },
            skipped=stats.to_dict(),
            curv=self._curv,
            K=self._K,
            dims={"meru": self._meru_dim, "clip": self._clip_dim},
            numerics=numerics(self.device, self.precision),
            storage_retries=storage.retry_count() - retried,  # transient errors ridden out reading the shard
        )

    def _extra(self) -> tuple[str, ...]:
        return ("clip_txt",) if self.clip_txt else ()

    @torch.inference_mode()
    def _embed_batch(self, batch: list[Decoded], cols: dict, stats: SkipStats) -> None:
        cos = clip_img = clip_txt = None
        if self._lookup is not None:
            found, scores, feats = self._lookup.lookup([it.uid for it in batch])
            for it, ok in zip(batch, found, strict=True):
                if not ok:
                    stats.add(NOT_IN_METADATA, f"{it.where}: uid {it.uid} is not in the metadata")
            batch = [it for it, ok in zip(batch, found, strict=True) if ok]
            if not batch:
                return
            if self._clip is None:
                cos, clip_img = torch.from_numpy(scores[found]), torch.from_numpy(feats)
        dev = torch.device(self.device).type
        tokens: dict = {}
        with _autocast(self.device, self.precision):
            mi = self._meru.encode_image(self._images(batch, "meru"))
            mt = self._meru.encode_text(self._tokens(batch, "meru", tokens))
            if self._clip is not None:
                ci = self._clip.encode_image(self._images(batch, "clip"))
                ct = self._clip.encode_text(self._tokens(batch, "clip", tokens))
        with torch.autocast(device_type=dev, enabled=False):
            # −d_L itself (also for a hyperbolic-squared MERU), in fp32 (DESIGN §2.1).
            mi, mt = mi.float(), mt.float()
            neg_d_l = get_geometry("hyperbolic").rowwise(mi, mt, curv=self._curv)
            if self._clip is not None:
                clip_img, clip_txt = ci.float(), ct.float()
                cos = get_geometry("clip").rowwise(clip_img, clip_txt)
        mi, mt, neg_d_l = mi.cpu(), mt.cpu(), neg_d_l.cpu()
        clip_img, cos = clip_img.float().cpu(), cos.float().cpu()
        ok = (
            torch.isfinite(mi).all(1)
            & torch.isfinite(mt).all(1)
            & torch.isfinite(clip_img).all(1)
            & torch.isfinite(neg_d_l)
            & torch.isfinite(cos)
        )
        if not bool(ok.all()):
            for it, good in zip(batch, ok.tolist(), strict=True):
                if not good:
                    stats.add(NONFINITE, f"{it.where}: NaN or inf in an embedding or score")
            batch = [it for it, good in zip(batch, ok.tolist(), strict=True) if good]
            mi, mt, clip_img, neg_d_l, cos = mi[ok], mt[ok], clip_img[ok], neg_d_l[ok], cos[ok]
            clip_txt = clip_txt[ok] if clip_txt is not None else None
        for it in batch:
            cols["uid"].append(it.uid)
            cols["key"].append(it.key)
            cols["text"].append(it.text)
            cols["width"].append(it.width)
            cols["height"].append(it.height)
        cols["neg_d_l"].append(neg_d_l.numpy().astype(np.float32))
        cols["cos_theta"].append(cos.numpy().astype(np.float32))
        cols["meru_img"].append(mi.numpy())
        cols["meru_txt"].append(mt.numpy())
        cols["clip_img"].append(clip_img.numpy())
        if self.clip_txt:  # unit length, as clip_img (the CLIP geometry's cos θ normalizes both)
            cols["clip_txt"].append(torch.nn.functional.normalize(clip_txt.cpu(), dim=1).numpy())


class ClassEmbedStage(_EmbedBase):
    """CLIP image features of labelled reference images (`--class-images`) for the c_IN targets."""

    name = "classes"
    label_required = True  # False (`hype.scoring.stage_decontam`): images without a `.cls` are embedded too

    def __init__(self, run: RunDir, *, clip: ModelRef, **kw):
        super().__init__(run, **kw)
        self.clip_ref = clip

    def input_fingerprint(self, task: ShardTask, identity: dict) -> str:
        return fingerprint(
            {
                "stage": self.name,
                "v": VERSION,
                "input": identity,
                "clip": self.clip_ref.digest,
                "jpeg_draft": self.jpeg_draft,
                "numerics": numerics(self.device, self.precision),
            }
        )

    def setup(self) -> None:
        super().setup()
        self.device = resolve_device(self.device)
        self._clip = load_scorer(self.clip_ref, "clip", self.device)
        self._start_decoding({"clip": self._clip}, labelled=True, label_required=self.label_required)

    @torch.inference_mode()
    def run(self, task: ShardTask) -> dict:
        started = time.perf_counter()
        identity = file_identity(task.source)
        fp = self.input_fingerprint(task, identity)
        self._debug_hook(task)
        stats, counts = SkipStats(), {"samples": 0}
        keys, labels, feats = [], [], []
        for batch in self._batches(self._samples(task, stats, counts)):
            with _autocast(self.device, self.precision):
                x = self._clip.encode_image(self._images(batch, "clip"))
            x = x.float().cpu()
            ok = torch.isfinite(x).all(1).tolist()
            for it, good in zip(batch, ok, strict=True):
                if not good:
                    stats.add(NONFINITE, f"{it.where}: NaN or inf in the image embedding")
            keys += [it.key for it, good in zip(batch, ok, strict=True) if good]
            labels += [it.label for it, good in zip(batch, ok, strict=True) if good]
            feats.append(x[torch.tensor(ok, dtype=torch.bool)].numpy())
        read = self._check_read(task, identity, stats)
        dim = self._clip.config.embed_dim
        arr = np.concatenate(feats) if feats else np.zeros((0, dim), np.float32)
        table = pa.table(
            {
                "key": pa.array(keys, pa.string()),
                "cls": pa.array(labels, pa.int32()),
                "clip_img": embed_format.fixed_list(arr.reshape(-1, dim)),
            }
        )
        return self._finish(
            task,
            fp,
            table,
            started,
            input=read,
            counts={"samples": counts["samples"], "embedded": table.num_rows, "skipped": stats.total},
            skipped=stats.to_dict(),
        )
