"""NormSim_inf screens in float32 and recomputes only the pairs that could be a row's maximum: its values are
those of the maximum over every exact grid dot product (computed here with integers), ties and near ties
included; p=2 is the float64 sum of the same exact products' squares."""

from __future__ import annotations

import numpy as np
from test_negclip import _unit

from hype.filters.embeddings import grid_bits, grid_unit, on_grid
from hype.filters.normsim import BLOCK, norm_sim


def test_normsim_is_the_exact_grid_maximum_and_sum_with_ties():
    rng = np.random.default_rng(3)
    d = 96
    x = _unit(rng, 700, d)
    t = _unit(rng, BLOCK + 500, d).astype(np.float64)  # two blocks
    t[10:900] = t[5]  # many exact ties
    # near ties, closer than float32's error: for some rows near them the float32 maximum is another
    # target than the exact one (a screen without its error margin fails here)
    t[1000:1400] = t[1400] + 3e-7 * rng.standard_normal((400, d))
    x[300:] = t[1400] + 0.05 * rng.standard_normal((400, d))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    t[2000:2020], t[3000] = x[:20], -x[30]  # pool rows themselves, and one opposite
    qx, qt = on_grid(x).astype(np.int64), on_grid(t).astype(np.int64)
    exact = (qx @ qt.T).astype(np.float64)  # integer sums: |k| <= 2^(2b) d < 2^53, exact
    assert grid_bits(d) * 2 + np.log2(d) < 53
    blocks = lambda: iter([t[s : s + BLOCK] for s in range(0, len(t), BLOCK)])  # noqa: E731
    inf, rows = norm_sim(x, blocks(), "inf")
    assert rows == len(t)
    assert inf.tobytes() == (np.abs(exact).max(axis=1) * grid_unit(d)).tobytes()
    two, _ = norm_sim(x, blocks(), "2")
    want = np.zeros(len(x))
    for s in range(0, len(t), BLOCK):  # the rule's block order
        sims = exact[:, s : s + BLOCK] * grid_unit(d)
        want += np.add.reduce(sims * sims, axis=1)
    assert two.tobytes() == np.sqrt(want).tobytes()
