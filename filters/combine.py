"""`combine`: a weighted sum of score columns, the weights given inline or in a file (e.g. `hype fit`'s).

`--weights` is `METRIC=W,...` or the path of a YAML/JSON file: a mapping metric -> weight, or the record
`hype fit` writes (`hype-fit-weights/1`: its `weights`, under the normalization it was fitted with). The
columns are z-scored over the whole pool by default, so weights fitted on z-scored columns mean the same
here; subset.json records the file, its digest and what the fit saw (the labels, never evaluation results).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from hype.config import ConfigError, parse_yaml
from hype.filters.hype import HypeScore
from hype.io import StorageError, read_bytes, sha256_bytes, storage
from hype.select.errors import SelectError
from hype.select.rules import RULES

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
