"""CUTLASS_MLA: the CUTLASS SM100 MLA decode kernel (``sgl_kernel``).

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
from vllm.attention.ops.mla_vendor import CutlassMLAKernel, MLAVendorKernel
from vllm.attention.types import KVCacheDType


class CutlassMLAImpl(MLACommonImpl[MLAMetadata]):
    vendor: ClassVar[MLAVendorKernel | None] = CutlassMLAKernel()


class CutlassMLABackend(MLABackend[MLAMetadata]):
    name: ClassVar[str] = "CUTLASS_MLA"
    block_sizes: ClassVar[SizeSpec] = exactly(128)
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset({"auto", "fp8"})
    vendor_package: ClassVar[str | None] = "sgl_kernel"

    @classmethod
    def get_impl_cls(cls) -> type[CutlassMLAImpl]:
        return CutlassMLAImpl

    @classmethod
    def get_builder_cls(cls) -> type[MLAMetadataBuilder]:
        return MLAMetadataBuilder

    @classmethod
    def get_metadata_cls(cls) -> type[MLAMetadata]:
        return MLAMetadata
