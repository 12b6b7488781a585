"""TRITON_MLA: the portable Triton decode kernel (no vendor package).

Cache ``(nb, bs, 576)``; the portable Triton / torch paths run where
the vendor kernel cannot (``docs/mla.md``).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from vllm.attention.backend import SizeSpec, multiple_of
from vllm.attention.backends.mla.common import (
    FLOAT_DTYPES,
    MLABackend,
    MLACommonImpl,
    MLAMetadata,
    MLAMetadataBuilder,
)
from vllm.attention.types import KVCacheDType


class TritonMLAImpl(MLACommonImpl[MLAMetadata]):
    """No vendor kernel: Triton decode on CUDA, torch elsewhere."""


class TritonMLABackend(MLABackend[MLAMetadata]):
    name: ClassVar[str] = "TRITON_MLA"
    block_sizes: ClassVar[SizeSpec] = multiple_of(16)
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset({"auto", "fp8"})
    supported_dtypes: ClassVar[frozenset[torch.dtype]] = FLOAT_DTYPES
    head_sizes: ClassVar[SizeSpec] = multiple_of(8)

    @classmethod
    def get_impl_cls(cls) -> type[TritonMLAImpl]:
        return TritonMLAImpl

    @classmethod
    def get_builder_cls(cls) -> type[MLAMetadataBuilder]:
        return MLAMetadataBuilder

    @classmethod
    def get_metadata_cls(cls) -> type[MLAMetadata]:
        return MLAMetadata
