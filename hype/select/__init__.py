"""Selection: read a scores table, combine and normalize the HYPE terms, apply filters, keep the top
fraction exactly in bounded memory, and write DataComp subset files.

    from hype.select import SelectRequest, select_subset
    summary = select_subset(SelectRequest(scores="run", out="subset.npy", frac=0.2))

Modules: `table` (reading the scores table), `combine` (weights, normalization), `presets`
(configs/select/*.yaml), `reducer` (the streaming top-k), `outputs` (subset.npy / .parquet / .json),
`stats`, `keys`. The uid codec is `hype.data.uids`; the rules themselves live in the top-level
`filters` package.
"""

from __future__ import annotations

from hype.select.errors import SelectError

_LAZY = {
    "SelectRequest": "hype.select.run",
    "select_subset": "hype.select.run",
    "format_summary": "hype.select.run",
    "ScoresTable": "hype.select.table",
}


def __getattr__(name: str):
    # Lazy so that `filters` (which imports hype.select.table) and hype.select.run (which imports
    # filters) can import each other's modules without a cycle at package import time.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


__all__ = ["SelectError", *_LAZY]
