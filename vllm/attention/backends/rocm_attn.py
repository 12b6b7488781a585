"""ROCM_ATTN: the legacy paged layout, ``(2, nb, bs * H * D)`` read as
K ``[nb, H, D/x, bs, x]`` and V ``[nb, H, D, bs]`` (``x = 16 // element_size``).

Upstream ran this with its own ROCm paged-attention op and a Triton prefill; here
the portable Triton kernel reads the same layout through its strides (on ROCm and
CUDA alike), torch elsewhere. No vendor package.
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
    exactly,
    multiple_of,
)
from vllm.attention.backends.standard import StandardBackend, StandardImpl
from vllm.attention.types import AttentionType, KVCacheDType, KVCacheLayout


@dataclass(frozen=True, kw_only=True)
class RocmAttentionMetadata(PagedAttentionMetadata):
    """The paged batch (block table, lengths); the layout's address math is in
    :class:`~vllm.attention.ops.paged_kv.PagedKV`."""


class RocmAttentionMetadataBuilder(AttentionMetadataBuilder[RocmAttentionMetadata]):
    def build(self, common: CommonAttentionMetadata) -> RocmAttentionMetadata:
        return RocmAttentionMetadata(**common_fields(common))


class RocmAttentionBackend(StandardBackend[RocmAttentionMetadata]):
    name: ClassVar[str] = "ROCM_ATTN"
    kv_cache_layout: ClassVar[KVCacheLayout] = KVCacheLayout.LEGACY_PAGED
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset(
        {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"}
    )
    block_sizes: ClassVar[SizeSpec] = exactly(16, 32)
    # D must split into 16-byte chunks of the stored element (fp8: 16 values).
    head_sizes: ClassVar[SizeSpec] = multiple_of(16, max=256)
    attention_types: ClassVar[frozenset[AttentionType]] = frozenset({AttentionType.DECODER})

    @classmethod
    def get_impl_cls(cls) -> type[RocmAttentionImpl]:
        return RocmAttentionImpl

    @classmethod
    def get_builder_cls(cls) -> type[RocmAttentionMetadataBuilder]:
        return RocmAttentionMetadataBuilder

    @classmethod
    def get_metadata_cls(cls) -> type[RocmAttentionMetadata]:
        return RocmAttentionMetadata


class RocmAttentionImpl(StandardImpl[RocmAttentionMetadata]):
    backend = RocmAttentionBackend
