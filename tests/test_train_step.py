"""hype.train.step: gradient accumulation equals the full batch exactly; mixed precision; NaN checks."""

from __future__ import annotations

import pytest
import torch

from hype.losses import ContrastiveEntailmentLoss
from hype.models import create_model, load_model_config
from hype.train.step import autocast_for, forward_backward

CAPTIONS = [f"{n} {c} squares" for n in ("one", "two", "three", "four") for c in ("red", "blue", "green")]


def micro(name: str) -> dict:
    """A tiny-<geometry> config shrunk to one layer of width 32 at 32 px (fast on CPU)."""
    d = load_model_config(name).to_dict()
    d["embed_dim"] = 32
    d["vision"].update(image_size=32, width=32, layers=1, head_width=16)
    d["text"].update(width=32, heads=2, layers=1, context_length=16)
    return d


def batch(model, n: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    size = model.config.vision.image_size
    images = torch.randn(n, 3, size, size, generator=g)
    tokens = model.tokenizer()(CAPTIONS[:n])
    return images, tokens


def grads_for(model, loss_fn, images, tokens, accum: int, **kw) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    forward_backward(model, loss_fn, images, tokens, accum_steps=accum, **kw)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("geometry", ["hyperbolic", "clip", "euclidean-squared"])
def test_accumulation_gives_the_full_batch_gradient(geometry):
    torch.manual_seed(0)
    model = create_model(micro(f"tiny-{geometry}")).double()
    cfg = model.config.loss
    loss_fn = ContrastiveEntailmentLoss(model.geometry, cfg.entailment_weight or 0.0, cfg.entailment_K)
    images, tokens = batch(model)
    images = images.double()
    full = grads_for(model, loss_fn, images, tokens, 1)
    for accum in (2, 4):
        acc = grads_for(model, loss_fn, images, tokens, accum)
        assert acc.keys() == full.keys()
        for name in full:
            torch.testing.assert_close(acc[name], full[name], rtol=1e-9, atol=1e-12, msg=name)
    scalars = ["log_logit_scale"]
    if geometry == "hyperbolic":
        scalars += ["log_curv", "log_alpha_img", "log_alpha_txt"]
    for name in scalars:
        assert full[name].abs() > 0, f"{name} gets no gradient: the test would not see a double count"


def test_accumulation_needs_a_divisible_batch():
    model = create_model(micro("tiny-clip"))
    loss_fn = ContrastiveEntailmentLoss(model.geometry)
    images, tokens = batch(model, 6)
    with pytest.raises(ValueError, match="does not split into 4"):
        forward_backward(model, loss_fn, images, tokens, accum_steps=4)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_keeps_geometry_and_loss_in_fp32(precision):
    torch.manual_seed(0)
    model = create_model(micro("tiny-hyperbolic"))
    cfg = model.config.loss
    loss_fn = ContrastiveEntailmentLoss(model.geometry, cfg.entailment_weight, cfg.entailment_K)
    images, tokens = batch(model)
    autocast = autocast_for(precision, torch.device("cpu"))
    with autocast():
        out = model(images, tokens)
    assert out["image"].dtype == torch.float32 and out["text"].dtype == torch.float32
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    full = grads_for(model, loss_fn, images, tokens, 1)
    mixed = grads_for(model, loss_fn, images, tokens, 2, autocast=autocast, scaler=scaler)
    if scaler is not None:
        inv = 1.0 / scaler.get_scale()
        mixed = {k: v * inv for k, v in mixed.items()}
    for name in ("log_logit_scale", "log_curv", "visual.proj", "text.text_projection"):
        assert torch.isfinite(mixed[name]).all()
        torch.testing.assert_close(mixed[name], full[name], rtol=0.1, atol=2e-3, msg=name)


def test_check_hook_sees_the_loss_before_backward_and_nan_injection():
    model = create_model(micro("tiny-clip"))
    loss_fn = ContrastiveEntailmentLoss(model.geometry)
    images, tokens = batch(model)
    seen = []

    def check(terms):
        seen.append(terms.clone())
        if not torch.isfinite(terms).all():
            raise FloatingPointError("stop")

    model.zero_grad(set_to_none=True)
    terms = forward_backward(model, loss_fn, images, tokens, check=check)
    assert torch.equal(terms, seen[0]) and torch.isfinite(terms).all() and terms[2] == 0
    model.zero_grad(set_to_none=True)
    with pytest.raises(FloatingPointError):
        forward_backward(model, loss_fn, images, tokens, accum_steps=2, check=check, inject_nan=True)
    assert all(p.grad is None for p in model.parameters()), "no backward may run on a NaN loss"
