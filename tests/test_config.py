"""hype.config: preset folders, YAML reading, key=value overrides and the dict -> dataclass builder."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from hype.config import (
    ConfigError,
    add_config_dir,
    apply_override,
    build,
    coerce,
    in_range,
    list_presets,
    load,
    packaged_config_dir,
    parse_override,
    read_config,
    read_yaml,
    resolve_preset,
    to_dict,
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


@dataclass(frozen=True)
class Shapes:
    required: str
    pair: tuple[float, ...] = (0.5, 1.0)
    names: list[str] = field(default_factory=list)
    table: dict[str, int] | None = None
    beta: float = 0.9

    def __post_init__(self) -> None:
        in_range(self, 0.0, 1.0, "beta")


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


def test_presets_ship_with_hype_and_a_user_folder_adds_or_overrides(tmp_path, monkeypatch):
    """The packaged presets are always there; `$HYPE_CONFIG_DIR` (or `add_config_dir`) adds names and
    overrides packaged ones, as open_clip's `add_model_config` does."""
    packaged = set(list_presets("train"))
    assert {"tiny-clip", "datacomp-small"} <= packaged
    assert resolve_preset("train", "tiny-clip") == packaged_config_dir() / "train" / "tiny-clip.yaml"
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "mine.yaml").write_text("rate: 0.25\n")
    (tmp_path / "train" / "list.yaml").write_text("- 1\n")
    (tmp_path / "train" / "tiny-clip.yaml").write_text("rate: 0.5\n")
    monkeypatch.setenv("HYPE_CONFIG_DIR", str(tmp_path))
    assert set(list_presets("train")) == packaged | {"list", "mine"}
    assert list_presets("absent") == []
    assert resolve_preset("train", "mine") == tmp_path / "train" / "mine.yaml"
    assert resolve_preset("train", "tiny-clip") == tmp_path / "train" / "tiny-clip.yaml"  # the user's wins
    data, source = read_config("train", "mine")
    assert data == {"rate": 0.25, "name": "mine"} and source == str(tmp_path / "train" / "mine.yaml")
    assert read_config("train", None, default="mine")[0]["name"] == "mine"
    given = {"rate": 1.0}
    data, source = read_config("train", given)
    assert data == given and data is not given and source == "<dict>"
    with pytest.raises(
        ConfigError, match=r"unknown training preset 'nope'; available: .*\blist, meru.*, mine,"
    ):
        resolve_preset("train", "nope", "training")
    with pytest.raises(ConfigError, match=r"unknown absent preset 'x'; available: \(none\)"):
        resolve_preset("absent", "x")
    with pytest.raises(ConfigError, match=r"missing.yaml: score config file not found"):
        resolve_preset("score", tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"list.yaml: must be a mapping, got list"):
        read_config("train", "list")
    monkeypatch.delenv("HYPE_CONFIG_DIR")
    monkeypatch.setattr("hype.config._added", [])  # this test's folders leave with it
    (tmp_path / "more" / "train").mkdir(parents=True)
    (tmp_path / "more" / "train" / "extra.yaml").write_text("rate: 1\n")
    add_config_dir(tmp_path / "more")
    assert set(list_presets("train")) == packaged | {"extra"}


def test_configerror_is_the_same_class_everywhere():
    import hype.models
    import hype.models.config

    assert hype.models.ConfigError is ConfigError is hype.models.config.ConfigError
    assert str(ConfigError("a.b", "bad", "f.yaml")) == "f.yaml: a.b: bad"
    assert str(ConfigError("b", "bad").within("a")) == "a.b: bad"


def test_importing_hype_config_does_not_import_torch():
    code = "import sys, hype.config; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_build_handles_tuples_lists_dicts_and_required_keys():
    built = build(Shapes, {"required": "x", "pair": [1, "2e-1"], "names": ["a"], "table": {"k": 3.0}})
    assert built == Shapes(required="x", pair=(1.0, 0.2), names=["a"], table={"k": 3})
    assert to_dict(built) == {
        "required": "x",
        "pair": [1.0, 0.2],
        "names": ["a"],
        "table": {"k": 3},
        "beta": 0.9,
    }
    assert build(Shapes, to_dict(built)) == built
    with pytest.raises(ConfigError, match=r"^required: missing; this key is required$"):
        build(Shapes, {})
    with pytest.raises(ConfigError, match=r"^f.yaml: pair: must be a list, got 0.5$"):
        build(Shapes, {"required": "x", "pair": 0.5}, source="f.yaml")
    with pytest.raises(ConfigError, match=r"^table.k: must be an integer, got 'x'$"):
        build(Shapes, {"required": "x", "table": {"k": "x"}})
    with pytest.raises(ConfigError, match=r"^beta: must be in \[0, 1\), got 1.0$"):
        build(Shapes, {"required": "x", "beta": 1})


