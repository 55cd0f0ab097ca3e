"""Global-batch helpers: a differentiable all-gather and this rank's row offset."""

from __future__ import annotations

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def world() -> tuple[int, int]:
    """(rank, world_size); (0, 1) when torch.distributed is not initialized."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _GatherWithGrad(torch.autograd.Function):
    """all_gather whose backward sums every rank's gradient for this rank's slice.

    Summing (all_reduce, then slicing) rather than reduce_scatter keeps it working on gloo. With DDP's
    gradient averaging on top, the parameter gradients equal those of one process holding the whole
    batch.
    """

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        rank, size = world()
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous())
        ctx.rank, ctx.n = rank, x.shape[0]
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n]


def gather_with_grad(x: Tensor) -> Tensor:
    """Concatenate `x` from every rank along dim 0 (identity on one process), differentiably.

    Every rank must hold the same number of rows; the trainer drops incomplete last batches.
    """
    _, size = world()
    if size == 1:
        return x
    n = torch.tensor([x.shape[0]], device=x.device)
    sizes = [torch.empty_like(n) for _ in range(size)]
    dist.all_gather(sizes, n)
    if len({int(s) for s in sizes}) != 1:
        raise ValueError(
            f"every rank needs the same batch size for the global loss, got {[int(s) for s in sizes]}"
        )
    return _GatherWithGrad.apply(x)
