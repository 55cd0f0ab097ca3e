"""One optimization step's gradients: forward, global-batch loss, backward, with gradient accumulation.

Accumulation follows open_clip: a first pass computes every micro-batch's embeddings without gradients;
then each micro-batch is recomputed with gradients and its slice replaced in the accumulated batch before
the loss over the whole (global) batch is taken, so the negatives are those of the full batch. Every
recomputation goes through the model's forward, so α and the exponential map (which depend on the
learnable scalars) are applied with gradients to the fresh slice rather than taken from the cache.

open_clip's version gives the scalars used directly by the loss (logit scale; curvature in the distance)
their gradient once per micro-batch, i.e. `accum_steps` times too large. Here they enter the loss
detached in all but the last recomputation, so the summed gradient equals the full-batch gradient
exactly: each slice's embedding path is counted once, and the direct scalar path once.

The towers run under autocast (bf16/fp16); the model lifts their output to fp32 before the geometry, and
the loss runs with autocast off, in fp32 (DESIGN §2.5).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from hype.losses import ContrastiveEntailmentLoss

Tensor = torch.Tensor

LOSS_TERMS = ("loss", "contrastive", "entailment")


def autocast_for(precision: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of autocast contexts for the towers (a no-op for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def _loss(loss_fn: ContrastiveEntailmentLoss, out: dict, device: torch.device) -> dict[str, Tensor]:
    with torch.autocast(device_type=device.type, enabled=False):
        return loss_fn(out)


def _terms(losses: dict[str, Tensor]) -> Tensor:
    """(loss, contrastive, entailment) as one detached fp32 vector (entailment 0 when absent)."""
    zero = torch.zeros((), device=losses["loss"].device)
    return torch.stack([losses.get(k, zero).detach().float() for k in LOSS_TERMS])


def forward_backward(
    model: nn.Module,
    loss_fn: ContrastiveEntailmentLoss,
    images: Tensor,
    tokens: Tensor,
    *,
    accum_steps: int = 1,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    scaler: torch.amp.GradScaler | None = None,
    check: Callable[[Tensor], None] | None = None,
    inject_nan: bool = False,
) -> Tensor:
    """Accumulate the gradients of the loss over this rank's batch into `.grad`; return the detached
    loss terms `(loss, contrastive, entailment)`.

    `model` may be wrapped in DistributedDataParallel (gradients are then synchronised once, on the
    last micro-batch). `check(terms)` is called before any backward pass and may raise to abort the
    step (non-finite loss); `inject_nan` makes the loss NaN (a test hook).
    """
    device = images.device
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)

    def backward(loss: Tensor) -> None:
        (scaler.scale(loss) if scaler is not None else loss).backward()

    def finish(losses: dict[str, Tensor]) -> Tensor:
        if inject_nan:
            losses["loss"] = losses["loss"] * float("nan")
        terms = _terms(losses)
        if check is not None:
            check(terms)
        return terms

    if accum_steps == 1:
        with autocast():
            out = model(images, tokens)
        losses = _loss(loss_fn, out, device)
        terms = finish(losses)
        backward(losses["loss"])
        return terms

    if images.shape[0] % accum_steps:
        raise ValueError(f"batch of {images.shape[0]} does not split into {accum_steps} micro-batches")
    micro_images, micro_tokens = images.chunk(accum_steps), tokens.chunk(accum_steps)
    cached_img, cached_txt = [], []
    with torch.no_grad(), autocast():
        for mi, mt in zip(micro_images, micro_tokens, strict=True):
            out = model(mi, mt)
            cached_img.append(out["image"])
            cached_txt.append(out["text"])
    terms = None
    for j in range(accum_steps):
        last = j == accum_steps - 1
        sync = contextlib.nullcontext() if (last or not ddp) else model.no_sync()
        with sync:
            with autocast():
                out = model(micro_images[j], micro_tokens[j])
            full = {
                "image": torch.cat(cached_img[:j] + [out["image"]] + cached_img[j + 1 :]),
                "text": torch.cat(cached_txt[:j] + [out["text"]] + cached_txt[j + 1 :]),
                # The loss's direct dependence on the scalars is counted in the last pass only.
                "logit_scale": out["logit_scale"] if last else out["logit_scale"].detach(),
                "curv": out["curv"] if (last or out["curv"] is None) else out["curv"].detach(),
            }
            losses = _loss(loss_fn, full, device)
            if j == 0:  # every pass computes the same full-batch value; check it once
                terms = finish(losses)
            backward(losses["loss"])
    return terms
