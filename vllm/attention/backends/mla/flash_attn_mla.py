"""FLASH_ATTN_MLA: FlashAttention-3 with ``qv`` (sm90).

Cache ``(nb, bs, 576)``; the portable Triton / torch paths run where
the vendor kernel cannot (``docs/mla.md``).
"""

from __future__ import annotations

from typing import ClassVar

from vllm.attention.backend import SizeSpec, multiple_of
from vllm.attention.backends.mla.common import (
    MLABackend,
    MLACommonImpl,
    MLAMetadata,
    MLAMetadataBuilder,
)
from vllm.attention.ops.mla_vendor import FlashAttnMLAKernel, MLAVendorKernel
from vllm.attention.types import KVCacheDType


class FlashAttnMLAImpl(MLACommonImpl[MLAMetadata]):
    vendor: ClassVar[MLAVendorKernel | None] = FlashAttnMLAKernel()


class FlashAttnMLABackend(MLABackend[MLAMetadata]):
    name: ClassVar[str] = "FLASH_ATTN_MLA"
    block_sizes: ClassVar[SizeSpec] = multiple_of(16)
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset({"auto"})
    vendor_package: ClassVar[str | None] = "flash_attn_interface"

    @classmethod
    def get_impl_cls(cls) -> type[FlashAttnMLAImpl]:
        return FlashAttnMLAImpl

    @classmethod
    def get_builder_cls(cls) -> type[MLAMetadataBuilder]:
        return MLAMetadataBuilder

    @classmethod
    def get_metadata_cls(cls) -> type[MLAMetadata]:
        return MLAMetadata
