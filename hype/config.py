"""The one config mechanism, in one light place (stdlib + yaml only: importing it never imports torch).

Every configurable thing (score, train, download, select presets, eval suites, model configs and rule
parameters) is declared the same way and read through the same functions:

- Schema: a frozen dataclass whose type hints are the types (`int`, `float`, `str`, `bool`, `X | None`,
  `tuple[T, ...]`, `list[T]`, `dict[str, T]`, `Any`, nested dataclasses as sections); ranges, choices and
  cross-field rules live in `__post_init__`, written with the validators at the end of this module.
- Where presets live: `<configs>/<kind>/<name>.yaml`, looked up in the folders of `$HYPE_CONFIG_DIR`
  (read at call time), then those added with `add_config_dir`, then the presets packaged with hype
  (`hype/configs/`, the repository's `configs/`); `kind` is `models`, `train`, `score`, `download`,
  `select`, `eval`, `workflows`. `resolve_preset` and `list_presets` are the one place that finds them.
- Reading one: `read_config(kind, config, default)` takes a preset name, a YAML path or a dict;
  `read_yaml(path)` reads one file; `parse_yaml` is the one YAML parser (aliases refused).
- `key=value` overrides with dotted keys (`apply_override`), values parsed as YAML (`parse_value`).
- dict -> schema instance with type checks (`build`; `exact_ints` for schemas that refuse `2.0` as an
  int); `load` is read + overrides + build in one call.

Every mistake is a `ConfigError` (a `ValueError`) naming the file (or `override`), the dotted key and the
fix: `<source>: <key>: <message>`. Pydantic was measured as the alternative and left out: importing it
costs ~200 ms against ~35 ms here, and its lax coercions (`"yes"` as a bool, no `12.8e6` as an int)
would need a validator on every field to keep the messages and rules below.
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


_added: list[Path] = []  # add_config_dir


def packaged_config_dir() -> Path:
    """The presets that ship with hype: `hype/configs/` when installed from a wheel or sdist (pyproject maps
    the repository's `configs/` there), the repository's `configs/` in a checkout (editable or not)."""
    installed = Path(__file__).resolve().parent / "configs"
    return installed if installed.is_dir() else installed.parents[1] / "configs"


def add_config_dir(path: str | PathLike) -> None:
    """Look up presets in `path` (`<path>/<kind>/<name>.yaml`) too, before the packaged ones (as open_clip's
    `add_model_config`): a name there overrides a packaged preset, a new name adds one."""
    _added.insert(0, Path(path))


def config_dirs() -> list[Path]:
    """Where presets are looked up, first match wins: the folders in `$HYPE_CONFIG_DIR` (read at call time,
    several joined with os.pathsep), those given to `add_config_dir` (latest first), the packaged ones."""
    env = [Path(p) for p in os.environ.get("HYPE_CONFIG_DIR", "").split(os.pathsep) if p]
    return [*env, *_added, packaged_config_dir()]


def preset_path(kind: str, name: str) -> Path | None:
    """`<configs>/<kind>/<name>.yaml` in the first folder of `config_dirs()` that has it, or None."""
    return next((p for d in config_dirs() if (p := d / kind / f"{name}.yaml").is_file()), None)


def list_presets(kind: str) -> list[str]:
    """The preset names of `kind` (YAML stems) in every folder of `config_dirs()`, sorted."""
    return sorted({p.stem for d in config_dirs() for p in (d / kind).glob("*.yaml")})


def resolve_preset(kind: str, config: str | PathLike, what: str | None = None) -> Path:
    """A YAML path as given, or a preset name -> its `<configs>/<kind>/<name>.yaml`; `what` names the kind
    in messages (`training` -> "unknown training preset 'x'; available: ...")."""
    what = what or kind
    path = Path(config)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise ConfigError("", f"{what} config file not found", str(path))
        return path
    named = preset_path(kind, str(config))
    if named is None:
        available = ", ".join(list_presets(kind)) or "(none)"
        raise ConfigError("", f"unknown {what} preset {str(config)!r}; available: {available}")
    return named


class _Loader(yaml.SafeLoader):
    """YAML without aliases: `*name` repeats a node without copying it, so a few hundred bytes of nested
    aliases expand to billions of values once walked (the "billion laughs"); no hype file needs them."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.YAMLError(
                f"line {mark.line + 1}, column {mark.column + 1}: aliases (*name) are not allowed; "
                "write the value out"
            )
        return super().compose_node(parent, index)