def test_exact_ints_refuse_floats_and_text():
    assert coerce(2.0, int, "n") == 2 and coerce("12.8e6", int, "n") == 12_800_000
    for value in (2.0, "3", True):
        with pytest.raises(ConfigError, match=r"n: must be an integer"):
            coerce(value, int, "n", exact_ints=True)
    assert build(Outer, {"inner": {"size": 4}}, exact_ints=True).inner.size == 4
    with pytest.raises(ConfigError, match=r"inner.size: must be an integer, got 4.0"):
        build(Outer, {"inner": {"size": 4.0}}, exact_ints=True)


def test_load_reads_overrides_and_names_the_source(tmp_path, monkeypatch):
    (tmp_path / "outer").mkdir()
    (tmp_path / "outer" / "base.yaml").write_text("rate: 0.25\ninner: {size: 2}\n")
    (tmp_path / "empty.yaml").write_text("")
    monkeypatch.setenv("HYPE_CONFIG_DIR", str(tmp_path))
    assert read_yaml(tmp_path / "empty.yaml") == {}
    assert load(Outer, "outer", "base") == Outer(name="base", rate=0.25, inner=Inner(size=2))
    assert load(Outer, "outer", None, ["inner.size=5"], default="base").inner.size == 5
    with pytest.raises(
        ConfigError, match=r"outer/base.yaml \(with overrides\): inner.size: must be an integer"
    ):
        load(Outer, "outer", "base", ["inner.size=big"])


def test_storage_options_key_configures_storage_and_is_never_built_into_the_config(tmp_path):
    from hype.io import storage

    path = tmp_path / "cluster.yaml"
    path.write_text(
        "rate: 0.25\nstorage_options:\n  endpoint_url: http://minio:9000\n  key: from-file\n"
        "  s3: {profile: file-profile, region: eu}\n"
    )
    try:
        cfg = load(Outer, "outer", path, ["storage_options.secret=s3cr3t", "storage_options.s3.region=us"])
        assert cfg == Outer(name="cluster", rate=0.25)  # no field holds the options...
        assert "s3cr3t" not in repr(to_dict(cfg)) and "minio" not in repr(to_dict(cfg))
        assert storage.snapshot() == {  # ...they are this process's storage options
            "endpoint_url": "http://minio:9000",
            "key": "from-file",
            "secret": "s3cr3t",
            "s3": {"profile": "file-profile", "region": "us"},
        }
        # --storage-options / HYPE_STORAGE_OPTIONS win key by key, also inside a protocol's section
        storage.configure({"key": "from-cli", "s3": {"region": "cli"}})
        assert storage.snapshot() == {
            "endpoint_url": "http://minio:9000",
            "key": "from-cli",
            "secret": "s3cr3t",
            "s3": {"profile": "file-profile", "region": "cli"},
        }
        assert storage.options_for("s3")["region"] == "cli"
        path.write_text("storage_options: [not, a, mapping]\n")
        with pytest.raises(ConfigError, match=r"cluster.yaml: storage_options: must be a mapping"):
            load(Outer, "outer", path)
    finally:
        storage.configure_from_config(None)
        storage.configure(None)
    assert storage.snapshot() == {}


def test_presets_suites_and_rule_parameters_share_the_mechanism(tmp_path):
    from hype.eval.tasks import TaskConfigError, load_suite
    from hype.select.errors import SelectError
    from hype.select.presets import load_preset
    from hype.select.rules import make_rule

    preset = tmp_path / "p.yaml"
    preset.write_text("rank: hype\nnormalize: zz\n")
    with pytest.raises(
        SelectError, match=rf"^{preset}: normalize: must be one of none, zscore, rank; got 'zz'$"
    ):
        load_preset(preset)
    preset.write_text("weights: {eps_i: 2}\nfilters: [{basic: {min_side: 64}}]\n")
    loaded = load_preset(preset)
    assert loaded.weights["eps_i"] == 2.0 and loaded.filters == ["basic:min_side=64"]
    suite = tmp_path / "s.yaml"
    suite.write_text("tasks:\n  - {key: a, name: A, type: retrieval, main_metric: r, group: g, size: big}\n")
    with pytest.raises(
        TaskConfigError, match=rf"^{suite}: task a.size: must be an integer, got 'big'$"
    ) as err:
        load_suite(suite)
    assert isinstance(err.value, ConfigError) and err.value.key == "task a.size"
    # Spec text is parsed like an override value; text parameters keep it as typed.
    rule = make_rule("basic:english=off,min_words=4.0,min_side=1e2")
    assert (rule.params["english"], rule.params["min_words"], rule.params["min_side"]) == (False, 4, 100.0)
    assert make_rule("hype:weights=eps_i=1").params["weights"].startswith("eps_i=1")
