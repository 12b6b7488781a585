"""FLASH_ATTN: FlashAttention over a split NHD cache ``(nb, 2, bs, H, D)``.

Vendor kernels: flash-attn-4's ``flash_attn.cute`` (Hopper / Blackwell, page
table with ``seqused_k``), then flash-attn 2 (pages of 256k tokens). Calls they
do not take (fp8 caches, other block sizes, fp32) run the portable path on CUDA
(torch's flash varlen kernel for the prefills it takes, else Triton), torch
elsewhere. Paths and limits: ``docs/backends.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.attention.backend import (
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    PagedAttentionMetadata,
    SizeSpec,
    common_fields,
    multiple_of,
)
from vllm.attention.backends.standard import StandardBackend, StandardImpl
from vllm.attention.backends.vendor_kernels import (
    FLASH_ATTN_2,
    FLASH_ATTN_CUTE,
    HALF,
    VendorKernel,
)
from vllm.attention.types import AttentionType, KVCacheDType, KVCacheLayout


@dataclass(frozen=True, kw_only=True)
class FlashAttentionMetadata(PagedAttentionMetadata):
    """The batch as FlashAttention's varlen call reads it: ``query_start_loc`` is
    ``cu_seqlens_q``, ``seq_lens`` is ``seqused_k``, ``block_table`` the page table."""


class FlashAttentionMetadataBuilder(AttentionMetadataBuilder[FlashAttentionMetadata]):
    def build(self, common: CommonAttentionMetadata) -> FlashAttentionMetadata:
        return FlashAttentionMetadata(**common_fields(common))


class FlashAttentionBackend(StandardBackend[FlashAttentionMetadata]):
    name: ClassVar[str] = "FLASH_ATTN"
    kv_cache_layout: ClassVar[KVCacheLayout] = KVCacheLayout.SPLIT_NHD
    supported_dtypes: ClassVar[frozenset[torch.dtype]] = HALF
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset({"auto", "fp8"})
    block_sizes: ClassVar[SizeSpec] = multiple_of(16)
    head_sizes: ClassVar[SizeSpec] = multiple_of(8, max=256)
    attention_types: ClassVar[frozenset[AttentionType]] = frozenset(AttentionType)
    vendor_package: ClassVar[str | None] = "flash_attn"
    vendor_kernels: ClassVar[tuple[VendorKernel, ...]] = (FLASH_ATTN_CUTE, FLASH_ATTN_2)

    @classmethod
    def get_impl_cls(cls) -> type[FlashAttentionImpl]:
        return FlashAttentionImpl

    @classmethod
    def get_builder_cls(cls) -> type[FlashAttentionMetadataBuilder]:
        return FlashAttentionMetadataBuilder

    @classmethod
    def get_metadata_cls(cls) -> type[FlashAttentionMetadata]:
        return FlashAttentionMetadata


class FlashAttentionImpl(StandardImpl[FlashAttentionMetadata]):
    backend = FlashAttentionBackend
