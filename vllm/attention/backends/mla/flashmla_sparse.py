"""FLASHMLA_SPARSE: sparse MLA over the indexer's top-k, on the ``fp8_ds_mla`` or bf16 cache.

Cache ``(nb, bs, 576)``, or ``(nb, bs, 656)`` uint8 for ``fp8_ds_mla``. Every token
attends over its top-k positions on the Triton (CUDA) or torch path (``docs/mla.md``).
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


class FlashMLASparseImpl(MLACommonImpl[MLASparseMetadata]):
    is_sparse: ClassVar[bool] = True


class FlashMLASparseBackend(MLABackend[MLASparseMetadata]):
    name: ClassVar[str] = "FLASHMLA_SPARSE"
    block_sizes: ClassVar[SizeSpec] = exactly(64)
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset({"auto", "fp8_ds_mla"})
    is_sparse: ClassVar[bool] = True

    @classmethod
    def get_impl_cls(cls) -> type[FlashMLASparseImpl]:
        return FlashMLASparseImpl

    @classmethod
    def get_builder_cls(cls) -> type[MLASparseMetadataBuilder]:
        return MLASparseMetadataBuilder

    @classmethod
    def get_metadata_cls(cls) -> type[MLASparseMetadata]:
        return MLASparseMetadata
