"""Process-group setup for `torchrun` (NCCL on GPU, gloo on CPU) and the device of this rank."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _device(pref: str, local_rank: int) -> torch.device:
    if pref == "auto":
        pref = "cuda" if torch.cuda.is_available() else "cpu"
    if pref.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(f"device={pref!r} but CUDA is not available; use device=cpu or device=auto")
        device = torch.device(pref if ":" in pref else f"cuda:{local_rank}")
        torch.cuda.set_device(device)
        return device
    return torch.device(pref)


def init_distributed(device_pref: str) -> DistInfo:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1); a single process otherwise."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _device(device_pref, local_rank)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend, rank=rank, world_size=world_size, device_id=device if backend == "nccl" else None
        )
    return DistInfo(rank, world_size, local_rank, device)


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_from_main(obj: Any, info: DistInfo) -> Any:
    """Rank 0's `obj` on every rank (plain data only: it travels pickled between our own processes)."""
    if not info.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=info.device if info.device.type == "cuda" else None)
    return box[0]


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def cleanup(info: DistInfo) -> None:
    if info.distributed and dist.is_initialized():
        dist.destroy_process_group()
