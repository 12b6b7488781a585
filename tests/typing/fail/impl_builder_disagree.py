from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    KVCacheLayout,
    KVCacheWriter,
)
from vllm.attention.backend import AttentionLayerProtocol
from vllm.attention.types import KVCacheDType
from vllm.attention.writers.split import SplitKVCacheWriter


@dataclass(frozen=True)
class MetaA(AttentionMetadata):
    a: int


@dataclass(frozen=True)
class MetaB(AttentionMetadata):
    b: int


class ImplA(AttentionImpl[MetaA]):
    def forward(self, layer: AttentionLayerProtocol, query: torch.Tensor,
                key: torch.Tensor | None, value: torch.Tensor | None, kv_cache: torch.Tensor,
                attn_metadata: MetaA, output: torch.Tensor) -> torch.Tensor:
        return output


class BuilderB(AttentionMetadataBuilder[MetaB]):
    def build(self, common: CommonAttentionMetadata) -> MetaB:
        return MetaB(b=common.num_reqs)


class Confused(AttentionBackend[MetaA]):
    name: ClassVar[str] = "CONFUSED"
    kv_cache_layout: ClassVar[KVCacheLayout] = KVCacheLayout.SPLIT_NHD

    @classmethod
    def get_impl_cls(cls) -> type[ImplA]:
        return ImplA

    @classmethod
    def get_builder_cls(cls) -> type[BuilderB]:  # E: override
        return BuilderB

    @classmethod
    def get_metadata_cls(cls) -> type[MetaA]:
        return MetaA

    @classmethod
    def get_kv_cache_writer(cls, cache_dtype: KVCacheDType = "auto") -> KVCacheWriter:
        return SplitKVCacheWriter(KVCacheLayout.SPLIT_NHD)
