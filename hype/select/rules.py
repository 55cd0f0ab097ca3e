"""Selection rules: the interface every rule implements, the registry of rules, and `make_rule`.

A rule reads some columns of the scores table, one `Batch` (a row group) at a time, and returns either a
score per row (`kind = "score"`: larger is better; the selection keeps the top rows) or a keep-mask per row
(`kind = "mask"`: applied before ranking). Rules are pure functions of a row (plus, for normalized scores,
of pool statistics gathered in an optional first pass), so results never depend on batch boundaries,
thread counts or file order.

Parameters are declared in `PARAMS` as name -> (type, default, help) and come from a spec string
(`basic:min_side=64,english=false`), a preset's YAML mapping, or keyword arguments. A rule also names in
`OPTIONS` the `hype select` options it takes, so that selection passes them on without knowing any rule:
a ranking rule the ones of `SELECT_OPTIONS` (--weights, --normalize, --seed), as its parameters of the same
name; a mask rule a repeatable one of `MASK_OPTIONS` (--intersect FILE), one filter per value.

The rules themselves are plug-ins (the bundled ones in the top-level `filters` package): each subclasses
`Rule` and registers itself in `RULES` when imported (`hype.plugins`), so selection never imports them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from hype.config import ConfigError, coerce, is_text, parse_value
from hype.plugins import Registry
from hype.select.errors import SelectError
from hype.table.reader import Batch

# The options of `hype select` that a ranking rule may take (`Rule.OPTIONS`) -> what an error says such a
# rule takes ("--seed applies to ranking rules that take a seed (random)").
SELECT_OPTIONS: dict[str, str] = {"weights": "weights", "normalize": "a normalization", "seed": "a seed"}
# The repeatable options of `hype select` that add a filter per value -> the parameter given that value.
MASK_OPTIONS: dict[str, str] = {"intersect": "path"}


class Rule:
    """One selection rule; subclasses set `name`, `kind`, `summary`, `PARAMS` and `score` or `mask`."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""  # "score" or "mask"
    summary: ClassVar[str] = ""  # one line for --help and the summary
    PARAMS: ClassVar[dict[str, tuple[type, Any, str]]] = {}
    OPTIONS: ClassVar[tuple[str, ...]] = ()  # the SELECT_OPTIONS (score) or MASK_OPTIONS (mask) it takes

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        # Checked when the plug-in is defined: an option that is not a parameter would fail on first use.
        known = MASK_OPTIONS if cls.kind == "mask" else {o: o for o in SELECT_OPTIONS}
        bad = [o for o in cls.OPTIONS if o not in known or known[o] not in cls.PARAMS]
        if bad:
            raise TypeError(
                f"rule class {cls.__name__}: OPTIONS {bad} must each be a `hype select` option "
                f"({', '.join(known)}) whose parameter is in PARAMS ({', '.join(cls.PARAMS) or 'none'})"
            )

    def __init__(self, **params: Any):
        self.params = coerce_params(self.name, self.PARAMS, params)

    # -- what the rule reads
    def columns(self) -> list[str]:
        """Scores-table columns this rule reads (add "uid" for rules that look at uids)."""
        return []

    # -- optional: outputs of the scoring run beside the table (`decontaminate`: RUN_DIR/decontam/,
    # `dedup`: RUN_DIR/neardup/)
    def attach(self, table: Any) -> None:
        """Called once with the `ScoresTable` before any batch: rules that read a run's other outputs
        find them here (the run directory of each scores folder: `folder.parent` of `table.folders`)."""

    def inputs(self) -> list[dict]:
        """Identities (`hype.io.runs.input_identity`) of the files the rule reads besides the scores table
        and its run's outputs, e.g. a target folder: a selection is redone when one changes."""
        return []

    def after_selection(self, table: Any, ranker: Rule, masks: list[Rule], cut: float | None) -> dict:
        """Extra fields of this filter's record in subset.json, given the kept rows' lowest score `cut`
        (None: nothing kept); {}: none."""
        return {}

    # -- optional pool pass (statistics a rule needs before it can score)
    @property
    def needs_pool_pass(self) -> bool:
        return False

    def observe(self, batch: Batch) -> None:
        """See every scored row once before any `score` call (only when `needs_pool_pass`)."""

    def finish_observe(self) -> None:
        """Called once after the last `observe`."""

    # -- the rule itself
    def score(self, batch: Batch) -> np.ndarray:
        """float64 score per row (score rules)."""
        raise NotImplementedError

    def mask(self, batch: Batch) -> np.ndarray:
        """bool keep-mask per row (mask rules)."""
        raise NotImplementedError

    # -- optional per-term attribution (`hype explain`): score rules that are a sum of per-metric terms
    def terms(self) -> list[str]:
        """The metrics whose contributions add up to `score`, in the order they are summed ([]: the rule
        is not a sum of terms, e.g. `random`)."""
        return []

    def contribution(self, metric: str, values: np.ndarray) -> np.ndarray:
        """float64 contribution of `metric` at `values` to the score, after the rule's normalization and
        weight; summed over `terms()` in order it gives `score` bit for bit."""
        raise NotImplementedError(f"rule {self.name!r} is not a sum of per-metric terms")

    def describe(self) -> dict:
        """What the summary JSON records about this rule."""
        return {"rule": self.name, **{k: v for k, v in self.params.items()}}

    @classmethod
    def headline(cls, record: Mapping[str, Any]) -> str:
        """How `hype select`'s printed summary names this ranking rule, from the record `describe` wrote
        into subset.json (default: its name)."""
        return str(record.get("rule", cls.name))

    def spec(self) -> str:
        changed = {k: v for k, v in self.params.items() if k in self.PARAMS and v != self.PARAMS[k][1]}
        return self.name + (":" + ",".join(f"{k}={v}" for k, v in changed.items()) if changed else "")


