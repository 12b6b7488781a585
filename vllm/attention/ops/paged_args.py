"""What every paged compute path checks and reads of a batch (below the paths, so
the torch, Triton, flash-varlen and flex modules share it without importing each other).

Batch convention (as :class:`~vllm.attention.backend.CommonAttentionMetadata`):
request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``, which
are the last ``q_len`` of its ``seq_lens[i]`` positions; its positions live in
the blocks ``block_table[i, :]``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from vllm.attention.errors import InvalidArgumentError
from vllm.attention.ops.paged_kv import PagedKV


class PagedBatchLike(Protocol):
    """What the compute paths read from a batch's metadata (see module docstring).

    :class:`~vllm.attention.backend.PagedAttentionMetadata` and
    :class:`~vllm.attention.backend.CommonAttentionMetadata` both satisfy it.
    """

    @property
    def query_start_loc(self) -> torch.Tensor:
        """``[num_reqs + 1]`` int32 on the compute device."""

    @property
    def seq_lens(self) -> torch.Tensor:
        """``[num_reqs]`` int32 on the compute device."""

    @property
    def block_table(self) -> torch.Tensor:
        """``[num_reqs, max_blocks_per_req]`` int32 on the compute device."""

    @property
    def query_start_loc_cpu(self) -> torch.Tensor: ...

    @property
    def seq_lens_cpu(self) -> torch.Tensor: ...

    @property
    def num_reqs(self) -> int: ...

    @property
    def max_query_len(self) -> int: ...

    @property
    def max_seq_len(self) -> int: ...


def check_tree_mask(tree_mask: torch.Tensor, num_tokens: int, max_query_len: int) -> None:
    """``tree_mask`` is ``[>= num_tokens, >= max_query_len]`` bool or an integer type."""
    if tree_mask.dtype.is_floating_point or tree_mask.dtype.is_complex:
        raise InvalidArgumentError("tree_mask.dtype", tree_mask.dtype, "torch.bool or an integer dtype")
    if tree_mask.dim() != 2 or tree_mask.shape[0] < num_tokens or tree_mask.shape[1] < max_query_len:
        raise InvalidArgumentError(
            "tree_mask.shape", tuple(tree_mask.shape),
            f"[>= num_tokens={num_tokens}, >= max_query_len={max_query_len}]",
        )


def check_paged_args(
    query: torch.Tensor,
    kv: PagedKV,
    batch: PagedBatchLike,
    output: torch.Tensor,
    *,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    tree_mask: torch.Tensor | None,
) -> int:
    """Validate shapes/devices; return ``num_tokens`` (``query_start_loc[-1]``)."""
    if query.dim() != 3 or query.shape[2] != kv.head_size:
        raise InvalidArgumentError(
            "query.shape", tuple(query.shape), f"[num_tokens, num_heads, head_size={kv.head_size}]"
        )
    hq = query.shape[1]
    if hq % kv.num_kv_heads:
        raise InvalidArgumentError("query.shape[1]", hq, f"a multiple of num_kv_heads={kv.num_kv_heads}")
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise InvalidArgumentError("query.dtype", query.dtype, "float32, float16 or bfloat16")
    want = (query.shape[0], hq, kv.head_size_v)
    if tuple(output.shape) != want:
        raise InvalidArgumentError("output.shape", tuple(output.shape), f"{want} [num_tokens, num_heads, head_size_v]")
    for name, t in (("query", query), ("output", output), ("block_table", batch.block_table),
                    ("seq_lens", batch.seq_lens), ("query_start_loc", batch.query_start_loc)):
        if t.device != kv.device:
            raise InvalidArgumentError(f"{name}.device", str(t.device), f"{kv.device} (the cache's)")
    if batch.query_start_loc_cpu.shape[0] != batch.num_reqs + 1:
        raise InvalidArgumentError("query_start_loc_cpu.shape", tuple(batch.query_start_loc_cpu.shape),
                                   f"[num_reqs + 1 = {batch.num_reqs + 1}]")
    num_tokens = int(batch.query_start_loc_cpu[-1]) if batch.num_reqs else 0
    if num_tokens > query.shape[0]:
        raise InvalidArgumentError("query.shape[0]", query.shape[0],
                                   f">= num_tokens={num_tokens} (query_start_loc[-1])")
    if sliding_window is not None and sliding_window <= 0:
        raise InvalidArgumentError("sliding_window", sliding_window, "None or > 0")
    if logits_soft_cap is not None and logits_soft_cap <= 0:
        raise InvalidArgumentError("logits_soft_cap", logits_soft_cap, "None or > 0")
    if tree_mask is not None:
        if sliding_window is not None:
            raise InvalidArgumentError("sliding_window", sliding_window, "None with a tree_mask")
        check_tree_mask(tree_mask, num_tokens, batch.max_query_len)
    return num_tokens
