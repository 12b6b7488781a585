"""FLASHMLA: DeepSeek's FlashMLA decode kernel (``flash_mla``, sm90/sm100).

Cache ``(nb, bs, 576)``; the portable Triton / torch paths run where
the vendor kernel cannot (``docs/mla.md``).
"""

from __future__ import annotations

from typing import ClassVar

from vllm.attention.backend import SizeSpec, exactly
from vllm.attention.backends.mla.common import (
    MLABackend,
    MLACommonImpl,
    MLAMetadata,
    MLAMetadataBuilder,
)
from vllm.attention.ops.mla_vendor import FlashMLAKernel, MLAVendorKernel
from vllm.attention.types import KVCacheDType


class FlashMLAImpl(MLACommonImpl[MLAMetadata]):
    vendor: ClassVar[MLAVendorKernel | None] = FlashMLAKernel()


class FlashMLABackend(MLABackend[MLAMetadata]):
    name: ClassVar[str] = "FLASHMLA"
    block_sizes: ClassVar[SizeSpec] = exactly(64)
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset({"auto", "fp8"})
    vendor_package: ClassVar[str | None] = "flash_mla"

    @classmethod
    def get_impl_cls(cls) -> type[FlashMLAImpl]:
        return FlashMLAImpl

    @classmethod
    def get_builder_cls(cls) -> type[MLAMetadataBuilder]:
        return MLAMetadataBuilder

    @classmethod
    def get_metadata_cls(cls) -> type[MLAMetadata]:
        return MLAMetadata
