"""What a selection is asked (`SelectRequest`, the options of `hype select` and `hype explain`) and the rules
and target it makes: here, below `hype.select.run` (which runs the selection) and `hype.select.explain`
(which redoes it to explain rows), so both import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hype.select import rules
from hype.select.errors import SelectError
from hype.select.presets import DEFAULT_PRESET, Preset, load_preset
from hype.select.reducer import Target, parse_frac
from hype.select.rules import Rule


@dataclass
class SelectRequest:
    scores: str | Path | list[str | Path]  # several: read as one table (`ScoresTable`)
    out: str | Path
    frac: float | str | None = None
    top_k: int | None = None
    threshold: float | None = None
    keep_all: bool = False
    frac_of: str = "pool"
    preset: str | None = None
    rank: str | None = None
    weights: str | dict | None = None
    normalize: str | None = None
    filters: list[str] = field(default_factory=list)
    intersect: list[str] = field(default_factory=list)
    union: list[str] = field(default_factory=list)
    seed: int | None = None
    workers: int = 2
    progress: bool = True
    audit: bool = False  # audit the cut into subset.json and print it (`hype select --audit`)
    metadata: str | Path | None = None  # the pool's metadata folder (nominal uids, URL domains)


def build_rules(req: SelectRequest) -> tuple[str, Rule, list[Rule]]:
    """(preset name, ranking rule, mask rules) for a request."""
    preset = load_preset(req.preset or DEFAULT_PRESET)
    rank_spec = req.rank or preset.rank
    params = _rank_options(rules.rule_class(rank_spec, kind="score"), req, preset)
    ranker = rules.make_rule(rank_spec, kind="score", **params)
    masks = [rules.make_rule(spec, kind="mask") for spec in [*preset.filters, *req.filters]]
    masks += [rules.option_filter("intersect", str(p)) for p in req.intersect]
    return preset.name, ranker, masks


def _rank_options(rule: type[Rule], req: SelectRequest, preset: Preset) -> dict[str, Any]:
    """The ranking rule's parameters from the options `--weights`, `--normalize`, `--seed` (else the
    preset's weights and normalization), each passed to a rule whose `OPTIONS` name it. An option given
    in the request that the rule does not take is an error; a preset's is left out (it was meant for the
    preset's own rule, which `--rank` replaced)."""
    requested = {option: getattr(req, option) for option in rules.SELECT_OPTIONS}
    preset_values = {
        "weights": preset.weights,
        "normalize": preset.normalize if preset.normalize != "none" else None,
    }
    params: dict[str, Any] = {}
    for option, value in requested.items():
        if value is None:
            value = preset_values.get(option)
            if value is not None and option in rule.OPTIONS:
                params[option] = value
        elif option in rule.OPTIONS:
            params[option] = value
        else:
            takers = rules.rules_taking(option)
            fix = f"; drop --{option}" + (f" or use --rank {takers[0]}" if takers else "")
            raise SelectError(
                f"--{option} applies to ranking rules that take {rules.SELECT_OPTIONS[option]} "
                f"({', '.join(takers) or 'none registered'}), not {rule.name!r}{fix}"
            )
    return params


def make_target(req: SelectRequest, nominal: int | None = None) -> Target:
    given = [
        n
        for n, v in (("--frac", req.frac), ("--top-k", req.top_k), ("--threshold", req.threshold))
        if v is not None
    ] + (["--keep-all"] if req.keep_all else [])
    if len(given) != 1:
        raise SelectError(
            "say how much to keep with exactly one of --frac F, --top-k N, --threshold T, --keep-all"
            + (f" (got {', '.join(given)})" if given else "")
        )
    if req.keep_all:
        return Target(threshold=-math.inf)
    if req.frac is not None:
        return Target(frac=parse_frac(req.frac), frac_of=req.frac_of, nominal_rows=nominal)
    if req.top_k is not None:
        return Target(k=int(req.top_k))
    return Target(threshold=float(req.threshold))  # type: ignore[arg-type]


__all__ = ["SelectRequest", "build_rules", "make_target"]
