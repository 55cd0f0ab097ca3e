"""Independent float64 (numpy) implementations of the SPEC formulas, shared by the tests.

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
