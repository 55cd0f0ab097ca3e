"""Starting or joining Ray from a hype command: the Ray executor (`hype score`, `hype reshard`) and
`hype download --distributor ray` both call `init_ray`."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any


def init_ray(**kwargs: Any) -> None:
    """`ray.init(**kwargs)`, made from hype's own import root instead of the current folder.

    Ray puts the driver's current folder first on every worker's import path (and starts a local
    cluster's workers in it), so a `hype.py` or `filters.py` in the folder a user runs from would be
    imported inside the workers. hype's root holds only what the driver imports anyway, and workers are
    handed absolute paths, so the folder they start in changes nothing else."""
    import ray

    import hype

    with contextlib.chdir(Path(hype.__file__).resolve().parents[1]):
        ray.init(**kwargs)
