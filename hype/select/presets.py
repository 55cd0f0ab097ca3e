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

from hype.config import ConfigError, build, one_of, preset_path, read_yaml
from hype.config import list_presets as _list_presets
from hype.select.errors import SelectError
from hype.table.combine import NORMALIZATIONS, parse_weights

DEFAULT_PRESET = "hype"


def list_presets() -> list[str]:
    return _list_presets("select")


@dataclass(frozen=True)
class Preset:
    """A selection preset (the schema of its YAML file; `name` defaults to the file's stem)."""

    name: str
    description: str = ""
    rank: str = "hype"
    weights: dict[str, Any] | None = None  # metric -> weight; becomes all of METRICS, unnamed ones 0
    normalize: str = "none"
    filters: list[Any] = field(default_factory=list)  # rule specs or {name: {param: value}}; become specs

    def __post_init__(self) -> None:
        if self.weights is not None:
            try:
                object.__setattr__(self, "weights", parse_weights(self.weights))
            except SelectError as e:
                raise ConfigError("weights", str(e).removeprefix("--weights: ")) from None
        one_of(self, "normalize", NORMALIZATIONS)
        object.__setattr__(self, "filters", [_filter_spec(f) for f in self.filters])


def load_preset(name_or_path: str | os.PathLike) -> Preset:
    text = os.fspath(name_or_path)
    path = Path(text)
    name = str(path)  # a YAML file is named by its path, a preset by its name
    if path.suffix not in (".yaml", ".yml") and not path.is_file():
        name, path = text, preset_path("select", text)
        if path is None:
            raise SelectError(
                f"--preset {text!r}: no such preset; presets: {', '.join(list_presets()) or '(none)'} "
                "(or pass a YAML file)"
            )
    try:
        data = read_yaml(path)
        data.setdefault("name", name)
        return build(Preset, data, source=str(path))
    except ConfigError as e:
        raise SelectError(str(e)) from None  # `hype select` reports SelectErrors; the message stays as is
    except OSError as e:
        raise SelectError(f"{path}: cannot read the preset ({e})") from None


def _filter_spec(entry: Any) -> str:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and len(entry) == 1:
        ((name, params),) = entry.items()
        if params is None:
            return str(name)
        if isinstance(params, dict):
            return f"{name}:" + ",".join(f"{k}={v}" for k, v in params.items())
    raise ConfigError("filters", f"entry {entry!r} must be a rule spec string or {{name: {{param: value}}}}")
