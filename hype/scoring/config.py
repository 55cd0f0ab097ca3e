"""`hype score` configuration: YAML presets under `configs/score/` -> a validated, frozen dataclass.

    hype score --pool pool/shards --meru meru.safetensors --clip clip.safetensors --out runs/score \
        reference.n_top=5000 clusters.num_clusters=1000 executor.workers=4

Command-line options fill the same fields as `key=value` overrides (`--hinge` is
`specificity.hinge=true`, `--executor ray` is `executor.kind=ray`, ...); values are parsed as YAML.
Every mistake is a `ConfigError` naming the file (or `override`) and the dotted key.

Settings fall in two groups. Those that change the scores (models, reference sizes, hinge, K, clusters,
caption filter, JPEG draft decoding, the precision as resolved: `auto` is bf16 on a GPU and fp32 on a
CPU, and under bf16/fp16 the device kind) enter the fingerprints of the stage outputs they affect, so a
rerun with a different value recomputes exactly those stages and reuses the rest. Run settings
(executor, workers, the device in fp32, batch size, threads, progress) may change between reruns freely:
they change results only at float rounding.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

import yaml

from hype.config import (
    ConfigError,
    at_least,
    build,
    list_presets,
    load,
    one_of,
    parse_override,
    positive,
    to_dict,
)
from hype.executor import ExecutorConfig
from hype.scoring.clusters import BACKENDS

PRECISIONS = ("auto", "fp32", "bf16", "fp16")


@dataclass(frozen=True)
class EmbedConfig:
    decode: str = "processes"  # decode workers: processes (no GIL contention with the model) | threads
    decode_workers: int = 0  # decode workers per embedding worker (0: the CPUs this worker may use)
    prefetch_batches: int = 2  # batches decoded ahead of the model
    jpeg_draft: bool = True  # decode JPEGs >= 4x the model input at a reduced DCT scale (faster, ~same)
    clip_txt: bool = False  # also store the CLIP text embedding (`--rank negclip`); off: runs as before

    def __post_init__(self) -> None:
        one_of(self, "decode", ("processes", "threads"))
        at_least(self, 0, "decode_workers")
        at_least(self, 1, "prefetch_batches")


@dataclass(frozen=True)
class ReferenceConfig:
    """Reference sets S_i / S_t (HYPE §3.3): selected from the pool, or read from `file`."""

    file: str | None = None  # hype .safetensors or HYPE's released {"img", "txt"} .pt (--reference)
    n_top: int = 20_000  # N: pairs with the highest cos θ
    m: int = 20_000  # M: images / texts with the highest mean L_e against those N
    hinge: bool = True  # the paper selects by the hinged L_e = max(0, E)

    def __post_init__(self) -> None:
        at_least(self, 1, "n_top", "m")


@dataclass(frozen=True)
class SpecificityConfig:
    hinge: bool = False  # False: raw energy E (HYPE's released code); True: the paper's L_e (--hinge)
    K: float | None = None  # cone constant; null: the MERU model's entailment K
    budget_elems: int = 1 << 24  # a chunk's working set in elements (GPU: one rows x M block); not results

    def __post_init__(self) -> None:
        positive(self, "K")
        at_least(self, 1024, "budget_elems")


@dataclass(frozen=True)
class ClustersConfig:
    """c_IN (DataComp's image-based clustering, DESIGN §2.4)."""

    class_features: str | None = None  # (N, d) CLIP image features: .npy or .safetensors
    class_images: str | None = None  # webdataset tars of labelled images, embedded with --clip
    centroids: str | None = None  # --centroids: given centroids instead of k-means (.npy, .pt, faiss)
    num_clusters: int | None = None  # K; null: default_num_clusters(pool size); unused with centroids
    niter: int = 20
    seed: int = 0
    points_per_centroid: int = 256  # k-means trains on at most this many points per centroid
    max_train_points: int | None = None  # optional hard cap on k-means training points (memory)
    gpu: bool = False  # faiss-gpu k-means (GPU nodes with faiss-gpu installed)
    # faiss (CPU, DataComp's tool) | torch: k-means and assignments on the run's device (a GPU: minutes
    # instead of hours at K = 100,000; other centroids than faiss's, so c_IN differs from a faiss run)
    backend: str = "faiss"
    caption_filter: bool = True  # DataComp's baseline also requires English, > 1 word, > 5 chars

    def __post_init__(self) -> None:
        if self.class_features is not None and self.class_images is not None:
            raise ConfigError("class_features", "give class_features or class_images, not both")
        at_least(self, 1, "num_clusters", "niter", "points_per_centroid", "max_train_points")
        if self.backend not in BACKENDS:
            raise ConfigError("backend", f"must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        if self.gpu and self.backend != "faiss":
            raise ConfigError(
                "gpu", "faiss-gpu's switch, unused by clusters.backend=torch (the run's device): drop one"
            )


@dataclass(frozen=True)
class NeardupConfig:
    """Near-duplicate images (hype.scoring.stage_neardup): groups of CLIP image features within k-means
    clusters whose cosine similarity is >= threshold, one keeper per group."""

    enabled: bool = False  # --neardup
    threshold: float = 0.9  # cosine of CLIP image features; `hype select --filter dedup` may only raise it
    copy_check: bool = True  # a pair joins a group only if the pixel copy check confirms it (copydetect)
    candidates: int = 10  # with copy_check: each row's nearest rows (cosine >= threshold) checked
    pixel_candidates: int = 10  # with copy_check: and its nearest of those by pixel descriptor (0: none)
    assign: int = 2  # clusters each row is searched in: its nearest (1) or its 2 or 3 nearest (SemDeDup's)
    # with copy_check: copy similarity at or above which a pair is a copy (`stage_neardup.copy_check`). 0.92
    # since its third search: the highest at which copies found are >= 0.95 on both synthetic worlds, with
    # fewer missed copies and other samples grouped than 0.925 before it; kept with 128-px work images, the
    # highest at which the test world's defaults find >= 0.8 of its copies (0.94 finds >= 0.95 on both
    # benchmark worlds with 1.98% / 1.42% others; bench/RESULTS.md)
    copy_threshold: float = 0.92
    keeper: str = "hype"  # hype (highest HYPE score) | semdedup (farthest from its centroid) | random
    seed: int = 0  # of the random keeper
    # pixel: the search's clusters are k-means of the pixel descriptors (a copy and its source share one
    # whatever the CLIP; needs copy_check's work images) | clip: of the CLIP image features (as before);
    # null: pixel with copy_check, else clip
    partition: str | None = None
    reuse_clusters: bool = True  # partition=clip: c_IN's k-means when it ran; else k-means of its own
    num_clusters: int | None = None  # own k-means K; null: default_num_clusters(pool size)
    max_cluster: int = 1_000_000  # rows of one cluster searched at once (its features are in memory)
    # rows per unit of work (clusters grouped: features and the copy check's work images in memory): 1M
    # before the 128-px work images (48 KiB, 4x); 250k keeps a group's images at the same ~24 GiB at most
    rows_per_group: int = 250_000
    pairs_per_block: int = 1 << 24  # pairs of one range-search block held at once

    def __post_init__(self) -> None:
        from hype.scoring.neardup import KEEPERS

        one_of(self, "keeper", KEEPERS)
        if not 0 < self.threshold <= 1:
            raise ConfigError("threshold", f"must be in (0, 1] (a cosine similarity); got {self.threshold}")
        if not -1.0 <= self.copy_threshold <= 1.0:
            raise ConfigError("copy_threshold", f"a copy similarity in [-1, 1]; got {self.copy_threshold}")
        at_least(self, 1, "num_clusters", "candidates")
        at_least(self, 0, "pixel_candidates")
        if self.assign not in (1, 2, 3):
            raise ConfigError("assign", f"1, 2 or 3 (clusters each row is searched in); got {self.assign}")
        at_least(self, 2, "max_cluster")
        at_least(self, 1, "rows_per_group", "pairs_per_block")
        one_of(self, "partition", ("pixel", "clip"))
        if self.partition == "pixel" and not self.copy_check:
            raise ConfigError(
                "partition",
                "pixel clusters need the copy check's work images: set neardup.copy_check=true or "
                "neardup.partition=clip",
            )

    @property
    def pixel_partition(self) -> bool:
        """Whether the search's clusters are k-means of the pixel descriptors (the `partition` in effect)."""
        return (self.partition or ("pixel" if self.copy_check else "clip")) == "pixel"


@dataclass(frozen=True)
class MetadataConfig:
    """DataComp pool metadata: `<hash>.parquet` lists the pool's uids; with the row-aligned `<hash>.npz`
    it is also the source of cos θ and the CLIP image features for c_IN (without the .npz, --clip computes
    them; see `hype.scoring.metadata`). MERU always embeds the images of the shards."""

    dir: str | None = None  # --metadata
    score_column: str = "clip_l14_similarity_score"  # cos θ, when the .npz are there
    features_key: str = "l14_img"  # CLIP image features in the .npz


@dataclass(frozen=True)
class DecontamConfig:
    """--decontaminate: flag pool samples whose image is a copy of an evaluation image
    (`hype.scoring.stage_decontam`): the `candidates` CLIP nearest neighbours of each task at cosine >=
    `threshold` are checked from pixels (`hype.scoring.copydetect`) and a copy similarity >= `copy_threshold`
    is a match; with `copy_check` off, the nearest image at cosine >= `threshold` is (DataComp's way)."""

    eval_dir: str | None = (
        None  # --decontaminate EVAL_DIR: the DataComp task folders, or one webdataset folder
    )
    threshold: float = 0.9  # CLIP cosine of a candidate (the decontaminate filter may only raise it)
    candidates: int = 30  # nearest evaluation images per task and pool sample checked by the copy check
    copy_check: bool = True  # --copy-check/--no-copy-check: verify candidates from pixels
    copy_threshold: float = 0.94  # --copy-threshold: copy similarity at or above which a candidate is a copy

    def __post_init__(self) -> None:
        if not -1.0 <= self.threshold <= 1.0:
            raise ConfigError("threshold", f"a cosine similarity in [-1, 1]; got {self.threshold}")
        if not -1.0 <= self.copy_threshold <= 1.0:
            raise ConfigError("copy_threshold", f"a copy similarity in [-1, 1]; got {self.copy_threshold}")
        at_least(self, 1, "candidates")


@dataclass(frozen=True)
class DebugConfig:
    """Test hooks: make a worker hold a shard so that a test can kill it mid-shard."""

    pid_dir: str | None = None  # a worker writes <pid_dir>/<stage>-<shard id>.pid when it starts a shard
    hold_s: float = 0.0  # ... then waits this long before processing it, or until <pid_dir>/release
    # (every shard) or <pid_dir>/<stage>-<shard id>.release (this one) exists
    stage: str = "embed"  # the stage the hooks apply to


@dataclass(frozen=True)
class ScoreConfig:
    name: str = ""
    description: str = ""
    pool: str | None = None  # DIR_OR_PATTERN of the pool's webdataset shards (--pool)
    meru: str | None = None  # hype checkpoint of the MERU scorer (--meru)
    clip: str | None = None  # hype checkpoint of the CLIP scorer (--clip); optional with .npz metadata
    out: str | None = None  # run directory (--out)
    device: str = "auto"  # auto (cuda when available) | cpu | cuda | cuda:N
    precision: str = "auto"  # towers under autocast: auto = bf16 on cuda, fp32 on cpu
    batch_size: int = 256
    threads: int = 0  # torch threads per worker (0: torch's default; Ray: the actor's CPUs)
    progress: bool = True
    embed: EmbedConfig = field(default_factory=EmbedConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    specificity: SpecificityConfig = field(default_factory=SpecificityConfig)
    clusters: ClustersConfig = field(default_factory=ClustersConfig)
    metadata: MetadataConfig = field(default_factory=MetadataConfig)
    decontam: DecontamConfig = field(default_factory=DecontamConfig)
    neardup: NeardupConfig = field(default_factory=NeardupConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def __post_init__(self) -> None:
        at_least(self, 1, "batch_size")
        at_least(self, 0, "threads")
        if self.device != "auto" and not self.device.startswith(("cpu", "cuda")):
            raise ConfigError("device", f"must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        one_of(self, "precision", PRECISIONS)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self) | {"executor": self.executor.to_dict()}  # flat, as written

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def recorded(self) -> ScoreConfig:
        """What a run directory's config.yaml records: every local location absolute (URLs as given), so
        that `hype score --config RUN/config.yaml` scores the same pool from any folder. The run itself
        keeps the pool as given: the scores table's `shard` column holds the paths as given."""
        from hype.data.shards import absolute_spec

        def spec(value: str | None) -> str | None:
            return None if value is None else absolute_spec(value)

        return dataclasses.replace(
            self,
            pool=spec(self.pool),
            clusters=dataclasses.replace(self.clusters, class_images=spec(self.clusters.class_images)),
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<dict>") -> ScoreConfig:
        return build(cls, data, source=source)

    def check_inputs(self) -> None:
        """The settings a run needs, with the option that provides each."""
        missing = [
            opt
            for opt, value in (("--pool", self.pool), ("--meru", self.meru), ("--out", self.out))
            if value is None
        ]
        if missing:
            raise ConfigError("", f"missing {', '.join(missing)} (or set them in the config)")
        if self.clip is None and self.metadata.dir is None:
            raise ConfigError(
                "clip",
                "cos θ needs a CLIP scorer: pass --clip CKPT, or --metadata DIR with DataComp metadata "
                "(.parquet + .npz)",
            )
        cc = self.clusters
        if cc.centroids is not None and cc.class_features is None and cc.class_images is None:
            raise ConfigError(
                "clusters.centroids",
                "--centroids needs the reference-class features that pick the target clusters: pass "
                "--class-features FILE (DataComp: ImageNet-1k train, ViT-L/14) or --class-images",
            )
        if self.decontam.eval_dir is not None and self.clip is None:
            raise ConfigError(
                "decontam.eval_dir",
                "--decontaminate embeds the evaluation images with the pool's CLIP image tower: pass --clip "
                "(the CLIP model that made the pool's features)",
            )
        if self.clusters.class_images is not None and self.clip is None:
            raise ConfigError(
                "clusters.class_images",
                "embedding class images needs --clip (the CLIP that made the metadata features), or pass "
                "precomputed features with --class-features",
            )


def list_score_configs() -> list[str]:
    return list_presets("score")


def load_score_config(config: str | PathLike | dict | None = None, overrides: list[str] | None = None):
    """A preset name (`configs/score/NAME.yaml`, default `default`), a YAML path or a dict, with `key=value`
    overrides applied, validated. A run directory's own config.yaml scores that run directory (see
    `_own_run`)."""
    cfg = load(ScoreConfig, "score", config, overrides, default="default")
    return _own_run(cfg, config, overrides or [])


def _own_run(cfg: ScoreConfig, config: str | PathLike | dict | None, overrides: list[str]) -> ScoreConfig:
    """`--config RUN/config.yaml` (beside RUN's summary.json) means `--out RUN`, unless `out` is given on
    the command line: the `out` it records names the folder a copied run was copied from, whose scores a
    rescore of the copy must not replace."""
    if not isinstance(config, (str, PathLike)) or any(parse_override(o)[0] == ["out"] for o in overrides):
        return cfg
    path = Path(config)
    if path.name != "config.yaml" or not (path.parent / "summary.json").is_file():
        return cfg
    own = str(path.parent.expanduser().resolve())
    if cfg.out != own:
        logging.getLogger("hype.score").warning(
            "%s: records out=%s; scoring the run directory it is in, %s (pass --out to choose another)",
            path,
            cfg.out,
            own,
        )
    return dataclasses.replace(cfg, out=own)
