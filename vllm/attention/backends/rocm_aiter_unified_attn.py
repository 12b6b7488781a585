"""ROCM_AITER_UNIFIED_ATTN: AITER's unified (prefill + decode) Triton attention over a
K/V-first cache ``(2, nb, bs, H, D)``.

Vendor kernel on ROCm: ``aiter.ops.triton.unified_attention`` (``auto`` caches: AITER
reads fp8 as the MI300 ``e4m3fnuz`` format while this project's writers store
``e4m3fn``, so fp8 caches take the portable path). Elsewhere: Triton on CUDA, torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Final

import torch

from vllm.attention.backend import (
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    PagedAttentionMetadata,
    SizeSpec,
    common_fields,
    multiple_of,
)
from vllm.attention.backends.standard import StandardBackend, StandardImpl
from vllm.attention.backends.vendor_kernels import HALF, VendorCall, VendorKernel
from vllm.attention.layouts import split_kv_views
from vllm.attention.types import AttentionType, KVCacheDType, KVCacheLayout


@dataclass(frozen=True, kw_only=True)
class RocmAiterUnifiedAttentionMetadata(PagedAttentionMetadata):
    """The batch as the unified kernel reads it: ``cu_seqlens_q``, ``seqused_k``, block table."""


class RocmAiterUnifiedAttentionMetadataBuilder(
    AttentionMetadataBuilder[RocmAiterUnifiedAttentionMetadata]
):
    def build(self, common: CommonAttentionMetadata) -> RocmAiterUnifiedAttentionMetadata:
        return RocmAiterUnifiedAttentionMetadata(**common_fields(common))


@dataclass(frozen=True)
class AiterUnifiedKernel(VendorKernel):
    """``aiter.ops.triton.unified_attention.unified_attention`` (causal only)."""

    def run(self, call: VendorCall) -> None:
        from aiter.ops.triton.unified_attention import unified_attention

        meta, spec, n = call.meta, call.spec, call.num_tokens
        if n == 0:
            return
        k, v = split_kv_views(call.kv_cache, call.layout)
        out = call.output[:n]
        dst = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
        left = call.window_left
        unified_attention(
            q=call.query[:n], k=k, v=v, out=dst,
            cu_seqlens_q=meta.query_start_loc, max_seqlen_q=meta.max_query_len,
            seqused_k=meta.seq_lens, max_seqlen_k=meta.max_seq_len,
            softmax_scale=spec.scale, causal=True,
            window_size=(-1, -1) if left is None else (left, 0),
            block_table=meta.block_table, softcap=spec.logits_soft_cap or 0.0,
            q_descale=None, k_descale=None, v_descale=None,
        )
        if dst is not out:
            out.copy_(dst)


AITER_UNIFIED: Final = AiterUnifiedKernel(
    name="aiter.unified_attention", module="aiter.ops.triton.unified_attention",
    platform="rocm", layouts=frozenset({KVCacheLayout.SPLIT_KV_FIRST}), non_causal=False,
)


class RocmAiterUnifiedAttentionBackend(StandardBackend[RocmAiterUnifiedAttentionMetadata]):
    name: ClassVar[str] = "ROCM_AITER_UNIFIED_ATTN"
    kv_cache_layout: ClassVar[KVCacheLayout] = KVCacheLayout.SPLIT_KV_FIRST
    supported_dtypes: ClassVar[frozenset[torch.dtype]] = HALF
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset(
        {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"}
    )
    block_sizes: ClassVar[SizeSpec] = multiple_of(16)
    head_sizes: ClassVar[SizeSpec] = multiple_of(8, max=256)
    attention_types: ClassVar[frozenset[AttentionType]] = frozenset({AttentionType.DECODER})
    vendor_package: ClassVar[str | None] = "aiter"
    vendor_kernels: ClassVar[tuple[VendorKernel, ...]] = (AITER_UNIFIED,)

    @classmethod
    def get_impl_cls(cls) -> type[RocmAiterUnifiedAttentionImpl]:
        return RocmAiterUnifiedAttentionImpl

    @classmethod
    def get_builder_cls(cls) -> type[RocmAiterUnifiedAttentionMetadataBuilder]:
        return RocmAiterUnifiedAttentionMetadataBuilder

    @classmethod
    def get_metadata_cls(cls) -> type[RocmAiterUnifiedAttentionMetadata]:
        return RocmAiterUnifiedAttentionMetadata


class RocmAiterUnifiedAttentionImpl(StandardImpl[RocmAiterUnifiedAttentionMetadata]):
    backend = RocmAiterUnifiedAttentionBackend