RULES: Registry[type[Rule]] = Registry("rules")  # filled by the plug-ins (entry-point group hype.rules)


def rule_names(kind: str) -> tuple[str, ...]:
    """Names of the registered rules of one kind ("score" or "mask"), in registration order."""
    return tuple(name for name, cls in RULES.items() if cls.kind == kind)


def rules_taking(option: str) -> tuple[str, ...]:
    """Names of the registered ranking rules that take the `hype select` option `option` (`Rule.OPTIONS`)."""
    return tuple(name for name, cls in RULES.items() if cls.kind == "score" and option in cls.OPTIONS)


def option_filter(option: str, value: Any) -> Rule:
    """The filter that the repeatable `hype select` option `option` (of MASK_OPTIONS) adds for `value`: the
    one registered mask rule whose OPTIONS name it, given `value` as its MASK_OPTIONS parameter."""
    takers = [cls for _, cls in RULES.items() if cls.kind == "mask" and option in cls.OPTIONS]
    if len(takers) != 1:
        names = ", ".join(cls.name for cls in takers) or "none"
        raise SelectError(f"--{option} needs one registered filter that takes it; found {names}")
    return takers[0](**{MASK_OPTIONS[option]: value})


def rule_class(spec: str, kind: str | None = None) -> type[Rule]:
    """The registered rule class of a spec (`"name"` / `"name:key=value,..."`); checks its kind."""
    name = parse_spec(spec)[0]
    cls = RULES.get(name.replace("-", "_"))
    if cls is None:
        raise SelectError(f"unknown rule {name!r}; rules: {', '.join(RULES.names())}")
    _check_kind(cls, kind)
    return cls


def make_rule(spec: str | Rule, kind: str | None = None, **params: Any) -> Rule:
    """A rule from `"name"` / `"name:key=value,..."` (plus keyword parameters); checks its kind."""
    if isinstance(spec, Rule):
        _check_kind(type(spec), kind)
        return spec
    cls = rule_class(spec, kind)
    return cls(**{**parse_spec(spec)[1], **params})


def _check_kind(cls: type[Rule], kind: str | None) -> None:
    if kind is not None and cls.kind != kind:
        allowed = rule_names(kind)
        what = "ranking rule (--rank)" if kind == "score" else "filter (--filter)"
        raise SelectError(f"{cls.name!r} is a {cls.kind} rule, not a {what}; use one of {', '.join(allowed)}")


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """`"basic:min_side=64,english=false"` -> ("basic", {"min_side": "64", "english": "false"})."""
    name, _, rest = str(spec).partition(":")
    params: dict[str, str] = {}
    for part in rest.split(","):
        part = part.strip()
        if not part:
            continue
        if "=" not in part:
            raise SelectError(f"rule {spec!r}: {part!r} is not KEY=VALUE; write e.g. basic:min_side=64")
        k, v = part.split("=", 1)
        params[k.strip()] = v.strip()
    return name.strip(), params


def coerce_params(rule: str, declared: Mapping[str, tuple[type, Any, str]], given: Mapping[str, Any]) -> dict:
    """The declared defaults updated with `given`, each value checked by `hype.config.coerce` (the one type
    checker of every config); text from a spec string is parsed as YAML first, as `key=value` overrides
    are (`english=no` is false, `min_side=64` a number), except for text parameters, which keep it."""
    out = {k: d for k, (_, d, _) in declared.items()}
    for key, value in given.items():
        if key not in declared:
            known = ", ".join(declared) or "none"
            raise SelectError(f"rule {rule!r}: unknown parameter {key!r} (parameters: {known})")
        typ = declared[key][0]
        parsed = parse_value(value) if isinstance(value, str) and not is_text(typ) else value
        try:
            out[key] = coerce(parsed, typ, key)
        except ConfigError:
            raise SelectError(f"rule {rule!r}: {key}={value!r} is not a valid {typ.__name__}") from None
    return out
