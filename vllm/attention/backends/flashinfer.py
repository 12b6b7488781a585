"""FLASHINFER: FlashInfer's batch prefill/append kernel over a paged cache.

Two registered classes share everything but the physical order of a block:

* ``FLASHINFER`` (:class:`FlashInferBackend`): NHD, logical = physical
  ``(nb, 2, bs, H, D)``;
* ``FLASHINFER_HND`` (:class:`FlashInferHNDBackend`): HND, logical
  ``(nb, 2, bs, H, D)`` over physical ``(nb, 2, H, bs, D)`` (FlashInfer's trtllm-gen
  decode kernels on Blackwell want it). Chosen by name only (``select_backend(
  preferred="FLASHINFER_HND")``, ``Attention(backend=get_backend("FLASHINFER_HND"))``):
  automatic selection meets FLASHINFER first, and both declare the same
  capabilities, so a model never switches layout behind the caller's back.

Metadata adds FlashInfer's CSR page description (built once per step by the
builder); the wrapper is planned on every call, against a per-device workspace.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar, Final

import torch

from vllm.attention.backend import (
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    PagedAttentionMetadata,
    SizeSpec,
    common_fields,
    exactly,
)
from vllm.attention.backends.standard import StandardBackend, StandardImpl
from vllm.attention.backends.vendor_kernels import HALF, VendorCall, VendorKernel
from vllm.attention.errors import InvalidTypeError
from vllm.attention.types import AttentionType, KVCacheDType, KVCacheLayout

WORKSPACE_BYTES: Final = 128 * 1024 * 1024
"""FlashInfer's float workspace, one per device, shared by every layer."""


@dataclass(frozen=True, kw_only=True)
class FlashInferMetadata(PagedAttentionMetadata):
    """The paged batch plus FlashInfer's CSR description of each request's pages."""

    paged_kv_indptr_cpu: torch.Tensor
    """``[num_reqs + 1]`` int32 on the host: request ``i``'s pages are
    ``paged_kv_indices[indptr[i]:indptr[i+1]]``."""
    paged_kv_indices: torch.Tensor
    """``[total_pages]`` int32 on the compute device: block ids, request-major."""
    paged_kv_last_page_len_cpu: torch.Tensor
    """``[num_reqs]`` int32 on the host: tokens used in each request's last page (1..bs)."""


