"""Geometry: one module per space (lorentz, euclidean, sphere, oblique) and the model geometries.

All functions compute in fp32 (fp64 for fp64 inputs) with autocast off; see `_numerics` for every
clamp and why it is there. `exact` holds the numpy-only, machine-independent products of the searches.

The names below load on first use (PEP 562), so that importing `hype.geometry.exact` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["GEOMETRIES", "Geometry", "euclidean", "get_geometry", "lorentz", "oblique", "sphere"]
_REGISTRY = ("GEOMETRIES", "Geometry", "get_geometry")


def __getattr__(name: str) -> Any:
    if name in _REGISTRY:
        return getattr(importlib.import_module("hype.geometry.registry"), name)
    if name in __all__:
        return importlib.import_module(f"hype.geometry.{name}")
    raise AttributeError(f"module 'hype.geometry' has no attribute {name!r}")
