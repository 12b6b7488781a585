"""A well-formed new-style backend: impl, builder and metadata agree."""

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
    KVQuant,
)
from vllm.attention.backend import AttentionLayerProtocol
from vllm.attention.types import KVCacheDType
from vllm.forward_context import get_forward_context


@dataclass(frozen=True)
class MyMetadata(AttentionMetadata):
    seq_lens: torch.Tensor


class MyBuilder(AttentionMetadataBuilder[MyMetadata]):
    def build(self, common: CommonAttentionMetadata) -> MyMetadata:
        return MyMetadata(seq_lens=common.seq_lens)


class MyImpl(AttentionImpl[MyMetadata]):
    def forward(self, layer: AttentionLayerProtocol, query: torch.Tensor,
                key: torch.Tensor | None, value: torch.Tensor | None, kv_cache: torch.Tensor,
                attn_metadata: MyMetadata, output: torch.Tensor) -> torch.Tensor:
        _ = attn_metadata.seq_lens
        return output


class MyWriter:
    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor, quant: KVQuant) -> None:
        pass


class MyBackend(AttentionBackend[MyMetadata]):
    name: ClassVar[str] = "MINE"
    kv_cache_layout: ClassVar[KVCacheLayout] = KVCacheLayout.SPLIT_NHD

    @classmethod
    def get_impl_cls(cls) -> type[MyImpl]:
        return MyImpl

    @classmethod
    def get_builder_cls(cls) -> type[MyBuilder]:
        return MyBuilder

    @classmethod
    def get_metadata_cls(cls) -> type[MyMetadata]:
        return MyMetadata

    @classmethod
    def get_kv_cache_writer(cls, cache_dtype: KVCacheDType = "auto") -> KVCacheWriter:
        return MyWriter()


def slots_for(layer_name: str) -> torch.Tensor:
    # the write path reads slot_mapping from the forward context
    return get_forward_context().slot_mapping_for(layer_name)


writer: KVCacheWriter = MyWriter()
