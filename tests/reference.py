"""Independent references of the DESIGN §2 formulas for the tests: float64 numpy, and mpmath for fp32 regimes.

Exterior angles go through the law of cosines on distances (MERU App. C), a different route than the
closed forms under test.
"""

import numpy as np


def r_time(x, c):
    return np.sqrt(1 / c + (x * x).sum(-1))


def r_inner(x, y, c):
    return (x * y).sum(-1) - r_time(x, c) * r_time(y, c)


def r_dist(x, y, c):
    return np.arccosh(np.maximum(-c * r_inner(x, y, c), 1.0)) / np.sqrt(c)


def r_exp0(v, c):
    n = np.linalg.norm(v, axis=-1, keepdims=True)
    return np.sinh(np.sqrt(c) * n) / (np.sqrt(c) * n) * v


def r_aper(x, c, K):
    return np.arcsin(np.minimum(1.0, 2 * K / (np.sqrt(c) * np.linalg.norm(x, axis=-1))))


def r_ext_law_of_cosines(x, y, c):
    """π - angle Oxy from the hyperbolic law of cosines on the three side lengths."""
    o = np.zeros_like(x)
    a, b, s = r_dist(o, x, c), r_dist(x, y, c), r_dist(o, y, c)  # |Ox|, |xy|, |Oy|
    rc = np.sqrt(c)
    cos_oxy = (np.cosh(rc * a) * np.cosh(rc * b) - np.cosh(rc * s)) / (np.sinh(rc * a) * np.sinh(rc * b))
    return np.pi - np.arccos(np.clip(cos_oxy, -1, 1))


def r_euc_ext(x, y):
    """π - angle Oxy from the Euclidean law of cosines."""
    a, b, s = np.linalg.norm(x, axis=-1), np.linalg.norm(y - x, axis=-1), np.linalg.norm(y, axis=-1)
    return np.pi - np.arccos(np.clip((a * a + b * b - s * s) / (2 * a * b), -1, 1))


# ---------------------------------------------------------------- mpmath, for the fp32 regimes
# Rows of float64 arrays (holding exact fp32 values) evaluated at 50 significant digits with the textbook
# formulas: cancellation that ruins fp32 (far-apart points, near-identical points, angles near 0) costs
# at most ~20 of those digits, so the results are exact to float64 precision. Slow: a few thousand rows.
import mpmath  # noqa: E402

_DPS = 50


def _rows(fn):
    def wrapper(*arrays_and_args):
        with mpmath.workdps(_DPS):
            arrays = [a for a in arrays_and_args if isinstance(a, np.ndarray)]
            args = [a for a in arrays_and_args if not isinstance(a, np.ndarray)]
            n = arrays[0].shape[0]
            return np.array([float(fn(*(_mpvec(a[i]) for a in arrays), *args)) for i in range(n)])

    return wrapper


def _mpvec(v):
    return [mpmath.mpf(float(e)) for e in v]


def _dot(u, v):
    return mpmath.fsum(a * b for a, b in zip(u, v, strict=False))


def _mp_dist(x, y, c):
    c = mpmath.mpf(c)
    xt, yt = mpmath.sqrt(1 / c + _dot(x, x)), mpmath.sqrt(1 / c + _dot(y, y))
    return mpmath.acosh(max(c * (xt * yt - _dot(x, y)), mpmath.mpf(1))) / mpmath.sqrt(c)


@_rows
def mp_dist(x, y, c):
    """Row-wise Lorentz distance acosh(-c<x,y>_L) / sqrt(c)."""
    return _mp_dist(x, y, c)


@_rows
def mp_ext(x, y, c):
    """Row-wise exterior angle at x of the triangle O-x-y from the hyperbolic law of cosines."""
    rc, o = mpmath.sqrt(mpmath.mpf(c)), [mpmath.mpf(0)] * len(x)
    a, b, s = (rc * _mp_dist(p, q, c) for p, q in ((o, x), (x, y), (o, y)))
    cos_oxy = (mpmath.cosh(a) * mpmath.cosh(b) - mpmath.cosh(s)) / (mpmath.sinh(a) * mpmath.sinh(b))
    return mpmath.pi - mpmath.acos(min(max(cos_oxy, -1), 1))


@_rows
def mp_aper(x, c, K):
    return mpmath.asin(min(mpmath.mpf(1), 2 * K / (mpmath.sqrt(c) * mpmath.sqrt(_dot(x, x)))))


@_rows
def mp_euc_dist(x, y):
    d = [a - b for a, b in zip(x, y, strict=False)]
    return mpmath.sqrt(_dot(d, d))


@_rows
def mp_euc_ext(x, y):
    """π - angle Oxy from the Euclidean law of cosines."""
    d = [b - a for a, b in zip(x, y, strict=False)]
    a2, b2, s2 = _dot(x, x), _dot(d, d), _dot(y, y)
    cos_oxy = (a2 + b2 - s2) / (2 * mpmath.sqrt(a2) * mpmath.sqrt(b2))
    return mpmath.pi - mpmath.acos(min(max(cos_oxy, -1), 1))


@_rows
def mp_sphere_geodesic(x, y):
    cos = _dot(x, y) / mpmath.sqrt(_dot(x, x) * _dot(y, y))
    return mpmath.acos(min(max(cos, -1), 1))
