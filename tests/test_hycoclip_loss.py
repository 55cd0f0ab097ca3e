"""HyCoCLIP's loss (SPEC §2.6) against an independent float64 reference of the paper's formulas."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference import r_aper, r_dist, r_exp0, r_ext_law_of_cosines

from hype.geometry import get_geometry
from hype.losses.hycoclip import HyCoCLIPLoss


def _log_softmax_ce(logits: np.ndarray) -> float:
    """Mean cross-entropy with the diagonal as targets."""
    m = logits.max(1, keepdims=True)
    lse = np.log(np.exp(logits - m).sum(1)) + m[:, 0]
    return float((lse - np.diag(logits)).mean())


def reference_loss(I, T, Ib, Tb, c, s, K, w, inter=0.7, intra=1.2):
    """The paper's loss written from SPEC §2.6, with distances and angles of tests/reference.py (the
    exterior angle from the hyperbolic law of cosines, not the closed form under test)."""

    def logits(rows, cols):  # -s d_L(row_i, col_j)
        return -s * np.array([[r_dist(r, col, c) for col in cols] for r in rows])

    contrastive = (
        _log_softmax_ce(logits(I, T))
        + _log_softmax_ce(logits(T, I))
        + _log_softmax_ce(logits(Ib, T))
        + _log_softmax_ce(logits(Tb, I))
    ) / 4

    def E(apex, point, m):
        return float(np.maximum(r_ext_law_of_cosines(apex, point, c) - m * r_aper(apex, c, K), 0).mean())

    entail = (E(T, I, inter) + E(Tb, Ib, inter) + E(Ib, I, intra) + E(Tb, T, intra)) / 2
    return contrastive + w * entail, contrastive, entail


def _points(seed: int, n: int = 6, d: int = 5, c: float = 1.3):
    rng = np.random.default_rng(seed)
    # Texts near the origin (wide cones), images further out; boxes between their whole and the origin, so
    # some cone constraints hold and some do not: every relu branch is exercised.
    T = r_exp0(rng.normal(size=(n, d)) * 0.15, c)
    I = r_exp0(rng.normal(size=(n, d)) * 0.6, c)
    Tb = r_exp0(rng.normal(size=(n, d)) * 0.08, c)
    Ib = r_exp0(rng.normal(size=(n, d)) * 0.4, c)
    return I, T, Ib, Tb, c


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hycoclip_loss_equals_the_papers_formula_in_float64(seed):
    I, T, Ib, Tb, c = _points(seed)
    s, K, w = 7.0, 0.1, 0.2
    want = reference_loss(I, T, Ib, Tb, c, s, K, w)
    out = {
        "image": torch.from_numpy(np.concatenate([I, Ib])),
        "text": torch.from_numpy(np.concatenate([T, Tb])),
        "curv": torch.tensor(c, dtype=torch.float64),
        "logit_scale": torch.tensor(s, dtype=torch.float64),
    }
    got = HyCoCLIPLoss(get_geometry("hyperbolic"), entailment_weight=w, K=K)(out)
    assert want[2] > 0  # some cone is violated: the entailment branch is live
    np.testing.assert_allclose(
        [got["loss"].item(), got["contrastive"].item(), got["entailment"].item()], want, rtol=1e-9
    )


def test_hycoclip_gradients_are_finite_and_reach_every_input():
    I, T, Ib, Tb, c = _points(3)
    image = torch.tensor(np.concatenate([I, Ib]), dtype=torch.float32, requires_grad=True)
    text = torch.tensor(np.concatenate([T, Tb]), dtype=torch.float32, requires_grad=True)
    curv = torch.tensor(c, requires_grad=True)
    scale = torch.tensor(10.0, requires_grad=True)
    out = HyCoCLIPLoss(get_geometry("hyperbolic"))(
        {"image": image, "text": text, "curv": curv, "logit_scale": scale}
    )
    out["loss"].backward()
    for g in (image.grad, text.grad, curv.grad, scale.grad):
        assert torch.isfinite(g).all()
    assert image.grad[6:].abs().sum() > 0 and text.grad[6:].abs().sum() > 0  # the box rows learn


def test_hycoclip_loss_refuses_a_non_hyperbolic_model_and_an_odd_batch():
    with pytest.raises(ValueError, match="hyperbolic"):
        HyCoCLIPLoss(get_geometry("clip"))
    loss = HyCoCLIPLoss(get_geometry("hyperbolic"))
    x = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="2B rows"):
        loss({"image": x, "text": x, "curv": torch.tensor(1.0), "logit_scale": torch.tensor(1.0)})


def test_rows_without_a_box_train_only_their_whole_pair():
    I, T, Ib, Tb, c = _points(4)
    keep = np.array([True, False, True, True, False, True])
    s, K, w = 5.0, 0.1, 0.2
    loss = HyCoCLIPLoss(get_geometry("hyperbolic"), entailment_weight=w, K=K, box_mask=torch.from_numpy(keep))
    got = loss(
        {
            "image": torch.from_numpy(np.concatenate([I, Ib])),
            "text": torch.from_numpy(np.concatenate([T, Tb])),
            "curv": torch.tensor(c, dtype=torch.float64),
            "logit_scale": torch.tensor(s, dtype=torch.float64),
        }
    )

    # The reference: whole terms over every row; box terms over the boxed rows, still against every whole.
    def logits(rows, cols):
        return -s * np.array([[r_dist(r, col, c) for col in cols] for r in rows])

    def ce(lg, targets):
        m = lg.max(1, keepdims=True)
        return float((np.log(np.exp(lg - m).sum(1)) + m[:, 0] - lg[np.arange(len(lg)), targets]).mean())

    idx = np.flatnonzero(keep)
    contrastive = (
        _log_softmax_ce(logits(I, T))
        + _log_softmax_ce(logits(T, I))
        + ce(logits(Ib[idx], T), idx)
        + ce(logits(Tb[idx], I), idx)
    ) / 4

    def E(apex, point, m):
        return float(np.maximum(r_ext_law_of_cosines(apex, point, c) - m * r_aper(apex, c, K), 0).mean())

    entail = (E(T, I, 0.7) + E(Tb[idx], Ib[idx], 0.7) + E(Ib[idx], I[idx], 1.2) + E(Tb[idx], T[idx], 1.2)) / 2
    np.testing.assert_allclose(
        [got["contrastive"].item(), got["entailment"].item()], [contrastive, entail], rtol=1e-9
    )
