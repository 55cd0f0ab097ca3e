"""Training configuration: YAML presets under `configs/train/` -> validated, frozen dataclasses.

    hype train --config tiny-hyperbolic optim.lr=1e-3 data.workers=2 model.vision.layers=2

A preset names a model config (`model: tiny-hyperbolic`, a path to a model YAML, or an inline mapping)
and the recipe: samples seen, global batch, optimizer, schedule, precision, data options, checkpoints.
`key=value` overrides address any field with a dotted path; values are parsed as YAML (`1e-3`, `true`,
`null`, `[0.3, 0.1]`). Overrides under `model.` edit the model config itself. Every mistake is a
`ConfigError` naming the file (or `override`) and the key, listing the valid keys for unknown ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from os import PathLike
from pathlib import Path
from typing import Any

from hype.config import (
    ConfigError,
    at_least,
    build,
    in_range,
    list_presets,
    load,
    one_of,
    parse_override,
    positive,
    resolve_preset,
    set_path,
    to_dict,
)
from hype.config import apply_override as _apply_override
from hype.models import ModelConfig, load_model_config

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class DataConfig:
    train: str | None = None  # DIR_OR_PATTERN of webdataset shards (--data)
    subset: str | None = None  # DataComp subset .npy restricting training to its uids (--subset)
    resampled: bool = True  # draw shards with replacement (DataComp); false: disjoint split per worker
    workers: int = 4  # DataLoader processes per rank (0: decode in the training process)
    prefetch: int = 2  # batches prefetched per worker
    shuffle_buffer: int = 2000  # undecoded samples per worker
    caption_template: str | None = None  # e.g. "{subreddit} : {caption}" (MERU); fields from the .json
    caption_fn: str | None = None  # "package.module:function" (caption: str, meta: dict) -> str
    subset_check_shards: int = 2000  # parquet files read up front to verify the subset matches the data

    def __post_init__(self) -> None:
        at_least(self, 0, "workers")
        at_least(self, 1, "prefetch", "shuffle_buffer", "subset_check_shards")
        if self.caption_template is not None and self.caption_fn is not None:
            raise ConfigError("caption_fn", "set caption_template or caption_fn, not both")
        if self.caption_fn is not None and ":" not in self.caption_fn:
            raise ConfigError(
                "caption_fn", f"must look like 'package.module:function', got {self.caption_fn!r}"
            )


SAMPLERS = ("stream", "softcap")


@dataclass(frozen=True)
class SamplerConfig:
    """Which samples training sees (DESIGN §2.5). `stream`: every sample of the data (or of --subset, as
    often as it appears there). `softcap`: FLYT's soft-cap sampling, a multiset of `samples_seen` draws
    made before training from the scores of `scores` (a `hype score` run or its scores folder), drawn in
    rounds of `round` without replacement with probability softmax(score / temperature), each draw
    lowering its sample's logit by `penalty`, no sample drawn more than `cap` times (null: no hard cap)."""

    kind: str = "stream"
    scores: str | None = None  # RUN_DIR (or RUN_DIR/scores) of the scores to sample by
    column: str = "hype"  # a numeric column of the scores table, or hype: the Eq. 1 sum of its metrics
    temperature: float = 1.0
    penalty: float = 0.15  # FLYT's repetition penalty
    cap: int | None = None
    round: int = 100_000  # draws per round (FLYT's batch_size)

    def __post_init__(self) -> None:
        one_of(self, "kind", SAMPLERS)
        positive(self, "temperature")
        at_least(self, 0, "penalty")
        at_least(self, 1, "cap", "round")
        if self.kind == "softcap" and not self.scores:
            raise ConfigError(
                "scores", "the softcap sampler needs the scores to sample by: sampler.scores=RUN_DIR"
            )
        if self.kind == "stream" and any(getattr(self, f.name) != f.default for f in fields(self)):
            raise ConfigError(
                "kind", "sampler settings are given but sampler.kind is stream; set sampler.kind=softcap"
            )


