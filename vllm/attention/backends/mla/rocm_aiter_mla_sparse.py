"""ROCM_AITER_MLA_SPARSE: sparse MLA over the indexer's top-k (ROCm family).

Cache ``(nb, bs, 576)``. Every token attends over its top-k positions on the Triton
(CUDA) or torch path (``docs/mla.md``).
"""

from __future__ import annotations

from typing import ClassVar

from vllm.attention.backend import SizeSpec, exactly
from vllm.attention.backends.mla.common import (
    MLABackend,
    MLACommonImpl,
    MLASparseMetadata,
    MLASparseMetadataBuilder,
)
from vllm.attention.types import KVCacheDType


class RocmAiterMLASparseImpl(MLACommonImpl[MLASparseMetadata]):
    is_sparse: ClassVar[bool] = True


class RocmAiterMLASparseBackend(MLABackend[MLASparseMetadata]):
    name: ClassVar[str] = "ROCM_AITER_MLA_SPARSE"
    block_sizes: ClassVar[SizeSpec] = exactly(1, 64)
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset({"auto", "fp8"})
    is_sparse: ClassVar[bool] = True

    @classmethod
    def get_impl_cls(cls) -> type[RocmAiterMLASparseImpl]:
        return RocmAiterMLASparseImpl

    @classmethod
    def get_builder_cls(cls) -> type[MLASparseMetadataBuilder]:
        return MLASparseMetadataBuilder

    @classmethod
    def get_metadata_cls(cls) -> type[MLASparseMetadata]:
        return MLASparseMetadata
