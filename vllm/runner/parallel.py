"""Tensor parallelism on ``torch.distributed``: the rank's share of heads and the
two collectives the model needs (an all-reduce after each row-parallel matmul,
a broadcast of the sampled tokens from rank 0).

Started by ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``
in the environment): gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vllm.attention.errors import InvalidArgumentError


@dataclass(frozen=True)
class ParallelState:
    """This process's place in the tensor-parallel group (``world_size == 1``: none)."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples, prints and reports."""
        return self.rank == 0

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """``(start, size)`` of this rank's contiguous share of ``total`` ``what``."""
        if total % self.world_size:
            raise InvalidArgumentError(
                what, total, f"a multiple of the tensor-parallel size {self.world_size}"
            )
        size = total // self.world_size
        return self.rank * size, size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; a no-op on one rank."""
        if self.world_size > 1:
            dist.all_reduce(t)
        return t

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` on every rank, in place; a no-op on one rank."""
        if self.world_size > 1:
            dist.broadcast(t, src=0)
        return t

    def all_equal(self, value: int) -> bool:
        """True when every rank passes the same ``value`` (a cheap consistency check)."""
        if self.world_size == 1:
            return True
        t = torch.tensor([value, -value], dtype=torch.int64, device=_collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t[0]) == value and int(t[1]) == -value


def _collective_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def torchrun_world_size() -> int:
    """``WORLD_SIZE`` as ``torchrun`` sets it (1 when not under torchrun)."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        size = int(raw)
    except ValueError:
        raise InvalidArgumentError("WORLD_SIZE", raw, "a positive int (set by torchrun)") from None
    if size <= 0:
        raise InvalidArgumentError("WORLD_SIZE", size, "a positive int (set by torchrun)")
    return size


def init_tensor_parallel(device: torch.device) -> tuple[ParallelState, torch.device]:
    """Join the process group ``torchrun`` describes; returns the state and this
    rank's device (``cuda:LOCAL_RANK`` on CUDA). One process: no group at all."""
    world = torchrun_world_size()
    if world == 1:
        return ParallelState(), device
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if device.type == "cuda":
            dist.init_process_group(backend, device_id=device)
        else:
            dist.init_process_group(backend)
    if dist.get_world_size() != world:
        raise InvalidArgumentError("WORLD_SIZE", world,
                                   f"the process group's size {dist.get_world_size()}")
    return ParallelState(rank=dist.get_rank(), world_size=world), device


def shutdown_tensor_parallel(state: ParallelState) -> None:
    if state.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
