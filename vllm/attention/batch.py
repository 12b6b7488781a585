"""Build a paged batch (block tables, metadata, slot mappings) for tests, the
conformance kit and benchmarks. The runner has its own allocator; this one
places each request's blocks at random, distinct block ids, never block 0 (the null
block, as in vLLM: block-table padding points there)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.attention.backend import CommonAttentionMetadata
from vllm.attention.errors import InvalidArgumentError


@dataclass(frozen=True)
class PagedBatch:
    """A batch of requests placed in a paged cache.

    ``new_slots``: int64 ``[sum(query_lens)]`` slots of this step's tokens.
    ``context_slots``: int64 ``[sum(context_lens)]`` slots of earlier tokens.
    ``positions``: int64 ``[sum(query_lens)]`` position of each new token.
    """

    common: CommonAttentionMetadata
    new_slots: torch.Tensor
    context_slots: torch.Tensor
    positions: torch.Tensor
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    num_blocks: int


def make_paged_batch(
    query_lens: list[int] | tuple[int, ...],
    context_lens: list[int] | tuple[int, ...],
    *,
    block_size: int,
    num_blocks: int | None = None,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
    causal: bool = True,
) -> PagedBatch:
    """Requests ``i`` with ``context_lens[i]`` cached tokens and ``query_lens[i]`` new ones."""
    if len(query_lens) != len(context_lens):
        raise InvalidArgumentError(
            "context_lens", len(context_lens), f"{len(query_lens)} entries (one per request)"
        )
    dev = torch.device(device)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    blocks_per = [-(-s // block_size) for s in seq_lens]
    needed = sum(blocks_per)
    total = max(needed + 1, num_blocks or 0)
    if num_blocks is not None and num_blocks < needed:
        raise InvalidArgumentError("num_blocks", num_blocks, f">= {needed} for this batch")
    # block 0 is the null block (vLLM's convention): never given to a request
    perm = (torch.randperm(total - 1, generator=generator) + 1).tolist()
    width = max(blocks_per + [1])
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    new_slots: list[int] = []
    ctx_slots: list[int] = []
    positions: list[int] = []
    at = 0
    for i, (q, c) in enumerate(zip(query_lens, context_lens)):
        ids = perm[at: at + blocks_per[i]]
        at += blocks_per[i]
        table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        for pos in range(c + q):
            slot = ids[pos // block_size] * block_size + pos % block_size
            (ctx_slots if pos < c else new_slots).append(slot)
            if pos >= c:
                positions.append(pos)
    qsl = torch.tensor([0] + list(torch.tensor(list(query_lens)).cumsum(0).tolist()),
                       dtype=torch.int32) if query_lens else torch.zeros(1, dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(dev), seq_lens=sl.to(dev), block_table=table.to(dev),
        query_start_loc_cpu=qsl, seq_lens_cpu=sl, num_reqs=len(seq_lens),
        num_actual_tokens=sum(query_lens), max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0), block_size=block_size, causal=causal,
    )
    return PagedBatch(
        common=common,
        new_slots=torch.tensor(new_slots, dtype=torch.int64, device=dev),
        context_slots=torch.tensor(ctx_slots, dtype=torch.int64, device=dev),
        positions=torch.tensor(positions, dtype=torch.int64, device=dev),
        query_lens=tuple(query_lens), context_lens=tuple(context_lens), num_blocks=total,
    )
