"""FLASH_ATTN_DIFFKV: K and V of different head sizes packed in one cache
``(nb, bs, H, Dk + Dv)``, K then V on the last axis.

The layer's ``head_size`` is ``Dk`` and ``head_size_v`` is ``Dv``; the cache is
allocated (and ``unsupported_reasons`` asked) with ``head_size = Dk + Dv``.
Vendor kernel: flash-attn-4's ``flash_attn.cute`` (its K and V may differ in head
size); otherwise Triton on CUDA, torch elsewhere.
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
from vllm.attention.backends.vendor_kernels import FLASH_ATTN_CUTE, HALF, VendorKernel
from vllm.attention.types import AttentionType, KVCacheDType, KVCacheLayout


@dataclass(frozen=True, kw_only=True)
class FlashAttentionDiffKVMetadata(PagedAttentionMetadata):
    """The batch as the varlen call reads it (``cu_seqlens_q``, ``seqused_k``, page table)."""


class FlashAttentionDiffKVMetadataBuilder(
    AttentionMetadataBuilder[FlashAttentionDiffKVMetadata]
):
    def build(self, common: CommonAttentionMetadata) -> FlashAttentionDiffKVMetadata:
        return FlashAttentionDiffKVMetadata(**common_fields(common))


class FlashAttentionDiffKVBackend(StandardBackend[FlashAttentionDiffKVMetadata]):
    name: ClassVar[str] = "FLASH_ATTN_DIFFKV"
    kv_cache_layout: ClassVar[KVCacheLayout] = KVCacheLayout.DIFFKV_PACKED
    distinct_v_head_size: ClassVar[bool] = True
    supported_dtypes: ClassVar[frozenset[torch.dtype]] = HALF
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset({"auto"})
    block_sizes: ClassVar[SizeSpec] = multiple_of(16)
    # Checked against Dk (the layer) and Dk + Dv (the cache), each <= 256 + 256.
    head_sizes: ClassVar[SizeSpec] = multiple_of(8, max=512)
    attention_types: ClassVar[frozenset[AttentionType]] = frozenset({AttentionType.DECODER})
    vendor_package: ClassVar[str | None] = "flash_attn"
    vendor_kernels: ClassVar[tuple[VendorKernel, ...]] = (FLASH_ATTN_CUTE,)

    @classmethod
    def get_impl_cls(cls) -> type[FlashAttentionDiffKVImpl]:
        return FlashAttentionDiffKVImpl

    @classmethod
    def get_builder_cls(cls) -> type[FlashAttentionDiffKVMetadataBuilder]:
        return FlashAttentionDiffKVMetadataBuilder

    @classmethod
    def get_metadata_cls(cls) -> type[FlashAttentionDiffKVMetadata]:
        return FlashAttentionDiffKVMetadata


class FlashAttentionDiffKVImpl(StandardImpl[FlashAttentionDiffKVMetadata]):
    backend = FlashAttentionDiffKVBackend
