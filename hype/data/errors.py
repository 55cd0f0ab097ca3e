"""The error of the commands that work on subsets: `hype select`, `reshard`, `report` and `submit` (and of
`hype train --subset`, whose subset file is read by `hype.data.uids.load_uid_file`).

It lives here, below those stages, because each of them raises it (as does `hype.data.uids.load_uid_file`)
and one stage must not import another just to share an error type; `hype.select.errors` re-exports it.
"""

from __future__ import annotations


class SelectError(ValueError):
    """Bad input to `hype select` / `reshard` / `report` / `submit`, or an unusable `train --subset` file.

    The message names the file, column or value at fault and says how to fix it; the CLI prints it as is.
    """
