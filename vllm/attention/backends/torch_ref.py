"""TORCH_REF: the oracle every other backend is compared against.

Split K/V cache ``(nb, 2, bs, H, D)``; compute is :func:`vllm.attention.ops.reference.attend`
per request, in float32, over K/V gathered from the pages.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from vllm.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerProtocol,
    PagedAttentionMetadata,
    PagedMetadataBuilder,
    SizeSpec,
)
from vllm.attention.layouts import split_kv_views
from vllm.attention.ops.reference import attend, gather_pages
from vllm.attention.types import AttentionType, KVCacheDType, KVCacheLayout
from vllm.attention.writer import KVCacheWriter
from vllm.attention.writers.quant import load_values
from vllm.attention.writers.split import SplitKVCacheWriter


def paged_reference_forward(
    spec_causal: bool,
    impl: AttentionImpl[PagedAttentionMetadata],
    layer: AttentionLayerProtocol,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    k_view: torch.Tensor,
    v_view: torch.Tensor,
    meta: PagedAttentionMetadata,
    output: torch.Tensor,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Per-request attention over ``[nb, bs, H, D]`` K/V views (any layout's views)."""
    spec = impl.spec
    quant = layer.kv_quant
    starts = meta.query_start_loc_cpu.tolist()
    lens = meta.seq_lens_cpu.tolist()
    for i in range(meta.num_reqs):
        qs, qe, length = starts[i], starts[i + 1], lens[i]
        if qe == qs:
            continue
        if spec.attn_type is AttentionType.ENCODER_ONLY:
            if key is None or value is None:
                raise ValueError("encoder-only attention needs key and value")
            k, v = key[qs:qe].to(compute_dtype), value[qs:qe].to(compute_dtype)
        else:
            blocks = meta.block_table[i]
            k = load_values(gather_pages(k_view, blocks, length), quant.kv_cache_dtype,
                            quant.k_scale, compute_dtype)
            v = load_values(gather_pages(v_view, blocks, length), quant.kv_cache_dtype,
                            quant.v_scale, compute_dtype)
        out = attend(
            query[qs:qe].to(compute_dtype), k, v,
            scale=spec.scale, causal=spec_causal and meta.causal,
            sliding_window=spec.sliding_window, logits_soft_cap=spec.logits_soft_cap,
        )
        output[qs:qe] = out.to(output.dtype)
    return output


class TorchRefImpl(AttentionImpl[PagedAttentionMetadata]):
    def forward(
        self,
        layer: AttentionLayerProtocol,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: PagedAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        if self.spec.attn_type is AttentionType.ENCODER_ONLY:
            k_view = v_view = kv_cache  # unused: no cache
        else:
            k_view, v_view = split_kv_views(kv_cache, KVCacheLayout.SPLIT_NHD)
        return paged_reference_forward(
            self.spec.attn_type is AttentionType.DECODER, self, layer, query, key, value,
            k_view, v_view, attn_metadata, output,
        )


class TorchRefBackend(AttentionBackend[PagedAttentionMetadata]):
    name: ClassVar[str] = "TORCH_REF"
    kv_cache_layout: ClassVar[KVCacheLayout] = KVCacheLayout.SPLIT_NHD
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset(
        {"auto", "fp8_e4m3", "fp8_e5m2"}
    )
    block_sizes: ClassVar[SizeSpec] = SizeSpec()
    head_sizes: ClassVar[SizeSpec] = SizeSpec()
    attention_types: ClassVar[frozenset[AttentionType]] = frozenset(AttentionType)

    @classmethod
    def get_impl_cls(cls) -> type[TorchRefImpl]:
        return TorchRefImpl

    @classmethod
    def get_builder_cls(cls) -> type[PagedMetadataBuilder]:
        return PagedMetadataBuilder

    @classmethod
    def get_metadata_cls(cls) -> type[PagedAttentionMetadata]:
        return PagedAttentionMetadata

    @classmethod
    def get_kv_cache_writer(cls, cache_dtype: KVCacheDType = "auto") -> KVCacheWriter:
        return SplitKVCacheWriter(KVCacheLayout.SPLIT_NHD, ("auto", "fp8_e4m3", "fp8_e5m2"))