def parse_yaml(text: str | bytes, source: str) -> Any:
    """The value of YAML `text` (THE one YAML reader of hype: aliases refused); bad YAML is a one-line
    `ConfigError` naming `source`."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as e:
        raise ConfigError("", f"not valid YAML ({' '.join(str(e).split())})", source) from None


def read_yaml(path: str | PathLike) -> dict:
    """The mapping in a YAML file (an empty file is `{}`); bad YAML and non-mappings name the file."""
    source = str(path)
    data = parse_yaml(Path(path).read_text(), source)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("", f"must be a mapping, got {type(data).__name__}", source)
    return data


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
    data = read_yaml(path)
    data.setdefault("name", path.stem)
    return data, str(path)


def load(
    cls: type,
    kind: str,
    config: str | PathLike | dict | None,
    overrides: list[str] | None = None,
    *,
    default: str | None = None,
    what: str | None = None,
    override: typing.Callable[[dict, str], None] | None = None,
) -> Any:
    """`read_config`, then each `key=value` override (`override(data, item)`, by default
    `apply_override` against `cls`), then `build`; the source says "(with overrides)" when there were any.

    A top-level `storage_options:` mapping (fsspec options for s3:// gs:// hf:// paths, overridable as
    `storage_options.endpoint_url=...`) is taken out before `build` and handed to
    `hype.io.storage.configure_from_config`: it may hold credentials, so it is in no schema and never
    reaches a config that is saved (run directories, checkpoints)."""
    data, source = read_config(kind, config, default, what)
    for item in overrides or []:
        path, value = parse_override(item)
        if path[0] == STORAGE_KEY:
            set_path(data, path, value)
        elif override is None:
            apply_override(data, item, cls)
        else:
            override(data, item)
    source += " (with overrides)" if overrides else ""
    if STORAGE_KEY in data:
        options = data.pop(STORAGE_KEY)
        if options is not None and not isinstance(options, dict):
            example = "{endpoint_url: 'http://host:9000'}"
            raise ConfigError(STORAGE_KEY, f"must be a mapping of fsspec options, e.g. {example}", source)
        from hype.io import storage  # here: hype.io brings numpy and pyarrow, paid only when this key is set

        storage.configure_from_config(options)
    return build(cls, data, source=source)


STORAGE_KEY = "storage_options"


def set_path(data: dict, path: list[str], value: Any) -> None:
    """Set `data[path[0]][path[1]]... = value` in a raw config dict, making the missing sections."""
    node = data
    for part in path[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[path[-1]] = value


# --- key=value overrides --------------------------------------------------------------------------


def parse_value(raw: str) -> Any:
    """A value typed on a command line, parsed as YAML (`1e-3`, `true`, `null`, `[1, 2]`); text that is not
    YAML stays text, and an empty value is None."""
    try:
        return parse_yaml(raw, "override") if raw.strip() else None
    except ConfigError:
        return raw  # not YAML: keep the text (e.g. a caption template with ': ' inside)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value parsed as YAML; text that is not YAML stays text)."""
    if "=" not in item:
        raise ConfigError("", f"override {item!r} is not key=value (e.g. optim.lr=1e-3)", "override")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError("", f"override {item!r} has an empty key", "override")
    return key.split("."), parse_value(raw)


def apply_override(data: dict, item: str, root: type) -> None:
    """Set a dotted key in the raw config dict of dataclass `root`. Unknown keys raise with the valid ones
    listed; a text field keeps the text as typed (`{caption}` would read as a YAML mapping); sections
    are the fields typed as dataclasses (or `X | None`)."""
    path, value = parse_override(item)
    cls: Any = root
    node = data
    for depth, part in enumerate(path):
        hints = _section_keys(cls)
        valid = list(hints)
        if part not in valid:
            where = ".".join(path[:depth]) or "the top level"
            raise ConfigError(
                ".".join(path[: depth + 1]),
                f"unknown key; valid keys in {where}: {', '.join(valid)}",
                "override",
            )
        hint = hints[part]
        if depth == len(path) - 1:
            if is_text(hint) and not (value is None or isinstance(value, str)):
                value = item.split("=", 1)[1].strip()
            node[part] = value
            return
        sub = _dataclass_of(hint)
        if sub is None:
            raise ConfigError(".".join(path[: depth + 1]), "is not a section; set it directly", "override")
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node, cls = node[part], sub


