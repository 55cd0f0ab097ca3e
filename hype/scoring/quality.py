"""How well each score separates clean samples from each kind of noise (synthetic world, DESIGN §5).

For a noise kind k and a metric m: AUROC = P(m(clean sample) > m(sample of kind k)), ties counting
one half: 1.0 means the metric ranks every clean sample above every noisy one, 0.5 is chance, below 0.5
means the metric prefers the noise. Computed from ranks (Mann-Whitney U) with ties averaged.
"""

from __future__ import annotations

import numpy as np

from hype.table.combine import PAPER_WEIGHTS, Combiner, hype_score
from hype.table.schema import METRICS
from hype.table.stats import auroc, average_ranks  # noqa: F401 - average_ranks re-exported


def normalized_hype_score(columns: dict[str, np.ndarray], normalize: str) -> np.ndarray:
    """Eq. 1 over terms normalized across the given rows as `hype select --normalize` does (the same
    `Combiner`: zscore with the population std, rank as the 22-bit-key mid-rank fraction)."""
    combiner = Combiner(PAPER_WEIGHTS, normalize)
    combiner.observe(columns)
    combiner.finish_observe()
    return combiner.score(columns)


def noise_auroc_table(
    df, noise_column: str = "noise", clean: str = "clean", normalizations: tuple[str, ...] = ()
) -> dict[str, dict[str, float]]:
    """metric (the five terms, `hype`, and `hype_<normalization>` for each of `normalizations`, e.g.
    "zscore", "rank") -> noise kind -> AUROC of clean vs that kind."""
    kinds = sorted(k for k in df[noise_column].unique() if k != clean)
    columns = {m: df[m].to_numpy(np.float64) for m in METRICS}
    terms = dict(columns)
    columns["hype"] = hype_score(terms)
    for normalize in normalizations:
        columns[f"hype_{normalize}"] = normalized_hype_score(terms, normalize)
    is_clean = (df[noise_column] == clean).to_numpy()
    table: dict[str, dict[str, float]] = {}
    for name, values in columns.items():
        table[name] = {}
        for kind in kinds:
            sel = is_clean | (df[noise_column] == kind).to_numpy()
            table[name][kind] = auroc(values[sel], is_clean[sel])
    return table
