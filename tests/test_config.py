"""hype.config: preset folders, YAML reading, key=value overrides and the dict -> dataclass builder."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from hype.config import (
    ConfigError,
    apply_override,
    build,
    config_dir,
    list_presets,
    parse_override,
    read_config,
    resolve_preset,
)


@dataclass(frozen=True)
class Inner:
    size: int = 1
    label: str | None = None


@dataclass(frozen=True)
class Outer:
    name: str = ""
    rate: float = 0.5
    inner: Inner = field(default_factory=Inner)


def test_parse_override_reads_yaml_values_and_refuses_bad_items():
    assert parse_override("a.b=0.5") == (["a", "b"], 0.5)
    assert parse_override("lr=1e-3") == (["lr"], "1e-3")  # PyYAML: text, build() makes it a float
    assert parse_override("flag=true") == (["flag"], True)
    assert parse_override("x=") == (["x"], None)
    assert parse_override("t=a: b: c") == (["t"], "a: b: c")  # not YAML: stays text
    with pytest.raises(ConfigError, match="is not key=value"):
        parse_override("novalue")
    with pytest.raises(ConfigError, match="has an empty key"):
        parse_override("a..b=1")


def test_apply_override_sets_nested_keys_and_lists_valid_keys():
    data: dict = {}
    apply_override(data, "inner.size=3", Outer)
    apply_override(data, "inner.label={caption}", Outer)  # a text field keeps the text, not a mapping
    apply_override(data, "name=2024", Outer)
    assert data == {"inner": {"size": 3, "label": "{caption}"}, "name": "2024"}
    assert build(Outer, data) == Outer(name="2024", inner=Inner(size=3, label="{caption}"))
    unknown = r"override: inner.sise: unknown key; valid keys in inner: size, label"
    with pytest.raises(ConfigError, match=unknown):
        apply_override(data, "inner.sise=1", Outer)
    with pytest.raises(ConfigError, match="valid keys in the top level: name, rate, inner"):
        apply_override(data, "nope=1", Outer)
    with pytest.raises(ConfigError, match="override: rate: is not a section; set it directly"):
        apply_override(data, "rate.x=1", Outer)


def test_build_checks_types_and_names_the_key():
    with pytest.raises(ConfigError, match=r"inner.size: must be an integer, got 'x'"):
        build(Outer, {"inner": {"size": "x"}})
    with pytest.raises(ConfigError, match=r"inner.colour: unknown key; valid keys in inner: size, label"):
        build(Outer, {"inner": {"colour": 1}})
    assert build(Outer, {"rate": "1e-3", "inner": {"size": 2.0}}) == Outer(rate=1e-3, inner=Inner(size=2))


def test_presets_honour_hype_config_dir(tmp_path, monkeypatch):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "mine.yaml").write_text("rate: 0.25\n")
    (tmp_path / "train" / "list.yaml").write_text("- 1\n")
    monkeypatch.setenv("HYPE_CONFIG_DIR", str(tmp_path))
    assert config_dir() == tmp_path
    assert list_presets("train") == ["list", "mine"]
    assert list_presets("absent") == []
    assert resolve_preset("train", "mine") == tmp_path / "train" / "mine.yaml"
    data, source = read_config("train", "mine")
    assert data == {"rate": 0.25, "name": "mine"} and source == str(tmp_path / "train" / "mine.yaml")
    assert read_config("train", None, default="mine")[0]["name"] == "mine"
    given = {"rate": 1.0}
    data, source = read_config("train", given)
    assert data == given and data is not given and source == "<dict>"
    with pytest.raises(ConfigError, match=r"unknown training preset 'nope'; available: list, mine"):
        resolve_preset("train", "nope", "training")
    with pytest.raises(ConfigError, match=r"unknown score preset 'x'; available: \(none\)"):
        resolve_preset("score", "x")
    with pytest.raises(ConfigError, match=r"missing.yaml: score config file not found"):
        resolve_preset("score", tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"list.yaml: must be a mapping, got list"):
        read_config("train", "list")


def test_configerror_is_the_same_class_everywhere():
    import hype.models
    import hype.models.config

    assert hype.models.ConfigError is ConfigError is hype.models.config.ConfigError
    assert str(ConfigError("a.b", "bad", "f.yaml")) == "f.yaml: a.b: bad"
    assert str(ConfigError("b", "bad").within("a")) == "a.b: bad"


def test_importing_hype_config_does_not_import_torch():
    code = "import sys, hype.config; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
