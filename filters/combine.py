"""`combine`: a weighted sum of score columns, the weights given inline or in a file (e.g. `hype fit`'s).

`--weights` is `METRIC=W,...` or the path of a YAML/JSON file: a mapping metric -> weight, or the record
`hype fit` writes (`hype-fit-weights/1`: its `weights`, under the normalization it was fitted with). The
columns are z-scored over the whole pool by default, so weights fitted on z-scored columns mean the same
here; subset.json records the file, its digest and what the fit saw (the labels, never evaluation results).

A weighted name is any numeric column of the scores table (a plug-in stage's too) or, failing that, a
ranking rule's spec (`negclip`, `normsim:target=...`), whose score is the column; z-scored the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa

from hype.config import ConfigError, parse_yaml
from hype.filters.hype import HypeScore
from hype.io import StorageError, read_bytes, sha256_bytes, storage
from hype.select.errors import SelectError
from hype.select.rules import RULES, Rule, make_rule
from hype.table.reader import Batch

FIT_FORMAT = "hype-fit-weights/1"  # hype.select.fit.FORMAT, named here so selection never imports the fit
MAX_WEIGHTS_BYTES = 1 << 20  # a weights file names a few columns


@RULES.register
class Combine(HypeScore):
    name: ClassVar[str] = "combine"
    kind: ClassVar[str] = "score"
    summary: ClassVar[str] = "weighted sum of score columns; --weights METRIC=W,... or a file (hype fit's)"
    PARAMS: ClassVar = {
        "weights": (str, "", "METRIC=W,... or a YAML/JSON file of metric: weight (hype fit's weights.json)"),
        "normalize": (str, "zscore", "none | zscore | rank, over the whole pool before weighting"),
    }
    OPTIONS: ClassVar = ("weights", "normalize")
    ANY_COLUMN: ClassVar = True

    def __init__(self, weights: str | Mapping[str, Any] | None = None, **params: Any):
        self.source: dict = {}
        if isinstance(weights, str) and weights and "=" not in weights:
            weights, file_normalize, self.source = read_weights_file(weights)
            given = params.get("normalize")
            if file_normalize is not None and given not in (None, file_normalize):
                raise SelectError(
                    f"rule 'combine': the weights in {self.source['file']} were fitted with normalize "
                    f"{file_normalize}; drop --normalize {given} or refit"
                )
            if file_normalize is not None:
                params["normalize"] = file_normalize
        if not weights:
            raise SelectError("rule 'combine' needs weights: --weights METRIC=W,... or --weights FILE")
        super().__init__(weights, **params)
        self.rules: dict[str, Rule] = {}  # weighted names that are ranking rules (negclip, normsim, ...)

    def columns(self) -> list[str]:
        cols = [m for m in self.combiner.metrics if m not in self.rules]
        return cols + (["uid"] if self.rules else [])

    def attach(self, table) -> None:
        """Each weighted name is a numeric column of the table or, failing that, a ranking rule whose score
        is the column (e.g. negclip); anything else is an error listing what there is."""
        numeric = sorted(_numeric_columns(table))
        for name in self.combiner.metrics:
            if name in numeric:
                continue
            if name.split(":")[0] in RULES.names() and name.split(":")[0] != self.name:
                rule = make_rule(name, "score")
                rule.attach(table)
                _pool_pass(rule, table)
                self.rules[name] = rule
                continue
            rules = ", ".join(n for n, c in RULES.items() if c.kind == "score" and n != self.name)
            raise SelectError(
                f"rule 'combine': {name!r} is neither a numeric column of the scores table ("
                f"{', '.join(numeric)}) nor a ranking rule ({rules}); fix --weights"
            )

    def observe(self, batch: Batch) -> None:
        self.combiner.observe(self._columns(batch, numeric=True))

    def score(self, batch: Batch) -> np.ndarray:
        return self.combiner.score(self._columns(batch, numeric=False))

    def _columns(self, batch: Batch, *, numeric: bool) -> dict[str, np.ndarray]:
        out = {}
        for m in self.combiner.metrics:
            if m in self.rules:
                out[m] = np.asarray(self.rules[m].score(batch), np.float64)
            else:
                out[m] = batch.numeric(m) if numeric else batch.raw(m)
        return out

    def inputs(self) -> list[dict]:
        """A weights file by its content: other weights under the same path are another selection."""
        return [{"weights_file": self.source}] if self.source else []

    def describe(self) -> dict:
        return {**super().describe(), **({"weights_file": self.source} if self.source else {})}


def read_weights_file(path: str) -> tuple[dict, str | None, dict]:
    """(metric -> weight, the normalization the file names or None, the record of the file) of a weights
    file; every problem is one `SelectError` naming the file and the fix."""
    try:
        if storage.size(path) > MAX_WEIGHTS_BYTES:
            raise SelectError(f"--weights {path}: over {MAX_WEIGHTS_BYTES >> 20} MiB, not a weights file")
        data = read_bytes(path)
        value = parse_yaml(data, path)
    except (OSError, StorageError, ConfigError) as e:
        raise SelectError(
            f"--weights {path}: not METRIC=W,... and not a readable YAML/JSON file ({e}); write e.g. "
            "--weights eps_i=1,cos_theta=2 or pass the weights.json of hype fit"
        ) from None
    record = {"file": str(path), "sha256": sha256_bytes(data)}
    if isinstance(value, Mapping) and value.get("format") == FIT_FORMAT:
        weights, normalize = value.get("weights"), value.get("normalize")
        record["fit"] = value.get("data")  # what the fit saw
    elif isinstance(value, Mapping) and "format" not in value:
        weights, normalize = value, None
    else:
        raise SelectError(
            f"--weights {path}: expected a mapping metric: weight or hype fit's {FIT_FORMAT} record"
        )
    if not isinstance(weights, Mapping) or not weights:
        raise SelectError(f"--weights {path}: no weights in it (a mapping metric: weight)")
    return dict(weights), normalize, record


def _numeric_columns(table) -> set[str]:
    """The columns every file of the table holds as numbers."""
    sets = [
        {f.name for f in schema if pa.types.is_floating(f.type) or pa.types.is_integer(f.type)}
        for schema in table.schemas.values()
    ]
    return set.intersection(*sets) if sets else set()


def _pool_pass(rule: Rule, table) -> None:
    """A rule's own pool pass (e.g. a z-scored `hype` inside the sum), before its scores are summed."""
    if rule.needs_pool_pass:
        cols = list(dict.fromkeys(["uid", *rule.columns()]))
        for b in table.iter_batches(cols, progress=None):
            rule.observe(b)
        rule.finish_observe()
