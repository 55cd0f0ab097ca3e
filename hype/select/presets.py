"""Selection presets: YAML files under `configs/select/` (or any YAML path), overridable from the CLI.

A preset names a ranking rule and its parameters and, optionally, filters:

    description: HYPE without c_IN (Table 3, second row)
    rank: hype                # a rule spec: hype | clip_score | specificity | random[:seed=N]
    weights: {eps_i: 1, eps_t: 1, neg_d_l: 1, cos_theta: 1}   # hype only; unnamed metrics get 0
    normalize: none           # none | zscore | rank
    filters: [basic:min_side=64]                              # optional mask rules
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hype.config import config_dir as config_root  # noqa: F401 (public here: `$HYPE_CONFIG_DIR` or configs/)
from hype.config import list_presets as _list_presets
from hype.config import preset_dir
from hype.select.combine import NORMALIZATIONS, parse_weights
from hype.select.errors import SelectError

DEFAULT_PRESET = "hype"
_KEYS = {"description", "rank", "weights", "normalize", "filters"}


def presets_dir() -> Path:
    return preset_dir("select")


def list_presets() -> list[str]:
    return _list_presets("select")


@dataclass(frozen=True)
class Preset:
    name: str
    description: str = ""
    rank: str = "hype"
    weights: dict[str, float] | None = None
    normalize: str = "none"
    filters: list[str] = field(default_factory=list)


def load_preset(name_or_path: str | os.PathLike) -> Preset:
    text = os.fspath(name_or_path)
    path = Path(text)
    if path.suffix not in (".yaml", ".yml") and not path.is_file():
        path = presets_dir() / f"{text}.yaml"
        if not path.is_file():
            raise SelectError(
                f"--preset {text!r}: no such preset; presets: {', '.join(list_presets()) or '(none)'} "
                "(or pass a YAML file)"
            )
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SelectError(f"{path}: cannot read the preset ({e})") from None
    if not isinstance(raw, dict):
        raise SelectError(f"{path}: a preset is a YAML mapping with keys {', '.join(sorted(_KEYS))}")
    unknown = set(raw) - _KEYS
    if unknown:
        raise SelectError(
            f"{path}: unknown key(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(_KEYS))}"
        )
    weights = raw.get("weights")
    if weights is not None:
        if not isinstance(weights, dict):
            raise SelectError(f"{path}: 'weights' must be a mapping metric -> weight")
        try:
            weights = parse_weights(weights)
        except SelectError as e:
            raise SelectError(f"{path}: {e}") from None
    normalize = str(raw.get("normalize", "none"))
    if normalize not in NORMALIZATIONS:
        raise SelectError(f"{path}: normalize {normalize!r} is not one of {', '.join(NORMALIZATIONS)}")
    filters = raw.get("filters") or []
    if not isinstance(filters, list):
        raise SelectError(f"{path}: 'filters' must be a list of rule specs, e.g. [basic, image_cluster]")
    return Preset(
        name=path.stem if path.parent == presets_dir() else str(path),
        description=str(raw.get("description", "")),
        rank=str(raw.get("rank", "hype")),
        weights=weights,
        normalize=normalize,
        filters=[_filter_spec(f, path) for f in filters],
    )


def _filter_spec(entry: Any, path: Path) -> str:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and len(entry) == 1:
        ((name, params),) = entry.items()
        if params is None:
            return str(name)
        if isinstance(params, dict):
            return f"{name}:" + ",".join(f"{k}={v}" for k, v in params.items())
    raise SelectError(f"{path}: filter entry {entry!r} must be a spec string or {{name: {{param: value}}}}")
