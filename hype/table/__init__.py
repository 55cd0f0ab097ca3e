"""The scores table: the contract between `hype score`, which writes it, and every command that reads it
(`hype select`, `explain`, `report`, `submit`, the filters, and scoring's own quality table).

Modules: `schema` (the columns and where a run keeps the table), `reader` (`ScoresTable`: bounded-memory
passes over a local or bucket table, several runs read as one), `combine` (the weighted HYPE sum and its
pool normalizations), `stats` (streaming per-column statistics) and `keys` (order-preserving integer keys
of floats and the histograms built on them). Its one error type, `SelectError`, lives in
`hype.data.errors`, below it.
"""