@dataclass(frozen=True)
class HyCoCLIPConfig:
    """HyCoCLIP's training (SPEC §2.6, `hype.losses.hycoclip`): every sample also yields one of the GRIT
    boxes of its `.json` (`hype.data.grounding`: crops larger than `min_box_area` pixels, one drawn per
    sample and step; a sample without one is skipped and counted), and the loss adds the box level and the
    box ⊃ whole cones. The model stays MERU's; its `loss.entailment_weight` weighs the entailment terms."""

    enabled: bool = False
    min_box_area: int = 32 * 32  # the authors' cutoff on GRIT's images
    inter_aperture: float = 0.7  # text ⊃ image at both levels: ext < 0.7 aper
    intra_aperture: float = 1.2  # box ⊃ whole in each modality: ext < 1.2 aper
    # A sample with no box: `skip` it (the authors' preparation drops them) or train its `whole` pair
    # (the whole-level terms only; its box terms are left out).
    unboxed: str = "skip"

    def __post_init__(self) -> None:
        one_of(self, "unboxed", ("skip", "whole"))
        at_least(self, 0, "min_box_area")
        positive(self, "inter_aperture", "intra_aperture")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up and cosine decay to 0 (DESIGN §2.5)."""

    lr: float = 5e-4
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-6
    weight_decay: float = 0.2  # never applied to gains, biases, 1-D embeddings and the learnable scalars
    warmup_steps: int = 500
    grad_clip_norm: float | None = None

    def __post_init__(self) -> None:
        positive(self, "lr", "eps")
        in_range(self, 0.0, 1.0, "beta1", "beta2")
        at_least(self, 0, "weight_decay", "warmup_steps")
        positive(self, "grad_clip_norm")


@dataclass(frozen=True)
class LossConfig:
    """Overrides of the model config's entailment term; `null` keeps the model's value.

    `K_start`/`K_end` set EuCLIP's schedule: K moves linearly from K_start to K_end over training.
    """

    entailment_weight: float | None = None
    entailment_K: float | None = None
    K_start: float | None = None
    K_end: float | None = None

    def __post_init__(self) -> None:
        at_least(self, 0, "entailment_weight")
        positive(self, "entailment_K", "K_start", "K_end")
        if (self.K_start is None) != (self.K_end is None):
            raise ConfigError("K_start", "set both K_start and K_end for a K schedule, or neither")
        if self.K_start is not None and self.entailment_K is not None:
            raise ConfigError(
                "entailment_K", "a constant entailment_K conflicts with the K_start/K_end schedule"
            )


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 1000  # periodic checkpoints (0: only the final one)
    keep: int = 2  # periodic checkpoints kept on disk (the newest); the final one is always kept

    def __post_init__(self) -> None:
        at_least(self, 0, "every_steps")
        at_least(self, 1, "keep")


@dataclass(frozen=True)
class TrainConfig:
    name: str = ""
    description: str = ""
    model: Any = "tiny-clip"  # model config name, YAML path, or an inline mapping
    # Weights to start from (--init): a hype checkpoint or an open_clip model file/folder whose towers have
    # the model config's architecture; ignored when a run resumes (its checkpoint has newer weights).
    init: str | None = None
    samples_seen: int = 128_000  # total training samples (DataComp: fixed whatever the subset)
    batch_size: int = 256  # global batch over all ranks and accumulation steps
    accum_steps: int = 1  # gradient accumulation: micro-batch = batch_size / (ranks * accum_steps)
    precision: str = "fp32"  # fp32 | bf16 | fp16 (autocast for the towers; geometry and loss in fp32)
    device: str = "auto"  # auto (cuda if available) | cpu | cuda
    seed: int = 0
    # torch's CPU threads (None: its default, one per core). CPU reductions split work by thread count, so
    # two runs give identical weights only with the same count: fix it to compare machines.
    threads: int | None = None
    out: str | None = None  # output folder [default: runs/train/<name>]
    log_every_steps: int = 10
    grad_checkpointing: bool = False
    max_steps: int | None = None  # stop after this step; the schedule still spans samples_seen
    debug_nan_at_step: int | None = None  # test hook: the loss becomes NaN at this step
    data: DataConfig = field(default_factory=DataConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    hycoclip: HyCoCLIPConfig = field(default_factory=HyCoCLIPConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, dict)):
            raise ConfigError(
                "model", f"must be a model config name, a path or a mapping, got {self.model!r}"
            )
        at_least(self, 1, "samples_seen", "batch_size", "accum_steps", "log_every_steps")
        if self.samples_seen < self.batch_size:
            raise ConfigError(
                "samples_seen", f"{self.samples_seen} is less than one batch ({self.batch_size}); raise it"
            )
        one_of(self, "precision", PRECISIONS)
        if self.device != "auto" and not self.device.startswith(("cpu", "cuda", "mps")):
            raise ConfigError("device", f"must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        at_least(self, 1, "max_steps", "debug_nan_at_step", "threads")
        if self.hycoclip.enabled and self.accum_steps > 1:
            # The step stacks wholes and boxes into one forward pass; micro-batches would split that stack.
            raise ConfigError(
                "accum_steps", "HyCoCLIP training takes accum_steps=1; lower batch_size instead"
            )

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole schedule: floor(samples_seen / batch_size)."""
        return self.samples_seen // self.batch_size

    def model_config(self) -> ModelConfig:
        return load_model_config(self.model)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data; without the `sampler` and `hycoclip` sections while they are the
        defaults, so a run's config.yaml, state and recipe fingerprint read as before they existed."""
        d = to_dict(self)
        for name, default in (("sampler", SamplerConfig()), ("hycoclip", HyCoCLIPConfig())):
            if getattr(self, name) == default:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<dict>") -> TrainConfig:
        return build(cls, data, source=source)


# --- presets, files and overrides (the shared machinery is hype.config) ----------------------------


def list_train_configs() -> list[str]:
    return list_presets("train")


def resolve_config_path(config: str | PathLike) -> Path:
    """A YAML path as given, or a preset name -> `configs/train/<name>.yaml`."""
    return resolve_preset("train", config, "training")


def load_train_config(config: str | PathLike | dict, overrides: list[str] | None = None) -> TrainConfig:
    """Read a preset name, a YAML path or a dict, apply `key=value` overrides, validate."""
    return load(TrainConfig, "train", config, overrides, what="training", override=apply_override)


def apply_override(data: dict, item: str, root: type | None = None) -> None:
    """`hype.config.apply_override` with `root` defaulting to TrainConfig, where `model.*` overrides edit
    the model config the preset names (validated against ModelConfig)."""
    root = TrainConfig if root is None else root
    if root is TrainConfig:
        path, value = parse_override(item)
        if path[0] == "model" and len(path) > 1:
            _override_model(data, path[1:], value, item)
            return
    _apply_override(data, item, root)


def _override_model(data: dict, path: list[str], value: Any, item: str) -> None:
    model = data.get("model", TrainConfig.model)
    if not isinstance(model, dict):
        # Start from the model config the preset names; validation happens when the model is built.
        model = load_model_config(model).to_dict()
    set_path(model, path, value)
    data["model"] = model
    try:
        ModelConfig.from_dict(model, "override")
    except ConfigError as e:
        raise ConfigError(f"model.{e.key}", e.message, f"override {item!r}") from None
