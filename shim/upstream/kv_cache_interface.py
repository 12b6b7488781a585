"""``vllm.v1.kv_cache_interface``: the per-layer cache specs a legacy builder is given.

The adapter fills them from the layer (heads, head size, cache dtype) and the bound
cache (block size, storage dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "AttentionSpec",
    "FullAttentionSpec",
    "KVCacheSpec",
    "MLAAttentionSpec",
    "SlidingWindowSpec",
]


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """One layer's cache format."""

    block_size: int

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} has no page size")


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    """The cache tensor's dtype (the model dtype for ``auto``; the fp8 dtype for fp8)."""

    @property
    def page_size_bytes(self) -> int:
        item = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * item


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    head_size_v: int | None = None
    """Value head size; filled with ``head_size`` when not given."""
    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    def __post_init__(self) -> None:
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)

    @property
    def page_size_bytes(self) -> int:
        item = torch.empty(0, dtype=self.dtype).element_size()
        v = self.head_size if self.head_size_v is None else self.head_size_v
        return self.block_size * self.num_kv_heads * (self.head_size + v) * item


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    cache_dtype_str: str | None = None

    @property
    def page_size_bytes(self) -> int:
        item = torch.empty(0, dtype=self.dtype).element_size()
        return self.block_size * self.num_kv_heads * self.head_size * item
