"""Paged KV-cache bookkeeping: a block allocator per KV-cache group and each
request's block list in every group.

A *KV-cache group* is a set of attention layers with the same cache spec
(backend, block size, heads, head size, cache dtype): they share one block table,
one metadata object and one slot-mapping tensor per step. Each layer still has its
own cache tensor.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.attention.backend import AttentionBackend, AttentionMetadataBuilder
from vllm.attention.errors import InvalidArgumentError


NULL_BLOCK = 0
"""Block 0 of every cache: zeroed and never allocated (vLLM's null block). Block-table
padding points there, so a kernel (or a legacy backend) that reads a padded entry reads
zeros, and a write that wraps is caught by the conformance kit, not hidden in a request's
block."""


class BlockAllocator:
    """Free-list allocator of block ids ``1..num_blocks`` (``num_blocks`` usable blocks;
    the cache holds one more, :data:`NULL_BLOCK`)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise InvalidArgumentError("num_blocks", num_blocks, "a positive int")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(NULL_BLOCK + 1, num_blocks + 1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise InvalidArgumentError("blocks requested", n, f"<= {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


@dataclass(frozen=True)
class KVCacheSpec:
    """What makes layers share a group."""

    backend: type[AttentionBackend[Any]]
    block_size: int
    num_kv_heads: int
    head_size: int
    kv_cache_dtype: str


@dataclass
class KVCacheGroup:
    group_id: int
    spec: KVCacheSpec
    layer_names: list[str]
    builder: AttentionMetadataBuilder[Any]
    allocator: BlockAllocator
    blocks: dict[int, list[int]] = field(default_factory=dict)
    """request id -> its block ids, in position order."""

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def blocks_needed(self, req_id: int, num_tokens: int) -> int:
        have = len(self.blocks.get(req_id, ()))
        return max(-(-num_tokens // self.block_size) - have, 0)

    def slots(self, req_id: int, start: int, stop: int) -> list[int]:
        """Slots of positions ``start..stop-1`` of the request."""
        ids, bs = self.blocks[req_id], self.block_size
        return [ids[p // bs] * bs + p % bs for p in range(start, stop)]


class KVCacheManager:
    """Allocates all groups together: a request fits only if every group has room."""

    def __init__(self, groups: list[KVCacheGroup]) -> None:
        self.groups = groups

    def allocate(self, req_id: int, num_tokens: int) -> bool:
        """Grow the request to hold ``num_tokens`` tokens; False (nothing changed) if
        some group lacks free blocks."""
        need = [g.blocks_needed(req_id, num_tokens) for g in self.groups]
        if any(n > g.allocator.num_free for n, g in zip(need, self.groups)):
            return False
        for n, g in zip(need, self.groups):
            if n:
                g.blocks.setdefault(req_id, []).extend(g.allocator.allocate(n))
        return True

    def free(self, req_id: int) -> None:
        for g in self.groups:
            g.allocator.free(g.blocks.pop(req_id, []))

    def capacity_tokens(self) -> int:
        """Tokens one request could hold with every block free."""
        return min(g.allocator.num_blocks * g.block_size for g in self.groups)

    def block_table(self, group: KVCacheGroup, req_ids: list[int],
                    device: torch.device) -> tuple[torch.Tensor, int]:
        """``[num_reqs, max_blocks]`` int32 (rows padded with 0) and its width."""
        width = max([len(group.blocks.get(r, ())) for r in req_ids] + [1])
        table = torch.zeros(len(req_ids), width, dtype=torch.int32)
        for i, r in enumerate(req_ids):
            ids = group.blocks.get(r, [])
            if ids:
                table[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        return table.to(device), width
