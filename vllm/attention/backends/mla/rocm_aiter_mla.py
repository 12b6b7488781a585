"""ROCM_AITER_MLA: AMD aiter's MLA decode (ROCm).

Cache ``(nb, bs, 576)``; the portable Triton / torch paths run where
the vendor kernel cannot (``docs/mla.md``).
"""

from __future__ import annotations

from typing import ClassVar

from vllm.attention.backend import SizeSpec
from vllm.attention.backends.mla.common import (
    MLABackend,
    MLACommonImpl,
    MLAMetadata,
    MLAMetadataBuilder,
)
from vllm.attention.ops.mla_vendor import AiterMLAKernel, MLAVendorKernel
from vllm.attention.types import KVCacheDType


class RocmAiterMLAImpl(MLACommonImpl[MLAMetadata]):
    vendor: ClassVar[MLAVendorKernel | None] = AiterMLAKernel()


class RocmAiterMLABackend(MLABackend[MLAMetadata]):
    name: ClassVar[str] = "ROCM_AITER_MLA"
    block_sizes: ClassVar[SizeSpec] = SizeSpec()
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset(
        {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"})
    vendor_package: ClassVar[str | None] = "aiter.mla"

    @classmethod
    def get_impl_cls(cls) -> type[RocmAiterMLAImpl]:
        return RocmAiterMLAImpl

    @classmethod
    def get_builder_cls(cls) -> type[MLAMetadataBuilder]:
        return MLAMetadataBuilder

    @classmethod
    def get_metadata_cls(cls) -> type[MLAMetadata]:
        return MLAMetadata
