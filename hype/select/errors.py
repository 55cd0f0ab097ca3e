"""The one error type of selection, resharding, reports and submissions."""

from __future__ import annotations


class SelectError(ValueError):
    """Bad input to `hype select` / `reshard` / `report` / `submit`.

    The message names the file, column or value at fault and says how to fix it; the CLI prints it as is.
    """
