"""``vllm.v1.attention.backends.utils``: the batch helpers legacy builders call.

Written from upstream's documented semantics: a batch is reordered decode-first, a
"decode" is a request with at most ``decode_threshold`` new tokens, and decode-context
parallelism deals a sequence's tokens to ranks in chunks of the interleave size.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Literal

import torch

from shim.upstream.backend import (  # type: ignore[deprecated]  # re-exported, as upstream's
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.attention.errors import InvalidArgumentError

__all__ = [
    "PAD_SLOT_ID",
    "AttentionCGSupport",
    "AttentionMetadataBuilder",
    "CommonAttentionMetadata",
    "KVCacheLayoutType",
    "get_dcp_local_seq_lens",
    "get_kv_cache_layout",
    "reorder_batch_to_split_decodes_and_prefills",
    "set_kv_cache_layout",
    "split_decodes_and_prefills",
]

PAD_SLOT_ID = -1
"""The slot of a padding token: never written."""

KVCacheLayoutType = Literal["NHD", "HND"]
_override: KVCacheLayoutType | None = None


@functools.cache
def _env_layout() -> KVCacheLayoutType:
    value = os.environ.get("VLLM_KV_CACHE_LAYOUT", "NHD")
    if value == "NHD":
        return "NHD"
    if value == "HND":
        return "HND"
    raise InvalidArgumentError("VLLM_KV_CACHE_LAYOUT", value, "NHD or HND")


def get_kv_cache_layout() -> KVCacheLayoutType:
    """``NHD`` unless ``VLLM_KV_CACHE_LAYOUT`` or :func:`set_kv_cache_layout` says ``HND``."""
    return _env_layout() if _override is None else _override


def set_kv_cache_layout(cache_layout: KVCacheLayoutType) -> None:
    global _override
    _override = cache_layout


def split_decodes_and_prefills(common_attn_metadata: CommonAttentionMetadata,
                               decode_threshold: int = 1, require_uniform: bool = False
                               ) -> tuple[int, int, int, int]:
    """``(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)`` of a batch
    ordered decodes first. ``require_uniform``: decodes must all have the first request's
    query length (a padded uniform batch counts as all decodes)."""
    c = common_attn_metadata
    num_reqs, num_tokens = c.num_reqs, c.num_actual_tokens
    if c.max_query_len <= decode_threshold and (not require_uniform or decode_threshold <= 1):
        return num_reqs, 0, num_tokens, 0
    starts = c.query_start_loc_cpu[: num_reqs + 1]
    lens = starts[1:] - starts[:-1]
    if num_reqs == 0 or int(lens[0]) > decode_threshold:
        return 0, num_reqs, 0, num_tokens
    if require_uniform:
        if bool(((lens == lens[0]) | (lens == 0)).all()):
            return num_reqs, 0, num_tokens, 0
        is_prefill = lens != lens[0]
    else:
        is_prefill = lens > decode_threshold
    if not bool(is_prefill.any()):
        return num_reqs, 0, num_tokens, 0
    first = int(is_prefill.int().argmax())
    decode_tokens = int(starts[first])
    return first, num_reqs - first, decode_tokens, num_tokens - decode_tokens


def reorder_batch_to_split_decodes_and_prefills(input_batch: Any, scheduler_output: Any,
                                                decode_threshold: int = 1) -> bool:
    """Move requests with at most ``decode_threshold`` scheduled tokens to the front
    (``input_batch.swap_states``); True if anything moved. The runner of this package
    orders its batches itself; this serves builders that call it on their own batches."""
    ids = list(input_batch.req_ids)
    is_decode = [scheduler_output.num_scheduled_tokens[r] <= decode_threshold for r in ids]
    moved = False
    front = 0
    for i, decode in enumerate(is_decode):
        if decode:
            if i != front:
                input_batch.swap_states(front, i)
                is_decode[front], is_decode[i] = is_decode[i], is_decode[front]
                moved = True
            front += 1
    return moved


def get_dcp_local_seq_lens(seq_lens: torch.Tensor, dcp_size: int = 1,
                           dcp_rank: int | None = None,
                           cp_kv_cache_interleave_size: int = 1) -> torch.Tensor:
    """Tokens of each sequence that rank ``dcp_rank`` holds, when a sequence is dealt to
    ``dcp_size`` ranks in chunks of ``cp_kv_cache_interleave_size`` tokens: ``[n]`` for
    one rank, ``[n, dcp_size]`` for all (``dcp_rank=None``)."""
    chunk = cp_kv_cache_interleave_size
    lens = seq_lens.to(torch.int32).unsqueeze(-1)
    ranks = (torch.arange(dcp_size, dtype=torch.int32, device=seq_lens.device)
             if dcp_rank is None
             else torch.tensor([dcp_rank], dtype=torch.int32, device=seq_lens.device))
    full_rounds = lens // (chunk * dcp_size)
    rest = lens - full_rounds * chunk * dcp_size
    local = full_rounds * chunk + (rest - ranks * chunk).clamp(0, chunk)
    return local.squeeze(1) if local.shape[1] == 1 else local
