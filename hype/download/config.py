"""`hype download` configuration: YAML presets under `configs/download/` -> a validated, frozen dataclass.

    hype download --metadata pool/metadata --out pool/shards img2dataset.thread_count=64 img2dataset.retries=0

The `img2dataset` section holds keyword arguments of `img2dataset.download` under their own names and is
passed through as is; the settings hype depends on (parquet input, `uid`/`url`/`text` columns, `uid` in
each sample's json, webdataset output, incremental resume) are fixed in `hype.download.run`, not here.
Overrides and validation are the shared `hype.config` machinery; every mistake is a `ConfigError` naming
the file (or `override`) and the dotted key.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass, field
from os import PathLike
from typing import Any

from hype.config import (
    ConfigError,
    at_least,
    build,
    list_presets,
    load,
    one_of,
    positive,
    to_dict,
)

DISTRIBUTORS = ("multiprocessing", "ray")
RESIZE_MODES = ("no", "border", "keep_ratio", "keep_ratio_largest", "center_crop")
ENCODE_FORMATS = ("jpg", "png", "webp")
HASHES = ("md5", "sha256", "sha512")


@dataclass(frozen=True)
class Img2DatasetConfig:
    """Keyword arguments of `img2dataset.download` (same names; DataComp's values by default)."""

    processes_count: int = 16  # --processes: download processes (multiprocessing distributor)
    thread_count: int = 128  # --threads: concurrent downloads per process
    image_size: int = 512  # --image-size
    resize_mode: str = "keep_ratio_largest"  # --resize-mode
    resize_only_if_bigger: bool = True
    encode_format: str = "jpg"
    encode_quality: int = 95
    skip_reencode: bool = False
    number_sample_per_shard: int = 10_000
    oom_shard_count: int = 8  # digits of shard names: 00000000.tar
    retries: int = 2  # --retries: extra attempts per url
    timeout: float = 10.0  # --timeout: seconds per request
    compute_hash: str | None = "sha256"  # hash of the downloaded bytes, stored in each sample's json
    bbox_col: str | None = "face_bboxes"  # blur these boxes (DataComp's faces) when the metadata has them
    min_image_size: int = 0
    max_image_area: float | None = None  # null: no limit
    max_aspect_ratio: float | None = None  # null: no limit
    max_shard_retry: int = 1  # rounds of retrying shards that raised
    user_agent_token: str | None = None
    enable_wandb: bool = False
    wandb_project: str = "img2dataset"

    def __post_init__(self) -> None:
        at_least(self, 1, "processes_count", "thread_count", "image_size", "oom_shard_count")
        at_least(self, 2, "number_sample_per_shard")  # img2dataset takes log10 of it for the key width
        at_least(self, 0, "retries", "min_image_size", "max_shard_retry")
        at_least(self, 1, "encode_quality")
        one_of(self, "resize_mode", RESIZE_MODES)
        one_of(self, "encode_format", ENCODE_FORMATS)
        one_of(self, "compute_hash", HASHES)
        positive(self, "timeout")
        for name in ("max_image_area", "max_aspect_ratio"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(name, f"must be > 0 or null, got {value!r}")

    def kwargs(self) -> dict[str, Any]:
        """Arguments for `img2dataset.download` (null limits become its infinite defaults)."""
        out = dataclasses.asdict(self)
        for name in ("max_image_area", "max_aspect_ratio"):
            if out[name] is None:
                out[name] = float("inf")
        return out


@dataclass(frozen=True)
class DownloadConfig:
    name: str = ""
    description: str = ""
    metadata: str | None = None  # --metadata: a folder of DataComp metadata parquet files, or one file
    out: str | None = None  # --out: the shard folder (created; a rerun resumes it)
    distributor: str = "multiprocessing"  # --distributor multiprocessing | ray
    ray_address: str | None = None  # --ray-address host:port | auto; null starts a local Ray
    allow_private_network: bool = False  # --allow-private-network: loopback/private/link-local targets
    allowed_networks: str | None = None  # comma-separated CIDRs reachable anyway (an internal mirror)
    progress: bool = True
    img2dataset: Img2DatasetConfig = field(default_factory=Img2DatasetConfig)

    def __post_init__(self) -> None:
        one_of(self, "distributor", DISTRIBUTORS)
        for net in self.networks():
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ConfigError("allowed_networks", f"{net!r} is not a CIDR like 10.1.0.0/16") from None

    def networks(self) -> tuple[str, ...]:
        return tuple(n.strip() for n in (self.allowed_networks or "").split(",") if n.strip())

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<dict>") -> DownloadConfig:
        return build(cls, data, source=source)


def list_download_configs() -> list[str]:
    return list_presets("download")


def load_download_config(
    config: str | PathLike | dict | None = None, overrides: list[str] | None = None
) -> DownloadConfig:
    """A preset name (`configs/download/NAME.yaml`, default `datacomp`), a YAML path or a dict, with
    `key=value` overrides applied, validated."""
    return load(DownloadConfig, "download", config, overrides, default="datacomp")
