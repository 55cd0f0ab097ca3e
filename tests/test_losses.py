"""Losses: every geometry learns a toy problem; 2 gloo processes equal one process on the whole batch."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hype.geometry import GEOMETRIES, get_geometry
from hype.losses import ContrastiveEntailmentLoss, contrastive_loss

GEOMETRY_NAMES = sorted(GEOMETRIES)


def _geometry(name: str):
    return get_geometry(name, num_spheres=4) if name == "oblique" else get_geometry(name)


class ToyModel(torch.nn.Module):
    """Two linear 'towers' with the learnable log-scalars of DESIGN §2.1."""

    def __init__(self, geometry, d_in: int = 12, n: int = 16):
        super().__init__()
        self.geometry = geometry
        self.img = torch.nn.Linear(d_in, n)
        self.txt = torch.nn.Linear(d_in, n)
        self.log_scale = torch.nn.Parameter(torch.tensor(math.log(geometry.logit_scale_init)))
        self.log_curv = torch.nn.Parameter(torch.tensor(0.0))
        self.log_alpha = torch.nn.Parameter(torch.tensor(math.log(n**-0.5)))

    def forward(self, a, b):
        curv = self.log_curv.exp() if self.geometry.uses_curvature else None
        alpha = self.log_alpha.exp() if self.geometry.uses_alpha else None
        return {
            "image": self.geometry.embed(self.img(a), curv=curv, alpha=alpha),
            "text": self.geometry.embed(self.txt(b), curv=curv, alpha=alpha),
            "logit_scale": self.log_scale.exp(),
            "curv": curv,
        }


def toy_batch(n: int, seed: int, d_in: int = 12):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 6, generator=g)
    wa, wb = torch.randn(6, d_in, generator=g), torch.randn(6, d_in, generator=g)
    return z @ wa + 0.1 * torch.randn(n, d_in, generator=g), z @ wb + 0.1 * torch.randn(n, d_in, generator=g)


def _loss_fn(geometry):
    weight = 0.2 if geometry.supports_entailment else 0.0
    return ContrastiveEntailmentLoss(geometry, entailment_weight=weight)


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
def test_loss_decreases_on_a_toy_problem(name):
    torch.manual_seed(0)
    geometry = _geometry(name)
    model, loss_fn = ToyModel(geometry), _loss_fn(geometry)
    a, b = toy_batch(64, seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    losses = []
    for _ in range(80):
        out = loss_fn(model(a, b))
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(out["loss"].item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.5 * losses[0], (name, losses[0], losses[-1])
    if geometry.supports_entailment:
        assert set(out) == {"loss", "contrastive", "entailment"}


def test_contrastive_loss_equals_cross_entropy_by_hand():
    g = get_geometry("clip")
    img, txt = g.embed(torch.randn(5, 8)), g.embed(torch.randn(5, 8))
    logits = 10.0 * img @ txt.T
    labels = np.arange(5)
    lp = torch.log_softmax(logits, 1).numpy()
    lt = torch.log_softmax(logits.T, 1).numpy()
    expected = -(lp[labels, labels].mean() + lt[labels, labels].mean()) / 2
    assert contrastive_loss(img, txt, g, 10.0).item() == pytest.approx(expected, rel=1e-5)


def test_entailment_weight_is_validated():
    with pytest.raises(ValueError, match="no entailment cones"):
        ContrastiveEntailmentLoss(get_geometry("clip"), entailment_weight=0.2)
    with pytest.raises(ValueError, match=">= 0"):
        ContrastiveEntailmentLoss(get_geometry("hyperbolic"), entailment_weight=-1)


# ---------------------------------------------------------------- distributed equivalence
WORLD, PER_RANK = 2, 6
DDP_GEOMETRIES = ["clip", "hyperbolic", "euclidean-squared", "oblique"]


def _ddp_worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        a, b = toy_batch(WORLD * PER_RANK, seed=3)
        sl = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        for name in DDP_GEOMETRIES:
            torch.manual_seed(0)  # identical initial weights on every rank, as DDP guarantees
            geometry = _geometry(name)
            model = ToyModel(geometry)
            out = _loss_fn(geometry)(model(a[sl], b[sl]))
            out["loss"].backward()
            # What DDP does after backward: average parameter gradients and (for logging) the loss.
            for p in model.parameters():
                if p.grad is None:  # e.g. curvature of a non-hyperbolic geometry
                    continue
                dist.all_reduce(p.grad)
                p.grad /= WORLD
            loss = out["loss"].detach().clone()
            dist.all_reduce(loss)
            if rank == 0:
                grads = {k: p.grad.numpy() for k, p in model.named_parameters() if p.grad is not None}
                np.savez(os.path.join(out_dir, f"{name}.npz"), loss=(loss / WORLD).numpy(), **grads)
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_match_one_process_on_the_concatenated_batch(tmp_path):
    mp.spawn(_ddp_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    a, b = toy_batch(WORLD * PER_RANK, seed=3)
    for name in DDP_GEOMETRIES:
        torch.manual_seed(0)
        geometry = _geometry(name)
        model = ToyModel(geometry)
        out = _loss_fn(geometry)(model(a, b))
        out["loss"].backward()
        got = np.load(tmp_path / f"{name}.npz")
        # Contrastive terms are identical; the entailment term is a mean over local pairs, and the mean
        # of equal-size local means is the global mean, so the totals agree too.
        np.testing.assert_allclose(got["loss"], out["loss"].item(), rtol=1e-5, err_msg=name)
        for k, p in model.named_parameters():
            assert (k in got) == (p.grad is not None), (name, k)
            if p.grad is None:
                continue
            np.testing.assert_allclose(got[k], p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=f"{name}:{k}")
