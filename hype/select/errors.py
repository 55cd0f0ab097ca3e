"""The one error type of selection, resharding, reports and submissions (defined in `hype.data.errors`,
the lowest layer that raises it; re-exported here, where selection code and callers look for it)."""

from __future__ import annotations

from hype.data.errors import SelectError

__all__ = ["SelectError"]
