"""The training loop behind `hype train`: one CPU, one GPU, or many GPUs under torchrun.

    from hype.train import load_train_config, train
    summary = train(load_train_config("tiny-hyperbolic", ["data.train=world/clean/shards"]))

Per step: draw this rank's batch, set the learning rate (warm-up + cosine) and the entailment K, compute
the gradients of the global-batch loss (`hype.train.step`), check that the loss is finite on every rank,
clip, step AdamW. Rank 0 logs metrics, shows progress and writes checkpoints; every rank takes part in
the collectives at the same steps, so a stop (divergence, signal) is taken by all ranks together.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn
from tqdm import tqdm

from hype.data.errors import SelectError
from hype.data.grounding import NO_GROUNDING
from hype.data.pipeline import CAPTION_TRANSFORM_FAILED, TrainStream, make_loader
from hype.data.samples import EMPTY_SHARD, SKIP_REASONS, SkipStats
from hype.data.shards import ShardList, expand_shards
from hype.data.subset_index import SubsetError, SubsetIndex, check_subset_matches, resolve_subset
from hype.data.uids import load_subset, write_subset
from hype.io import AnyPath, cached_copy, storage, write_text
from hype.io.runs import is_done
from hype.losses import ContrastiveEntailmentLoss
from hype.losses.hycoclip import HyCoCLIPLoss
from hype.models import ConfigError, ContrastiveModel, ModelConfig, create_model, load_model_config
from hype.train.captions import make_caption_transform
from hype.train.config import TrainConfig
from hype.train.distributed import (
    DistInfo,
    all_reduce_sum,
    barrier,
    broadcast_from_main,
    cleanup,
    init_distributed,
)
from hype.train.metrics import MetricsLog, format_summary, read_metrics, write_summary
from hype.train.optim import build_optimizer, entailment_K_at, lr_at, set_lr
from hype.train.sampler import draw_subset
from hype.train.state import (
    CheckpointPaths,
    ResumeError,
    checkpoint_paths,
    config_differences,
    latest_checkpoint,
    load_model_weights,
    load_training_state,
    prune_checkpoints,
    publish_final,
    recipe_fingerprint,
    resolve_resume,
    save_training_checkpoint,
)
from hype.train.step import autocast_for, forward_backward

COUNTED_REASONS = (*SKIP_REASONS, CAPTION_TRANSFORM_FAILED, NO_GROUNDING)


class InitError(ValueError):
    """`init` weights that cannot start this run (unreadable, or another architecture)."""


class TrainingDiverged(RuntimeError):
    """The loss or the gradients became NaN/inf; the run stopped, keeping the last good checkpoint."""


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
        return torch.nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def default_out(cfg: TrainConfig) -> AnyPath:
    return storage.location(cfg.out) if cfg.out else Path("runs") / "train" / (cfg.name or "run")


def effective_model_config(cfg: TrainConfig) -> ModelConfig:
    """The model config with the training config's entailment settings folded in, so the checkpoint
    records what the model was trained with (with a K schedule: its final K)."""
    base = load_model_config(cfg.model)
    d = base.to_dict()
    loss = cfg.loss
    if loss.entailment_weight is not None:
        d["loss"]["entailment_weight"] = loss.entailment_weight
    if loss.entailment_K is not None:
        d["loss"]["entailment_K"] = loss.entailment_K
    if loss.K_end is not None:
        d["loss"]["entailment_K"] = loss.K_end
    return ModelConfig.from_dict(d, source=f"model {base.name!r} with the training config's loss section")


@dataclass
class _Session:
    """What `Trainer.run` carries from step to step."""

    step: int  # completed steps
    last_ckpt: CheckpointPaths | None
    metrics: MetricsLog | None  # rank 0 only
    pbar: Any = None
    status: str = "running"
    train_time: float = 0.0
    t0: float = 0.0
    t_log: float = 0.0  # time and samples at the last metrics row, for its samples_per_s
    samples_log: int = 0
    steady_from: tuple[float, int] | None = None  # (time, step) after the warm-up steps


@dataclass(frozen=True)
class _StepDone:
    step: int
    lr: float
    K: float | None
    grad_norm: float
    skipped: bool


class Trainer:
    """Sets up everything for one `TrainConfig` on this rank and runs the loop (`run`)."""

    def __init__(
        self,
        cfg: TrainConfig,
        info: DistInfo,
        *,
        resume: str = "auto",
        progress: bool = True,
        echo: Callable[[str], None] | None = None,
    ):
        self.cfg, self.info = cfg, info
        self.progress = progress and info.is_main
        self._echo = echo or (lambda msg: tqdm.write(msg, file=sys.stderr))
        self.out = default_out(cfg)
        self.recipe_fp = recipe_fingerprint(cfg.to_dict())
        storage.check_reachable(self.out)  # a missing bucket: now, not at the first checkpoint
        self.metrics: MetricsLog | None = None  # rank 0's log, once `run` opened it
        self.total_steps = cfg.total_steps
        self.end_step = min(self.total_steps, cfg.max_steps) if cfg.max_steps else self.total_steps

        world, accum = info.world_size, cfg.accum_steps
        if cfg.batch_size % (world * accum):
            raise ConfigError(
                "batch_size",
                f"{cfg.batch_size} is not divisible by {world} process(es) x accum_steps {accum}; choose a "
                "multiple",
            )
        self.local_batch = cfg.batch_size // world

        self.shards: ShardList = expand_shards(cfg.data.train or "")
        self.subset: SubsetIndex | None = resolve_subset(cfg.data.subset)
        sampled = self._sample() if cfg.sampler.kind == "softcap" else None
        self.subset_info: dict | None = None
        if self.subset is not None:
            self.subset_info = {"path": str(cfg.data.subset), **self._check_subset()}
            if sampled is not None:  # the run trains on the draw; the summary of a stream run is unchanged
                self.subset_info.update(path=sampled["file"], sampler=sampled)

        self.model_config = effective_model_config(cfg)
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        self.model: ContrastiveModel = create_model(self.model_config, device=info.device)
        self.init_info = self._load_init(cfg.init) if cfg.init else None
        self.model.train()
        if cfg.grad_checkpointing:
            self.model.set_grad_checkpointing(True)
        self.loss_fn = self._loss_fn()
        self.base_K = self.model_config.loss.entailment_K
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.trainable = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.scaler = torch.amp.GradScaler(info.device.type) if cfg.precision == "fp16" else None
        self.autocast = autocast_for(cfg.precision, info.device)

        self.start_step, self.resumed_from = 0, None
        self.prev_skips = SkipStats()
        self.prev_shards_read = 0
        self.prev_train_time = 0.0
        found = resolve_resume(resume, self.out)
        if found is not None:
            self._resume(found)
        self.generation = self.start_step

        # Per-rank, per-session seed for augmentations drawn in this process (workers=0) and for the
        # DataLoader's worker seeds; the data stream itself is seeded in TrainStream.
        torch.manual_seed(hash((cfg.seed, info.rank, self.generation)) % (2**63))

        transform, needs_meta = make_caption_transform(cfg.data.caption_template, cfg.data.caption_fn)
        self.stream = TrainStream(
            self.shards.paths,
            batch_size=self.local_batch,
            image_transform=self.model.preprocess(train=True),
            tokenize=self.model.tokenizer(),
            caption_transform=transform,
            needs_meta=needs_meta,
            subset=self.subset,
            resampled=cfg.data.resampled,
            seed=cfg.seed,
            rank=info.rank,
            world_size=info.world_size,
            generation=self.generation,
            shuffle_buffer=cfg.data.shuffle_buffer,
            data_spec=self.shards.spec,
            grounding_min_area=cfg.hycoclip.min_box_area if cfg.hycoclip.enabled else None,
            unboxed=cfg.hycoclip.unboxed,
        )
        self.skips = SkipStats()
        self.shards_read = 0
        self.stop_requested = False

        if cfg.optim.warmup_steps >= self.total_steps:
            self.echo(
                f"warning: warmup_steps {cfg.optim.warmup_steps} >= total steps {self.total_steps}: the "
                f"learning rate never reaches optim.lr={cfg.optim.lr} (lower optim.warmup_steps or raise "
                "samples_seen)"
            )

    def _loss_fn(self) -> ContrastiveEntailmentLoss | HyCoCLIPLoss:
        weight, K = self.model_config.loss.entailment_weight or 0.0, self.model_config.loss.entailment_K
        h = self.cfg.hycoclip
        if not h.enabled:
            return ContrastiveEntailmentLoss(self.model.geometry, entailment_weight=weight, K=K)
        try:
            return HyCoCLIPLoss(self.model.geometry, weight, K, h.inter_aperture, h.intra_aperture)
        except ValueError as e:
            raise InitError(f"hycoclip.enabled: {e}; pick a MERU model (e.g. model=meru-vit-s16)") from e

    def _sample(self) -> dict:
        """Draw the soft-cap multiset (`hype.train.sampler`) on rank 0 into OUT/sampled.npy, which every
        rank then trains on as its subset; returns the draw's record. A resumed run must draw the same
        multiset: different scores are refused rather than trained on."""
        path = self.out / "sampled.npy"
        result: dict | str = {}
        if self.info.is_main:
            try:
                cfg = self.cfg
                multiset, result = draw_subset(cfg.sampler, cfg.samples_seen, cfg.seed, self.subset)
                if latest_checkpoint(self.out) is not None and storage.is_file(path):
                    if not np.array_equal(load_subset(path), multiset):
                        raise ResumeError(
                            f"{path}: the run was started on another draw (the scores {cfg.sampler.scores} "
                            "changed since); resume with the original scores or choose another --out"
                        )
                else:
                    write_subset(path, multiset)
                result["file"] = str(path)
            except (SubsetError, SelectError, ResumeError) as e:
                result = f"{type(e).__name__}\t{e}"
        result = broadcast_from_main(result, self.info)
        if isinstance(result, str):
            kind, msg = result.split("\t", 1)
            raise {"ResumeError": ResumeError, "SelectError": SelectError}.get(kind, SubsetError)(msg)
        self.subset = SubsetIndex.load(path)
        return result

    def _check_subset(self) -> dict:
        """Rank 0 reads the parquets (up to data.subset_check_shards) and shares the verdict, so a large
        job does not read them once per rank."""
        result: dict | str = {}
        if self.info.is_main:
            try:
                result = check_subset_matches(
                    self.shards.paths, self.subset, self.shards.spec, self.cfg.data.subset_check_shards
                )
            except SubsetError as e:
                result = str(e)
        result = broadcast_from_main(result, self.info)
        if isinstance(result, str):
            raise SubsetError(result)
        return result

    def echo(self, msg: str) -> None:
        if self.info.is_main:
            self._echo(msg)

    # --- initial weights ----------------------------------------------------------------------------

    def _load_init(self, path: str) -> dict:
        """Copy the towers (and the scalars the source has for this geometry) of `path` into the model.

        The source may be any model `hype.checkpoint.load_model_file` reads: a hype checkpoint or an
        open_clip file or folder. Its towers must have exactly this model's architecture; scalars of
        another geometry (a CLIP's logit scale for a MERU run) are left at the config's init values.
        """
        from hype.checkpoint import load_model_file

        try:
            src = load_model_file(cached_copy(path), hype_towers=True)  # a URL: downloaded once
        except (ValueError, OSError) as e:
            raise InitError(f"init {path}: {e}") from None
        theirs, ours = src.state_dict(), self.model.state_dict()
        towers = [k for k in ours if k.startswith(("visual.", "text."))]
        wrong = [k for k in towers if k not in theirs or theirs[k].shape != ours[k].shape]
        extra = [k for k in theirs if k.startswith(("visual.", "text.")) and k not in ours]
        if wrong or extra:
            raise InitError(
                f"init {path}: its towers ({src.config.name}) are not the architecture of model config "
                f"{self.model_config.name!r} ({len(wrong)} tensors missing or of another shape, e.g. "
                f"{(wrong or extra)[:3]}); pick the model config that matches it, e.g. clip-vit-b32 for "
                "open_clip's ViT-B-32"
            )
        same_geometry = src.config.geometry == self.model_config.geometry
        scalars = [k for k in ours if k.startswith("log_") and same_geometry and k in theirs]
        with torch.no_grad():
            for k in towers + scalars:
                ours[k].copy_(theirs[k])
        return {"path": str(path), "model_config": src.config.name, "scalars": scalars}

    # --- resume -------------------------------------------------------------------------------------

    def _resume(self, found: CheckpointPaths) -> None:
        state = load_training_state(found)
        diffs = config_differences(state.get("train_config", {}), self.cfg.to_dict())
        if diffs:
            raise ResumeError(
                f"{found.state}: the run was started with a different configuration "
                f"({'; '.join(diffs[:6])}); resume with the original settings or choose another --out"
            )
        load_model_weights(self.model, found)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.start_step = int(state["step"])
        self.resumed_from = self.start_step
        data = state.get("data", {})
        self.prev_skips.merge(data.get("skips", {}))
        self.prev_shards_read = int(data.get("shards_read", 0))
        self.prev_train_time = float(state.get("train_time_s", 0.0))
        self.echo(f"resuming {found.state} at step {self.start_step}/{self.total_steps}")

    # --- per-step pieces ----------------------------------------------------------------------------

    def scalars(self) -> dict[str, float | None]:
        m = self.model
        with torch.no_grad():
            out = {"logit_scale": float(m.logit_scale)}
            for name in ("curv", "alpha_img", "alpha_txt"):
                v = getattr(m, name)
                out[name] = None if v is None else float(v)
        return out

    def _check_terms(self, step: int, lr: float, K: float | None) -> Callable[[torch.Tensor], None]:
        def check(terms: torch.Tensor) -> None:
            # One collective per step: the rank-mean of the loss terms plus the stop flag. A NaN on any
            # rank makes the sum NaN everywhere, so all ranks stop together.
            flag = torch.tensor([1.0 if self.stop_requested else 0.0], device=terms.device)
            vec = all_reduce_sum(torch.cat([terms, flag]), self.info)
            self.global_terms = vec[:3] / self.info.world_size
            self.global_stop = bool(vec[3].item() > 0)
            values = self.global_terms.tolist()
            if not all(math.isfinite(v) for v in values):
                raise TrainingDiverged(
                    f"non-finite loss at step {step}: loss {values[0]}, contrastive {values[1]}, entailment "
                    f"{values[2]} (lr {lr:.3g}, K {K}, scalars {self._fmt_scalars()}); the last good "
                    f"checkpoint is kept in {self.out / 'checkpoints'}. Lower optim.lr, raise "
                    "optim.warmup_steps, set optim.grad_clip_norm, or use precision=bf16/fp32"
                )

        return check

    def _fmt_scalars(self) -> str:
        return ", ".join(f"{k} {v:.4g}" for k, v in self.scalars().items() if v is not None)

    def _optimizer_step(self, step: int) -> tuple[float, bool]:
        """Clip and step; returns (gradient norm before clipping, whether the step was skipped by fp16)."""
        clip = self.cfg.optim.grad_clip_norm
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.trainable, clip)
        else:
            norm = _total_norm([p.grad for p in self.trainable if p.grad is not None])
        norm_value = float(norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips the update when the fp16 gradients overflowed
            self.scaler.update()
            return norm_value, not math.isfinite(norm_value)
        if not math.isfinite(norm_value):
            raise TrainingDiverged(
                f"non-finite gradient norm ({norm_value}) at step {step} (scalars {self._fmt_scalars()}); "
                f"the last good checkpoint is kept in {self.out / 'checkpoints'}. Lower optim.lr or set "
                "optim.grad_clip_norm"
            )
        self.optimizer.step()
        return norm_value, False

    def _global_skips(self) -> SkipStats:
        """Skip counts of all ranks and sessions (a collective: call at the same step on every rank)."""
        counts = torch.tensor(
            [float(self.skips.counts.get(r, 0)) for r in COUNTED_REASONS], dtype=torch.float64
        )
        shards = torch.tensor([float(self.shards_read)], dtype=torch.float64)
        vec = torch.cat([counts, shards]).to(self.info.device)
        vec = all_reduce_sum(vec, self.info).cpu().tolist()
        total = SkipStats()
        total.merge(self.prev_skips)
        now = {r: int(n) for r, n in zip(COUNTED_REASONS, vec[:-1], strict=True) if n}
        total.merge({"counts": now, "examples": self.skips.examples})
        self.global_shards_read = self.prev_shards_read + int(vec[-1])
        return total

    def _save(self, step: int, train_time: float) -> CheckpointPaths:
        skips = self._global_skips()  # collective on every rank
        paths = checkpoint_paths(self.out, step)
        if self.info.is_main:
            state = {
                "step": step,
                "samples_seen": step * self.cfg.batch_size,
                "total_steps": self.total_steps,
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler is not None else {},
                "data": {
                    "seed": self.cfg.seed,
                    "generation": self.generation,
                    "skips": skips.to_dict(),
                    "shards_read": self.global_shards_read,
                },
                "train_config": self.cfg.to_dict(),
                "world_size": self.info.world_size,
                "train_time_s": self.prev_train_time + train_time,
            }
            save_training_checkpoint(
                self.out,
                step,
                self.model,
                state,
                extra={"samples_seen": step * self.cfg.batch_size, "train_config": self.cfg.name},
            )
            prune_checkpoints(self.out, self.cfg.checkpoint.keep)
            if self.metrics is not None:
                self.metrics.sync()  # on object storage the log is uploaded with each checkpoint
        barrier(self.info)
        return paths

    # --- the loop -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _signals(self):
        """SIGTERM/SIGINT ask for a clean stop: checkpoint at the end of the step, then exit."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self.stop_requested:  # a second Ctrl-C: stop now
                raise KeyboardInterrupt
            self.stop_requested = True
            self.echo(
                f"signal {signal.Signals(signum).name}: stopping after this step and saving a checkpoint"
            )

        old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def run(self) -> dict[str, Any]:
        """Train from the start (or resumed) step to the end step; returns the summary."""
        cfg, info = self.cfg, self.info
        if info.is_main:
            storage.makedirs(self.out)
            # Written only now, after a resume has been validated, so a refused resume leaves it alone.
            write_text(self.out / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        barrier(info)
        metrics_path = self.out / "metrics.jsonl"
        metrics = MetricsLog(metrics_path, self.start_step) if info.is_main else None
        self.metrics = metrics
        summary: dict[str, Any] = {"status": "running", "error": None}
        self.last_row: dict[str, Any] = {}
        self.global_terms = torch.zeros(3)
        self.global_stop = False
        self.global_shards_read = self.prev_shards_read
        session = _Session(step=self.start_step, last_ckpt=latest_checkpoint(self.out), metrics=metrics)
        if self.start_step >= self.end_step:
            status = "already_complete" if self.start_step >= self.total_steps else "stopped"
            return self._finish(status, session.step, 0.0, None, session.last_ckpt, metrics, summary)
        return self._train(session, summary)

    def _train(self, session: _Session, summary: dict[str, Any]) -> dict[str, Any]:
        """The steps of this session, then the summary, whatever ended them (a raise is re-raised)."""
        cfg, info = self.cfg, self.info
        ddp_model = self._wrap_model()
        loader = make_loader(
            self.stream,
            workers=cfg.data.workers,
            pin_memory=info.device.type == "cuda",
            prefetch=cfg.data.prefetch,
        )
        session.pbar = self._progress_bar()
        try:
            with self._signals():
                self._steps(ddp_model, iter(loader), session)
        except TrainingDiverged as e:
            session.status = "diverged"
            summary["error"] = str(e)
            raise
        except Exception as e:
            session.status = "failed"
            summary["error"] = f"{type(e).__name__}: {e}"
            raise
        finally:
            session.pbar.close()
            steady_time = self._measure_rate(session)
            if session.status != "running":
                self._finish(
                    session.status,
                    session.step,
                    session.train_time,
                    steady_time,
                    session.last_ckpt,
                    session.metrics,
                    summary,
                )
            elif session.metrics is not None:
                session.metrics.close()
            del loader
        return summary

    def _wrap_model(self) -> nn.Module:
        if not self.info.distributed:
            return self.model
        return nn.parallel.DistributedDataParallel(
            self.model,
            device_ids=[self.info.device.index] if self.info.device.type == "cuda" else None,
            broadcast_buffers=False,
        )

    def _progress_bar(self) -> tqdm:
        batch, end = self.cfg.batch_size, self.end_step
        return tqdm(
            total=end * batch,
            initial=self.start_step * batch,
            unit="sample",
            unit_scale=end * batch >= 100_000,
            dynamic_ncols=True,
            file=sys.stderr,
            disable=not self.progress,
            desc=f"train {self.cfg.name}",
        )

    def _steps(self, model: nn.Module, it: Iterator[dict], session: _Session) -> None:
        """Step until the end step or a stop; leaves how it ended in `session.status`."""
        cfg = self.cfg
        warm = min(3, self.end_step - self.start_step - 1)  # steps left out of the steady-state throughput
        session.t0 = time.perf_counter()
        session.t_log, session.samples_log = session.t0, self.start_step * cfg.batch_size
        for step_idx in range(self.start_step, self.end_step):
            batch = self._next_batch(it, session)
            if batch is None:
                return
            done = self._step(model, batch, step_idx)
            session.step = done.step  # `step` counts completed steps; it advances after the update
            now = time.perf_counter()
            session.train_time = now - session.t0
            if step_idx - self.start_step + 1 == warm:
                session.steady_from = (now, session.step)
            session.pbar.update(cfg.batch_size)
            stop = self.global_stop
            if done.step % cfg.log_every_steps == 0 or done.step == self.end_step or stop:
                self._log(done, now, session)
            every = cfg.checkpoint.every_steps
            if stop or done.step == self.end_step or (every and done.step % every == 0):
                session.last_ckpt = self._save(done.step, session.train_time)
            if stop:
                session.status = "interrupted"
                return
        session.status = "completed" if self.end_step == self.total_steps else "stopped"

    def _next_batch(self, it: Iterator[dict], session: _Session) -> dict | None:
        """The next batch, or None when the loader died of a stop signal (the stop is then taken here)."""
        try:
            return next(it)
        except RuntimeError:
            if not self.stop_requested:
                raise
            # Workers lost to the stop signal: the last completed step is saved below.
            session.status = "interrupted"
            if session.step > self.start_step:
                session.last_ckpt = self._save(session.step, session.train_time)
            return None

    def _step(self, model: nn.Module, batch: dict, step_idx: int) -> _StepDone:
        """One optimizer step on `batch`: learning rate and K for `step_idx`, gradients, clip, update."""
        cfg, info = self.cfg, self.info
        current = step_idx + 1
        self.skips.merge(batch["skips"])
        self.shards_read += batch["shards_read"]
        images, tokens = batch["images"], batch["tokens"]
        if "box_images" in batch:  # HyCoCLIP: wholes and boxes in one forward pass, split by its loss
            images = torch.cat([images, batch["box_images"]])
            tokens = torch.cat([tokens, batch["box_tokens"]])
        images = images.to(info.device, non_blocking=True)
        tokens = tokens.to(info.device, non_blocking=True)
        lr = lr_at(
            step_idx,
            base_lr=cfg.optim.lr,
            warmup_steps=cfg.optim.warmup_steps,
            total_steps=self.total_steps,
        )
        set_lr(self.optimizer, lr)
        K = entailment_K_at(step_idx, self.total_steps, cfg.loss, self.base_K)
        self.loss_fn.K = K
        if isinstance(self.loss_fn, HyCoCLIPLoss):
            self.loss_fn.box_mask = batch.get("box_mask")
        self.optimizer.zero_grad(set_to_none=True)
        forward_backward(
            model,
            self.loss_fn,
            images,
            tokens,
            accum_steps=cfg.accum_steps,
            autocast=self.autocast,
            scaler=self.scaler,
            check=self._check_terms(current, lr, K),
            inject_nan=cfg.debug_nan_at_step == current,
        )
        grad_norm, skipped = self._optimizer_step(current)
        return _StepDone(current, lr, K, grad_norm, skipped)

    def _log(self, done: _StepDone, now: float, session: _Session) -> None:
        """A metrics row for the step just done (a collective: all ranks log at the same steps)."""
        skips = self._global_skips()
        samples = done.step * self.cfg.batch_size
        terms = self.global_terms.tolist()
        entailment = self.loss_fn.entailment_weight > 0
        row = {
            "step": done.step,
            "samples_seen": samples,
            "lr": done.lr,
            "loss": terms[0],
            "contrastive": terms[1],
            "entailment": terms[2] if entailment else None,
            "K": done.K if entailment else None,
            **self.scalars(),
            "grad_norm": done.grad_norm,
            "fp16_skipped_step": done.skipped if self.scaler is not None else None,
            "samples_per_s": (samples - session.samples_log) / max(now - session.t_log, 1e-9),
            "skipped": skips.total,
            "shards_read": self.global_shards_read,
            "time_s": round(self.prev_train_time + session.train_time, 3),
        }
        session.t_log, session.samples_log = now, samples
        self.last_row = row
        if session.metrics is not None:
            session.metrics.write(row)
        session.pbar.set_postfix(step=done.step, loss=f"{terms[0]:.4f}", lr=f"{done.lr:.2e}", refresh=False)

    def _measure_rate(self, session: _Session) -> float:
        """Set `steady_rate` (samples/s after the warm-up steps, when there were steps after them);
        returns the steady time (0 without it)."""
        batch, step, steady_from = self.cfg.batch_size, session.step, session.steady_from
        if steady_from is not None and step > steady_from[1]:
            steady_time = time.perf_counter() - steady_from[0]
            self.steady_rate = (step - steady_from[1]) * batch / max(steady_time, 1e-9)
            return steady_time
        self.steady_rate = (step - self.start_step) * batch / max(session.train_time, 1e-9)
        return 0.0

    def _finish(
        self,
        status: str,
        step: int,
        train_time: float,
        steady_time: float | None,
        last_ckpt: CheckpointPaths | None,
        metrics: MetricsLog | None,
        summary: dict[str, Any],
    ) -> dict[str, Any]:
        cfg = self.cfg
        if status in ("diverged", "failed"):
            skips = SkipStats()
            skips.merge(self.prev_skips)
            skips.merge(self.skips)  # no collective: other ranks may not get here
        else:
            skips = self._global_skips()
        model_path = None
        if (
            status in ("completed", "already_complete")
            and last_ckpt is not None
            and last_ckpt.step == self.total_steps
        ):
            model_path = self.out / "model.safetensors"
            if self.info.is_main:
                publish_final(last_ckpt, model_path)
        ran = step - self.start_step
        if not self.last_row and storage.is_file(self.out / "metrics.jsonl"):
            rows = read_metrics(self.out / "metrics.jsonl")
            self.last_row = rows[-1] if rows else {}
        rate = ran * cfg.batch_size / train_time if train_time > 0 else 0.0
        summary.update(
            {
                "name": cfg.name,
                "status": status,
                "step": step,
                "total_steps": self.total_steps,
                "max_steps": cfg.max_steps,
                "samples_seen": step * cfg.batch_size,
                "samples_seen_target": cfg.samples_seen,
                "batch_size": cfg.batch_size,
                "micro_batch_size": self.local_batch // cfg.accum_steps,
                "accum_steps": cfg.accum_steps,
                "world_size": self.info.world_size,
                "device": str(self.info.device),
                "precision": cfg.precision,
                "model_config": self.model_config.name,
                "geometry": self.model_config.geometry,
                "resumed_from_step": self.resumed_from,
                "init": self.init_info,
                "steps_this_session": ran,
                "train_time_s": train_time,
                "train_time_total_s": self.prev_train_time + train_time,
                "samples_per_s": rate,
                "steady_samples_per_s": getattr(self, "steady_rate", rate) if ran else 0.0,
                "final": {
                    k: v
                    for k, v in self.last_row.items()
                    if k
                    in (
                        "loss",
                        "contrastive",
                        "entailment",
                        "lr",
                        "logit_scale",
                        "curv",
                        "alpha_img",
                        "alpha_txt",
                        "K",
                    )
                },
                "skipped": skips.to_dict(),
                "data": {
                    "spec": self.shards.spec,
                    "shards": len(self.shards),
                    "shards_read": self.global_shards_read,
                },
                "empty_shards": self.shards.empty,
                "subset": self.subset_info,
                "checkpoint": str(last_ckpt.model) if last_ckpt is not None else None,
                "model": str(model_path) if model_path is not None else None,
                "out": str(self.out),
                "metrics": str(self.out / "metrics.jsonl"),
                "summary": str(self.out / "summary.json"),
            }
        )
        if self.shards.empty:
            summary["skipped"]["counts"][EMPTY_SHARD] = len(self.shards.empty)
        if metrics is not None:
            metrics.close()
        state = "done" if model_path is not None else status  # done: the final model is published
        if self.info.is_main:
            write_summary(self.out / "summary.json", summary, self.recipe_fp, state)
        summary.update(state=state, fingerprint=self.recipe_fp)  # as in the file
        return summary


def train(
    cfg: TrainConfig,
    *,
    resume: str = "auto",
    progress: bool = True,
    echo: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run (or resume) training for `cfg`; returns the summary (also written to OUT/summary.json).

    Raises `TrainingDiverged` on a NaN/inf loss (after writing the summary), `ShardError`/`SubsetError`/
    `DataError` on unusable data, `SelectError` on an unusable subset file and `ResumeError` on an
    incompatible resume.
    """
    if resume == "auto" and (finished := finished_run(cfg)) is not None:
        return finished
    info = init_distributed(cfg.device)
    try:
        with _reproducible(cfg, info.device):
            return Trainer(cfg, info, resume=resume, progress=progress, echo=echo).run()
    finally:
        cleanup(info)


def finished_run(cfg: TrainConfig) -> dict[str, Any] | None:
    """The summary of a run of this very recipe that finished in OUT (its marker says done and its final
    model is there), as the result of a rerun with nothing to do; None when there is work to do."""
    out = default_out(cfg)
    record = is_done(out / "summary.json", recipe_fingerprint(cfg.to_dict()))
    if record is None or not storage.is_file(out / "model.safetensors"):
        return None
    return {**record, "status": "already_complete", "steps_this_session": 0}


@contextlib.contextmanager
def _reproducible(cfg: TrainConfig, device: torch.device) -> Iterator[None]:
    """For the run: `cfg.threads` CPU threads, and on CPU torch's deterministic algorithms (they cost
    little there; on CUDA they need a cuBLAS workspace setting and slow scatter-adds, so GPU runs keep
    the fast kernels). This process's settings are restored after, for callers that go on."""
    saved = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1])


__all__ = [
    "Trainer",
    "TrainingDiverged",
    "default_out",
    "effective_model_config",
    "finished_run",
    "format_summary",
    "train",
]
