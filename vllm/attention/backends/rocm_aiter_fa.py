"""ROCM_AITER_FA: AITER FlashAttention over the shuffled cache.

Logical ``(2, nb, bs, H, D)``; the bytes of ``[0]`` are K ``[nb, H, D/x, bs, x]`` and of
``[1]`` V ``[nb, H, bs/x, D, x]`` (``x = 16 // element_size``), the layout AITER's
paged decode kernels read. Vendor path on ROCm: each request's K/V gathered from
the pages (dequantised to the model dtype) into varlen tensors, then
``aiter.flash_attn_varlen_func``. Elsewhere: Triton on CUDA, torch.
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
    exactly,
    multiple_of,
)
from vllm.attention.backends.standard import StandardBackend, StandardImpl
from vllm.attention.backends.vendor_kernels import HALF, VendorCall, VendorKernel
from vllm.attention.errors import InvalidTypeError
from vllm.attention.types import AttentionType, KVCacheDType, KVCacheLayout

_CACHE_DTYPES: Final[frozenset[KVCacheDType]] = frozenset({"auto", "fp8", "fp8_e4m3", "fp8_e5m2"})


@dataclass(frozen=True, kw_only=True)
class RocmAiterFAMetadata(PagedAttentionMetadata):
    """The paged batch plus the key offsets of the gathered varlen K/V."""

    cu_seqlens_k: torch.Tensor
    """``[num_reqs + 1]`` int32 on the compute device: prefix sums of ``seq_lens``."""
    num_kv_tokens: int
    """``sum(seq_lens)``: rows of the gathered K/V."""


class RocmAiterFAMetadataBuilder(AttentionMetadataBuilder[RocmAiterFAMetadata]):
    def build(self, common: CommonAttentionMetadata) -> RocmAiterFAMetadata:
        cu = torch.zeros(common.num_reqs + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(common.seq_lens_cpu.to(torch.int64), 0).to(torch.int32)
        return RocmAiterFAMetadata(
            **common_fields(common), cu_seqlens_k=cu.to(common.seq_lens.device),
            num_kv_tokens=int(cu[-1]),
        )


@dataclass(frozen=True)
class AiterFlashVarlenKernel(VendorKernel):
    """Gather each request's pages, then ``aiter.flash_attn_varlen_func``."""

    def run(self, call: VendorCall) -> None:
        import aiter

        meta = call.meta
        if not isinstance(meta, RocmAiterFAMetadata):
            raise InvalidTypeError("attn_metadata", type(meta).__name__, "RocmAiterFAMetadata")
        n, spec, kv = call.num_tokens, call.spec, call.kv
        if n == 0:
            return
        from vllm.attention.ops.paged_attention import read_request

        lens = meta.seq_lens_cpu.tolist()
        rows = [read_request(kv, meta.block_table[i], int(lens[i]), call.query.dtype)
                for i in range(meta.num_reqs)]
        k = torch.cat([r[0] for r in rows])
        v = torch.cat([r[1] for r in rows])
        left = call.window_left
        result = aiter.flash_attn_varlen_func(
            q=call.query[:n], k=k, v=v,
            cu_seqlens_q=meta.query_start_loc, cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_seq_len,
            softmax_scale=spec.scale, causal=call.causal,
            window_size=(-1, -1) if left is None else (left, 0),
        )
        out = result[0] if isinstance(result, tuple) else result
        call.output[:n].copy_(out)


AITER_FA_VARLEN: Final = AiterFlashVarlenKernel(
    name="aiter.flash_attn_varlen", module="aiter", platform="rocm",
    layouts=frozenset({KVCacheLayout.AITER_SHUFFLED}), cache_dtypes=_CACHE_DTYPES,
    block_sizes=exactly(16, 32), softcap=False, per_head_scales=True,
)


class RocmAiterFABackend(StandardBackend[RocmAiterFAMetadata]):
    name: ClassVar[str] = "ROCM_AITER_FA"
    kv_cache_layout: ClassVar[KVCacheLayout] = KVCacheLayout.AITER_SHUFFLED
    supported_dtypes: ClassVar[frozenset[torch.dtype]] = HALF
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = _CACHE_DTYPES
    block_sizes: ClassVar[SizeSpec] = exactly(16, 32)
    # D and bs split into 16-byte chunks of the stored element (fp8: 16 values).
    head_sizes: ClassVar[SizeSpec] = multiple_of(16, max=256)
    attention_types: ClassVar[frozenset[AttentionType]] = frozenset({AttentionType.DECODER})
    vendor_package: ClassVar[str | None] = "aiter"
    vendor_kernels: ClassVar[tuple[VendorKernel, ...]] = (AITER_FA_VARLEN,)

    @classmethod
    def get_impl_cls(cls) -> type[RocmAiterFAImpl]:
        return RocmAiterFAImpl

    @classmethod
    def get_builder_cls(cls) -> type[RocmAiterFAMetadataBuilder]:
        return RocmAiterFAMetadataBuilder

    @classmethod
    def get_metadata_cls(cls) -> type[RocmAiterFAMetadata]:
        return RocmAiterFAMetadata


class RocmAiterFAImpl(StandardImpl[RocmAiterFAMetadata]):
    backend = RocmAiterFABackend
