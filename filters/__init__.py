"""Selection rules over a scores table, one module per rule behind one interface (`filters.base.Rule`).

Score rules give each row a number (the selection keeps the top rows); mask rules give a keep-mask
(applied before ranking). `make_rule("basic:min_side=64")` builds a rule from a spec string.

| rule | kind | module |
|---|---|---|
| hype | score | weighted sum of the HYPE terms (paper Eq. 1) |
| clip_score | score | cos θ, DataComp's CLIP-score baseline |
| specificity | score | ε_i + ε_t |
| random | score | seeded hash of the uid |
| image_cluster | mask | c_IN > 0, DataComp's image-based filter |
| basic | mask | DataComp's basic filter (language, caption length, image size) |
| intersect | mask | uid in an external subset file (e.g. DFN) |

`union` with an external subset file is applied after ranking (`filters.uid_set.union`).
"""

from __future__ import annotations

from typing import Any

from filters.base import Rule, parse_spec
from filters.basic import BasicFilter
from filters.clip_score import ClipScore
from filters.hype import HypeScore
from filters.image_cluster import ImageCluster
from filters.random import RandomScore
from filters.specificity import Specificity
from filters.uid_set import Intersect, union
from hype.select.errors import SelectError

RULES: dict[str, type[Rule]] = {
    cls.name: cls
    for cls in (HypeScore, ClipScore, Specificity, RandomScore, ImageCluster, BasicFilter, Intersect)
}
SCORE_RULES = tuple(n for n, c in RULES.items() if c.kind == "score")
MASK_RULES = tuple(n for n, c in RULES.items() if c.kind == "mask")


def make_rule(spec: str | Rule, kind: str | None = None, **params: Any) -> Rule:
    """A rule from `"name"` / `"name:key=value,..."` (plus keyword parameters); checks its kind."""
    if isinstance(spec, Rule):
        rule = spec
    else:
        name, spec_params = parse_spec(spec)
        cls = RULES.get(name.replace("-", "_"))
        if cls is None:
            raise SelectError(f"unknown rule {name!r}; rules: {', '.join(RULES)}")
        rule = cls(**{**spec_params, **params})
    if kind is not None and rule.kind != kind:
        allowed = SCORE_RULES if kind == "score" else MASK_RULES
        what = "ranking rule (--rank)" if kind == "score" else "filter (--filter)"
        raise SelectError(
            f"{rule.name!r} is a {rule.kind} rule, not a {what}; use one of {', '.join(allowed)}"
        )
    return rule


__all__ = ["RULES", "SCORE_RULES", "MASK_RULES", "Rule", "make_rule", "parse_spec", "union"]