def _csr_pages(common: CommonAttentionMetadata) -> dict[str, Any]:
    bs = common.block_size
    lens = common.seq_lens_cpu.to(torch.int64)
    pages = (lens + bs - 1) // bs
    indptr = torch.zeros(common.num_reqs + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(pages, 0).to(torch.int32)
    width = common.block_table.shape[1]
    used = torch.arange(width).unsqueeze(0) < pages.unsqueeze(1)
    indices = common.block_table[used.to(common.block_table.device)].to(torch.int32)
    last = torch.where(lens > 0, lens - (pages - 1) * bs, torch.zeros_like(lens))
    return {
        "paged_kv_indptr_cpu": indptr,
        "paged_kv_indices": indices,
        "paged_kv_last_page_len_cpu": last.to(torch.int32),
    }


class FlashInferMetadataBuilder(AttentionMetadataBuilder[FlashInferMetadata]):
    def build(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        return FlashInferMetadata(**common_fields(common), **_csr_pages(common))


@functools.cache
def _workspace(device: str) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


@dataclass(frozen=True)
class FlashInferPagedKernel(VendorKernel):
    """``flashinfer.BatchPrefillWithPagedKVCacheWrapper``: one plan + run per call
    (prefill and decode rows alike); fp8 caches with one scale per tensor."""

    def run(self, call: VendorCall) -> None:
        import flashinfer

        meta = call.meta
        if not isinstance(meta, FlashInferMetadata):
            raise InvalidTypeError("attn_metadata", type(meta).__name__, "FlashInferMetadata")
        n, spec, kv = call.num_tokens, call.spec, call.kv
        if n == 0:
            return
        hnd = call.layout is KVCacheLayout.SPLIT_HND
        wrapper: Any = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            _workspace(str(kv.device)), "HND" if hnd else "NHD"
        )
        wrapper.plan(
            meta.query_start_loc_cpu, meta.paged_kv_indptr_cpu, meta.paged_kv_indices,
            meta.paged_kv_last_page_len_cpu, spec.num_heads, spec.num_kv_heads,
            spec.head_size, kv.block_size,
            causal=call.causal, sm_scale=spec.scale,
            window_left=-1 if call.window_left is None else call.window_left,
            logits_soft_cap=spec.logits_soft_cap,
            q_data_type=call.query.dtype, kv_data_type=call.kv_cache.dtype,
        )
        # HND: hand FlashInfer the physical (nb, 2, H, bs, D) tensor it addresses.
        cache = call.kv_cache.permute(0, 1, 3, 2, 4) if hnd else call.kv_cache
        scaled = kv.cache_dtype != "auto"
        out = call.output[:n]
        result = wrapper.run(
            call.query[:n], cache,
            k_scale=float(kv.k_scale.item()) if scaled else None,
            v_scale=float(kv.v_scale.item()) if scaled else None,
            out=out if out.is_contiguous() else None,
        )
        if result.data_ptr() != out.data_ptr():
            out.copy_(result)


_CACHE_DTYPES: Final[frozenset[KVCacheDType]] = frozenset({"auto", "fp8", "fp8_e4m3", "fp8_e5m2"})

FLASHINFER_KERNEL: Final = FlashInferPagedKernel(
    name="flashinfer", module="flashinfer", platform="cuda",
    layouts=frozenset({KVCacheLayout.SPLIT_NHD, KVCacheLayout.SPLIT_HND}),
    cache_dtypes=_CACHE_DTYPES, head_sizes=exactly(64, 128, 256),
    block_sizes=exactly(16, 32, 64), arch_majors=frozenset({8, 9, 10, 12}),
)


class FlashInferBackend(StandardBackend[FlashInferMetadata]):
    name: ClassVar[str] = "FLASHINFER"
    kv_cache_layout: ClassVar[KVCacheLayout] = KVCacheLayout.SPLIT_NHD
    supported_dtypes: ClassVar[frozenset[torch.dtype]] = HALF
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = _CACHE_DTYPES
    block_sizes: ClassVar[SizeSpec] = exactly(16, 32, 64)
    head_sizes: ClassVar[SizeSpec] = exactly(64, 128, 256)
    attention_types: ClassVar[frozenset[AttentionType]] = frozenset({AttentionType.DECODER})
    vendor_package: ClassVar[str | None] = "flashinfer"
    vendor_kernels: ClassVar[tuple[VendorKernel, ...]] = (FLASHINFER_KERNEL,)

    @classmethod
    def get_impl_cls(cls) -> type[FlashInferImpl]:
        return FlashInferImpl

    @classmethod
    def get_builder_cls(cls) -> type[FlashInferMetadataBuilder]:
        return FlashInferMetadataBuilder

    @classmethod
    def get_metadata_cls(cls) -> type[FlashInferMetadata]:
        return FlashInferMetadata


class FlashInferHNDBackend(FlashInferBackend):
    """FLASHINFER with the HND physical order (module docstring says when to pick it)."""

    name: ClassVar[str] = "FLASHINFER_HND"
    kv_cache_layout: ClassVar[KVCacheLayout] = KVCacheLayout.SPLIT_HND

    @classmethod
    def get_impl_cls(cls) -> type[FlashInferImpl]:
        return FlashInferHNDImpl


class FlashInferImpl(StandardImpl[FlashInferMetadata]):
    backend = FlashInferBackend


class FlashInferHNDImpl(FlashInferImpl):
    backend = FlashInferHNDBackend
