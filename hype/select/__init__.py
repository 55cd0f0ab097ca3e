"""Selection: read a scores table, combine and normalize the HYPE terms, apply filters, keep the top
fraction exactly in bounded memory, and write DataComp subset files.

    from hype.select import SelectRequest, select_subset
    summary = select_subset(SelectRequest(scores="run", out="subset.npy", frac=0.2))

Modules: `table` (reading the scores table), `combine` (weights, normalization), `presets`
(configs/select/*.yaml), `reducer` (the streaming top-k), `outputs` (subset.npy / .parquet / .json),
`stats`, `keys`, `rules` (the rule interface and registry), `union`. The uid codec is `hype.data.uids`;
the rules themselves are plug-ins (the bundled ones in the top-level `filters` package) that register in
`hype.select.rules.RULES`.
"""

from __future__ import annotations

from hype.select.errors import SelectError
from hype.select.run import SelectRequest, format_summary, select_subset
from hype.select.table import ScoresTable

__all__ = ["SelectError", "SelectRequest", "select_subset", "format_summary", "ScoresTable"]
