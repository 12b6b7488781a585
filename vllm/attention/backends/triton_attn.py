"""TRITON_ATTN: the portable Triton paged kernel over a split NHD cache.

``(nb, 2, bs, H, D)`` for ``auto`` and the scaled fp8 formats; the per-token-head
formats (``int8_per_token_head``, ``fp8_per_token_head``) use
``KVCacheLayout.PER_TOKEN_HEAD_QUANT``, ``(nb, 2, bs, H, D + 4)`` bytes with a float32
scale after each (token, head) row. Triton on CUDA (compute-heavy fp16/bf16 prefills
over ``auto`` caches: torch's flash varlen kernel), torch elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Final

from vllm.attention.backend import (
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    PagedAttentionMetadata,
    SizeSpec,
    common_fields,
    multiple_of,
)
from vllm.attention.backends.standard import StandardBackend, StandardImpl
from vllm.attention.types import AttentionType, KVCacheDType, KVCacheLayout

PER_TOKEN_HEAD: Final[frozenset[KVCacheDType]] = frozenset(
    {"int8_per_token_head", "fp8_per_token_head"}
)


@dataclass(frozen=True, kw_only=True)
class TritonAttentionMetadata(PagedAttentionMetadata):
    """The paged batch; the kernel reads ``query_start_loc``, ``seq_lens`` and
    ``block_table`` on the device, the host copies only to size its launch."""


class TritonAttentionMetadataBuilder(AttentionMetadataBuilder[TritonAttentionMetadata]):
    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(**common_fields(common))


class TritonAttentionBackend(StandardBackend[TritonAttentionMetadata]):
    name: ClassVar[str] = "TRITON_ATTN"
    kv_cache_layout: ClassVar[KVCacheLayout] = KVCacheLayout.SPLIT_NHD
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset(
        {"auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head"}
    )
    block_sizes: ClassVar[SizeSpec] = multiple_of(16)
    head_sizes: ClassVar[SizeSpec] = multiple_of(8, max=256)
    attention_types: ClassVar[frozenset[AttentionType]] = frozenset(AttentionType)

    @classmethod
    def kv_cache_layout_for(cls, cache_dtype: KVCacheDType = "auto") -> KVCacheLayout:
        if cache_dtype in PER_TOKEN_HEAD:
            return KVCacheLayout.PER_TOKEN_HEAD_QUANT
        return cls.kv_cache_layout

    @classmethod
    def get_impl_cls(cls) -> type[TritonAttentionImpl]:
        return TritonAttentionImpl

    @classmethod
    def get_builder_cls(cls) -> type[TritonAttentionMetadataBuilder]:
        return TritonAttentionMetadataBuilder

    @classmethod
    def get_metadata_cls(cls) -> type[TritonAttentionMetadata]:
        return TritonAttentionMetadata


class TritonAttentionImpl(StandardImpl[TritonAttentionMetadata]):
    backend = TritonAttentionBackend
