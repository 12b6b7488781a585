"""``vllm.distributed.parallel_state``: the process groups a backend asks for. The
adapter runs a legacy backend on one rank's shard, so every group has world size 1
(tensor and context parallelism happen outside the backend, in the runner)."""

from __future__ import annotations

import torch

__all__ = [
    "GroupCoordinator",
    "get_dcp_group",
    "get_pcp_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
]


class GroupCoordinator:
    """A process group of one: collectives return their input."""

    world_size: int = 1
    rank_in_group: int = 0
    rank: int = 0
    ranks: list[int] = [0]
    local_rank: int = 0

    def __init__(self, name: str) -> None:
        self.unique_name = name

    @property
    def is_first_rank(self) -> bool:
        return True

    @property
    def is_last_rank(self) -> bool:
        return True

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return input_

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        return input_

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return input_

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        return input_


_TP = GroupCoordinator("tp")
_DCP = GroupCoordinator("dcp")
_PCP = GroupCoordinator("pcp")


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_dcp_group() -> GroupCoordinator:
    """Decode-context-parallel group: world size 1 (the adapter runs one rank's shard)."""
    return _DCP


def get_pcp_group() -> GroupCoordinator:
    return _PCP


def get_tensor_model_parallel_world_size() -> int:
    return 1


def get_tensor_model_parallel_rank() -> int:
    return 0
