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
    fp8_mma_default: ClassVar[bool] = True
    """As upstream: its FLASHMLA decodes an fp8 cache with FlashMLA's fp8 kernel, the
    query quantised to fp8 (``flash_mla_with_kvcache_fp8(..., descale_q=...)``,
    ``vllm/v1/attention/backends/mla/flashmla.py`` at 01b1d340), so the portable path
    here runs the fp8-MMA kernel past 32 heads; ``fp8_mma = False`` or
    ``VLLM_MLA_FP8_MMA=0`` keeps exact dots (``docs/mla.md``)."""


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
