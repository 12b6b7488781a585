"""FLEX_ATTENTION: PyTorch's ``flex_attention`` over a block-interleaved cache.

Logical ``(nb, 2, bs, H, D)`` with physical order ``(nb, bs, 2, H, D)``: one block
holds, token by token, that token's K and V rows side by side, so its block and token
axes merge into one slot axis that compiled ``flex_attention`` reads in place: on
CUDA, decode batches attend over the cache through their block-table rows, other
batches over their gathered positions (:mod:`vllm.attention.ops.flex_paged`);
elsewhere the torch path reads the same layout. ``auto`` caches only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vllm.attention.backend import (
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    PagedAttentionMetadata,
    SizeSpec,
    common_fields,
    multiple_of,
)
from vllm.attention.backends.standard import (
    PortablePath,
    StandardBackend,
    StandardImpl,
)
from vllm.attention.types import AttentionType, KVCacheDType, KVCacheLayout


@dataclass(frozen=True, kw_only=True)
class FlexAttentionMetadata(PagedAttentionMetadata):
    """The paged batch; the flex path turns ``block_table`` and the lengths into its
    block mask per call (the mask depends on the layer's sliding window)."""


class FlexAttentionMetadataBuilder(AttentionMetadataBuilder[FlexAttentionMetadata]):
    def build(self, common: CommonAttentionMetadata) -> FlexAttentionMetadata:
        return FlexAttentionMetadata(**common_fields(common))


class FlexAttentionBackend(StandardBackend[FlexAttentionMetadata]):
    name: ClassVar[str] = "FLEX_ATTENTION"
    kv_cache_layout: ClassVar[KVCacheLayout] = KVCacheLayout.SPLIT_BLOCK_INTERLEAVED
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset({"auto"})
    block_sizes: ClassVar[SizeSpec] = multiple_of(16)
    head_sizes: ClassVar[SizeSpec] = multiple_of(8, max=256)
    attention_types: ClassVar[frozenset[AttentionType]] = frozenset(AttentionType)
    portable_path: ClassVar[PortablePath] = "flex_attention"

    @classmethod
    def get_impl_cls(cls) -> type[FlexAttentionImpl]:
        return FlexAttentionImpl

    @classmethod
    def get_builder_cls(cls) -> type[FlexAttentionMetadataBuilder]:
        return FlexAttentionMetadataBuilder

    @classmethod
    def get_metadata_cls(cls) -> type[FlexAttentionMetadata]:
        return FlexAttentionMetadata


class FlexAttentionImpl(StandardImpl[FlexAttentionMetadata]):
    backend = FlexAttentionBackend
