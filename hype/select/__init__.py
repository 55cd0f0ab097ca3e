"""Selection: apply filters to a scores table, rank it by a rule, keep the top fraction exactly in bounded
memory, and write DataComp subset files.

    from hype.select import SelectRequest, select_subset
    summary = select_subset(SelectRequest(scores="run", out="subset.npy", frac=0.2))

Modules: `request` (what a selection is asked), `presets` (configs/select/*.yaml), `reducer` (the
streaming top-k), `outputs` (subset.npy / .parquet / .json), `rules` (the rule interface and registry),
`union`, and the audits and explanations of a cut. The scores table itself (its schema, reader,
statistics, order-preserving keys and the weighted HYPE sum) is the core package `hype.table`; the uid
codec is `hype.data.uids`; the rules themselves are plug-ins (the bundled ones in the top-level `filters`
package) that register in `hype.select.rules.RULES`.
"""

from __future__ import annotations

from hype.select.errors import SelectError
from hype.select.run import SelectRequest, format_summary, select_subset

__all__ = ["SelectError", "SelectRequest", "select_subset", "format_summary"]
