"""The config concept, in one light place (stdlib + yaml only: importing it never imports torch).

- Where presets live: `<configs>/<kind>/<name>.yaml`, where `<configs>` is `$HYPE_CONFIG_DIR` (read at
  call time) or the repository's `configs/` folder; `kind` is `models`, `train`, `score`, `download`,
  `select`, `eval`, ...
- Reading one: `read_config(kind, config, default)` takes a preset name, a YAML path or a dict.
- `key=value` overrides with dotted keys (`apply_override`), values parsed as YAML.
- dict -> frozen dataclass with type checks (`build`), and the small validators the dataclasses use.

Every mistake is a `ConfigError` (a `ValueError`) naming the file (or `override`) and the dotted key.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import types
import typing
from os import PathLike
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A bad config; `key` is the dotted path of the offending entry."""

    def __init__(self, key: str, message: str, source: str | None = None):
        self.key, self.message, self.source = key, message, source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{key}: {message}" if key else f"{where}{message}")

    def within(self, prefix: str) -> ConfigError:
        return ConfigError(f"{prefix}.{self.key}" if self.key else prefix, self.message, self.source)

    def from_source(self, source: str) -> ConfigError:
        return ConfigError(self.key, self.message, source)


# --- where configs live ---------------------------------------------------------------------------


def config_dir() -> Path:
    """The folder of all presets: `$HYPE_CONFIG_DIR` or the repository's `configs/`."""
    env = os.environ.get("HYPE_CONFIG_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "configs"


def preset_dir(kind: str) -> Path:
    """`<configs>/<kind>`, e.g. `configs/train`."""
    return config_dir() / kind


def list_presets(kind: str) -> list[str]:
    """The preset names of `kind` (YAML stems), sorted; empty when the folder is missing."""
    folder = preset_dir(kind)
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def resolve_preset(kind: str, config: str | PathLike, what: str | None = None) -> Path:
    """A YAML path as given, or a preset name -> `<configs>/<kind>/<name>.yaml`; `what` names the kind in
    messages (`training` -> "unknown training preset 'x'; available: ...")."""
    what = what or kind
    path = Path(config)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise ConfigError("", f"{what} config file not found", str(path))
        return path
    named = preset_dir(kind) / f"{config}.yaml"
    if not named.is_file():
        available = ", ".join(list_presets(kind)) or "(none)"
        raise ConfigError("", f"unknown {what} preset {str(config)!r}; available: {available}")
    return named


def read_config(
    kind: str, config: str | PathLike | dict | None, default: str | None = None, what: str | None = None
) -> tuple[dict, str]:
    """(raw mapping, source) of a preset name (`default` when none is given), a YAML path or a dict
    (copied). A file's mapping gets `name: <file stem>` unless it sets one."""
    if isinstance(config, dict):
        return copy.deepcopy(config), "<dict>"
    if not config:  # None or ""
        if default is None:
            available = ", ".join(list_presets(kind)) or "(none)"
            raise ConfigError("", f"no {what or kind} config given; available: {available}")
        config = default
    path = resolve_preset(kind, config, what)
    source = str(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError("", f"not valid YAML ({e})", source) from None
    if not isinstance(data, dict):
        raise ConfigError("", f"must be a mapping, got {type(data).__name__}", source)
    data.setdefault("name", path.stem)
    return data, source


# --- key=value overrides --------------------------------------------------------------------------


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value parsed as YAML; text that is not YAML stays text)."""
    if "=" not in item:
        raise ConfigError("", f"override {item!r} is not key=value (e.g. optim.lr=1e-3)", "override")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError("", f"override {item!r} has an empty key", "override")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw  # not YAML: keep the text (e.g. a caption template with ': ' inside)
    return key.split("."), value


def apply_override(data: dict, item: str, root: type) -> None:
    """Set a dotted key in the raw config dict of dataclass `root`. Unknown keys raise with the valid ones
    listed; a text field keeps the text as typed (`{caption}` would read as a YAML mapping); sections
    are the fields typed as dataclasses (or `X | None`)."""
    path, value = parse_override(item)
    cls: Any = root
    node = data
    for depth, part in enumerate(path):
        valid = [f.name for f in dataclasses.fields(cls)]
        if part not in valid:
            where = ".".join(path[:depth]) or "the top level"
            raise ConfigError(
                ".".join(path[: depth + 1]),
                f"unknown key; valid keys in {where}: {', '.join(valid)}",
                "override",
            )
        hint = typing.get_type_hints(cls)[part]
        if depth == len(path) - 1:
            if _is_text(hint) and not (value is None or isinstance(value, str)):
                value = item.split("=", 1)[1].strip()
            node[part] = value
            return
        sub = _dataclass_of(hint)
        if sub is None:
            raise ConfigError(".".join(path[: depth + 1]), "is not a section; set it directly", "override")
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node, cls = node[part], sub


def _is_text(tp: Any) -> bool:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return str in typing.get_args(tp)
    return tp is str


def _dataclass_of(tp: Any) -> type | None:
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if dataclasses.is_dataclass(arg):
                return arg
    return None


# --- dict -> dataclass with type checks -----------------------------------------------------------


def build(cls: type, data: Any, key: str = "") -> Any:
    """An instance of dataclass `cls` from a raw mapping: unknown keys listed, values type-checked (ints
    from integral floats, floats from numeric text), sections built recursively; errors carry `key`."""
    if not isinstance(data, dict):
        raise ConfigError(key, f"must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in valid]
    if unknown:
        where = f"{key}." if key else ""
        raise ConfigError(
            ", ".join(where + str(k) for k in unknown),
            f"unknown key; valid keys{f' in {key}' if key else ''}: {', '.join(valid)}",
        )
    kwargs = {
        name: _coerce(value, hints[name], f"{key}.{name}" if key else name) for name, value in data.items()
    }
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise (e.within(key) if key else e) from None


def _coerce(value: Any, tp: Any, key: str) -> Any:
    if tp is Any:
        return value
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _coerce(value, inner, key)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            value = int(value)  # `samples_seen: 12.8e6` reads as a float
        if isinstance(value, str):
            try:
                value = int(float(value)) if float(value).is_integer() else value
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML reads `1e-5` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(key, f"must be a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(key, f"must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config field type {tp!r} for {key}")


# --- validators for __post_init__ (None means unset and passes) ------------------------------------


def at_least(obj: Any, low: float, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and not value >= low:
            raise ConfigError(name, f"must be >= {low}, got {value!r}")


def positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and not value > 0:
            raise ConfigError(name, f"must be > 0, got {value!r}")


def one_of(obj: Any, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    if value is not None and value not in choices:
        raise ConfigError(name, f"must be one of {', '.join(choices)}; got {value!r}")