def is_text(tp: Any) -> bool:
    """Whether a field of type `tp` holds text (`str` or `str | None`): typed values stay text there."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return str in typing.get_args(tp)
    return tp is str


def _section_keys(cls: type) -> dict[str, Any]:
    """A section's keys and their types: its fields', or those its `section_keys` declares (a section whose
    plug-ins declare some of its keys: `hype.executor.ExecutorConfig`)."""
    own = getattr(cls, "section_keys", None)
    return own() if own is not None else typing.get_type_hints(cls)


def _dataclass_of(tp: Any) -> type | None:
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if dataclasses.is_dataclass(arg):
                return arg
    return None


# --- dict -> dataclass with type checks -----------------------------------------------------------


def build(cls: type, data: Any, key: str = "", *, source: str | None = None, exact_ints: bool = False) -> Any:
    """An instance of dataclass `cls` from a raw mapping: unknown and missing keys listed, values
    type-checked (`coerce`), sections built recursively; errors carry the dotted key and `source`."""
    try:
        return _build(cls, data, key, exact_ints)
    except ConfigError as e:
        raise (e.from_source(source) if source is not None else e) from None


def _build(cls: type, data: Any, key: str, exact_ints: bool) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(key, f"must be a mapping, got {type(data).__name__}")
    if (split := getattr(cls, "build_section", None)) is not None:  # its plug-ins' keys, flat
        data = split(data)
    where = f"{key}." if key else ""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    valid = [f.name for f in fields]
    unknown = [k for k in data if k not in valid]
    if unknown:
        raise ConfigError(
            ", ".join(where + str(k) for k in unknown),
            f"unknown key; valid keys{f' in {key}' if key else ''}: {', '.join(valid)}",
        )
    missing = [
        f.name
        for f in fields
        if f.name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(", ".join(where + k for k in missing), "missing; this key is required")
    kwargs = {
        name: coerce(value, hints[name], where + name, exact_ints=exact_ints) for name, value in data.items()
    }
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise (e.within(key) if key else e) from None


def coerce(value: Any, tp: Any, key: str = "", *, exact_ints: bool = False) -> Any:
    """`value` checked against type `tp` (the types a schema may use), or a `ConfigError` at `key`.

    Floats also come from numeric text (PyYAML reads `1e-5`, no dot, as a string) and must be finite;
    ints also come from integral floats and numeric text (`samples_seen: 12.8e6`) unless `exact_ints`;
    bools and strings come only from themselves; a tuple or list from a YAML list, a dict from a mapping.
    """
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return coerce(value, inner, key, exact_ints=exact_ints)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key, exact_ints)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"must be a list, got {value!r}")
        (item,) = {a for a in typing.get_args(tp) if a is not Ellipsis} or {Any}
        return origin(coerce(v, item, key, exact_ints=exact_ints) for v in value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"must be a mapping, got {value!r}")
        k_tp, v_tp = typing.get_args(tp) or (Any, Any)
        return {
            coerce(k, k_tp, key): coerce(v, v_tp, f"{key}.{k}", exact_ints=exact_ints)
            for k, v in value.items()
        }
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        if not exact_ints:
            if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
                value = int(value)  # `samples_seen: 12.8e6` reads as a float
            if isinstance(value, str):
                try:
                    value = int(float(value)) if float(value).is_integer() else value
                except (ValueError, OverflowError):
                    pass
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
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


def to_dict(obj: Any) -> dict[str, Any]:
    """A schema instance as a plain, YAML/JSON-serializable dict (tuples become lists) that `build` accepts
    back; the values are copies."""
    return _plain(dataclasses.asdict(obj))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


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


def in_range(obj: Any, low: float, high: float, *names: str) -> None:
    """Each of `names` in [low, high)."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and not low <= value < high:
            raise ConfigError(name, f"must be in [{low:g}, {high:g}), got {value!r}")


def one_of(obj: Any, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    if value is not None and value not in choices:
        raise ConfigError(name, f"must be one of {', '.join(choices)}; got {value!r}")
