"""Geometry: one module per space (lorentz, euclidean, sphere, oblique) and the model geometries.

All functions compute in fp32 (fp64 for fp64 inputs) with autocast off; see `_numerics` for every
clamp and why it is there.
"""

from hype.geometry import euclidean, lorentz, oblique, sphere
from hype.geometry.registry import GEOMETRIES, Geometry, get_geometry

__all__ = ["GEOMETRIES", "Geometry", "euclidean", "get_geometry", "lorentz", "oblique", "sphere"]
