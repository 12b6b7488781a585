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

Metadata adds FlashInfer's CSR page description, and the builder plans the
wrappers (``plan()`` copies host arrays to the device, so it cannot run inside a CUDA
graph): once per step and group, not per layer, outside ``forward``. Decode-only
batches are planned into CUDA-graph wrappers whose device buffers stay put from step
to step, so a graph captured over ``Attention.forward`` replays the plan of the step
whose ``build`` ran last. ``docs/backends.md`` ("FlashInfer planning") gives the rules.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

import torch

from vllm.attention.backend import (
    AttentionLayerSpec,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    PagedAttentionMetadata,
    SizeSpec,
    common_fields,
    exactly,
)
from vllm.attention.backends.standard import StandardBackend, StandardImpl
from vllm.attention.backends.vendor_kernels import HALF, VendorCall, VendorKernel
from vllm.attention.errors import InvalidArgumentError, InvalidTypeError
from vllm.attention.types import AttentionType, KVCacheDType, KVCacheLayout, host_scale

WORKSPACE_BYTES: Final = 128 * 1024 * 1024
"""FlashInfer's float workspace, one per device, shared by every wrapper."""

GRAPH_MAX_PAGES: Final = 1 << 20
"""Pages the CUDA-graph wrappers' index buffer holds (4 MiB of int32, one buffer per
builder): a decode batch using more pages is planned into an ordinary wrapper and its
metadata says ``cuda_graph_safe=False``."""

CUDA_GRAPH_SIZES: Final = frozenset({1, 2, 4, 8, 16, 32, 64, 128, 256, 512})
"""Request counts of the decode batches planned into CUDA-graph wrappers by default.
Each such wrapper holds FlashInfer's 8 MiB integer workspace on the device and as much
pinned host memory, so one per request count a server happens to meet would add up; a
caller that captures other sizes names them (``FlashInferMetadataBuilder.cuda_graph_sizes``),
as a runner pads its decode batches to the sizes it captures."""


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@dataclass(frozen=True)
class PlanKey:
    """What a FlashInfer plan fixes besides the batch: one per distinct layer shape."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    causal: bool
    scale: float
    window_left: int
    logits_soft_cap: float | None
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    kv_layout: str
    """``"NHD"`` or ``"HND"``: the physical order of a block FlashInfer addresses."""

    @classmethod
    def of(cls, spec: AttentionLayerSpec, *, block_size: int, causal: bool,
           q_dtype: torch.dtype, kv_dtype: torch.dtype, hnd: bool) -> PlanKey:
        window = spec.sliding_window
        return cls(
            num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size, block_size=block_size, causal=causal,
            scale=spec.scale, window_left=-1 if window is None else window - 1,
            logits_soft_cap=spec.logits_soft_cap, q_dtype=q_dtype, kv_dtype=kv_dtype,
            kv_layout="HND" if hnd else "NHD",
        )


@dataclass(frozen=True, eq=False)
class FlashInferPlan:
    """A planned wrapper; valid while its wrapper's last plan is this one (``epoch``)."""

    key: PlanKey
    wrapper: Any
    epoch: int
    cuda_graph: bool
    """Planned into a CUDA-graph wrapper (its buffers outlive the step)."""


@dataclass(frozen=True, kw_only=True)
class FlashInferMetadata(PagedAttentionMetadata):
    """The paged batch, FlashInfer's CSR description of each request's pages, and the
    plans the builder made for it."""

    paged_kv_indptr_cpu: torch.Tensor
    """``[num_reqs + 1]`` int32 on the host: request ``i``'s pages are
    ``paged_kv_indices[indptr[i]:indptr[i+1]]``."""
    paged_kv_indices: torch.Tensor
    """``[total_pages]`` int32 on the compute device: block ids, request-major."""
    paged_kv_last_page_len_cpu: torch.Tensor
    """``[num_reqs]`` int32 on the host: tokens used in each request's last page (1..bs)."""
    planner: FlashInferPlanner | None = field(default=None, compare=False, repr=False)
    """The builder's planner (None where FlashInfer cannot run: nothing is planned)."""
    plans: dict[PlanKey, FlashInferPlan] = field(default_factory=dict, compare=False, repr=False)
    """Plans made by ``build`` for the layer shapes the builder has served, plus any
    made on first use in ``forward``."""

    @property
    def cuda_graph_safe(self) -> bool:
        """Every plan of this step is in a CUDA-graph wrapper: a graph captured over a
        layer's forward replays correctly after this step's ``build``."""
        return bool(self.plans) and all(p.cuda_graph for p in self.plans.values())


def _csr_pages(common: CommonAttentionMetadata) -> dict[str, Any]:
    """The used pages of each request, request-major. Positions into the block table are
    computed on the host from the host sequence lengths, so nothing waits on the device
    (a boolean mask over the device table would)."""
    bs = common.block_size
    lens = common.seq_lens_cpu.to(torch.int64)
    pages = (lens + bs - 1) // bs
    indptr = torch.zeros(common.num_reqs + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(pages, 0).to(torch.int32)
    table = common.block_table
    req = torch.repeat_interleave(torch.arange(common.num_reqs), pages)
    col = torch.arange(req.numel()) - indptr[req].to(torch.int64)
    flat = (req * table.shape[1] + col).to(table.device)
    indices = table.reshape(-1).index_select(0, flat).to(torch.int32)
    last = torch.where(lens > 0, lens - (pages - 1) * bs, torch.zeros_like(lens))
    return {
        "paged_kv_indptr_cpu": indptr,
        "paged_kv_indices": indices,
        "paged_kv_last_page_len_cpu": last.to(torch.int32),
    }


@functools.cache
def _workspace(device: str) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def _import_flashinfer() -> Any:
    import flashinfer

    return flashinfer


class FlashInferPlanner:
    """The wrappers of one metadata builder, and the buffers CUDA graphs replay.

    * decode-only batches (every query length 1) of ``n`` requests, ``n`` in
      ``cuda_graph_sizes``: one CUDA-graph wrapper per (plan key, ``n``), all reading
      one set of device buffers the builder owns (page indices up to
      ``graph_max_pages``, indptr and last-page lengths);
    * every other batch: one ordinary wrapper per plan key.

    A wrapper holds the last plan made into it; each plan bumps its epoch, so metadata
    planned earlier is re-planned (eagerly) before it runs again, never run stale.
    The keys served so far are remembered: ``build`` plans each of them up front.
    """

    def __init__(self, device: torch.device, *, graph_max_pages: int = GRAPH_MAX_PAGES,
                 cuda_graph_sizes: frozenset[int] = CUDA_GRAPH_SIZES) -> None:
        self.device = device
        self.graph_max_pages = graph_max_pages
        self.cuda_graph_sizes = cuda_graph_sizes
        self.known_keys: list[PlanKey] = []
        self._wrappers: dict[tuple[PlanKey, int | None], Any] = {}
        self._epochs: dict[int, int] = {}
        self._graph_buffers: dict[str, torch.Tensor] = {}
        self.num_plans = 0

    def is_current(self, plan: FlashInferPlan) -> bool:
        return self._epochs.get(id(plan.wrapper)) == plan.epoch

    def _graph_buffer(self, name: str, size: int) -> torch.Tensor:
        buf = self._graph_buffers.get(name)
        if buf is None or buf.numel() < size:
            if buf is not None:  # grow only the per-request arrays: a few bytes a request
                size = max(size, 2 * buf.numel())
            buf = torch.zeros(size, dtype=torch.int32, device=self.device)
            self._graph_buffers[name] = buf
        return buf

    def _wrapper(self, key: PlanKey, graph_reqs: int | None) -> Any:
        wrapper = self._wrappers.get((key, graph_reqs))
        if wrapper is not None:
            return wrapper
        fi = _import_flashinfer()
        ws = _workspace(str(self.device))
        if graph_reqs is None:
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(ws, key.kv_layout)
        else:
            n = graph_reqs
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(
                ws, key.kv_layout, use_cuda_graph=True,
                qo_indptr_buf=self._graph_buffer("qo_indptr", n + 1)[: n + 1],
                paged_kv_indptr_buf=self._graph_buffer("kv_indptr", n + 1)[: n + 1],
                paged_kv_indices_buf=self._graph_buffer("kv_indices", self.graph_max_pages),
                paged_kv_last_page_len_buf=self._graph_buffer("last_page_len", n)[:n],
            )
        self._wrappers[(key, graph_reqs)] = wrapper
        return wrapper

    def plan(self, key: PlanKey, meta: FlashInferMetadata) -> FlashInferPlan:
        """Plan ``key`` for ``meta``'s batch (host-to-device copies: never under capture)."""
        if _capturing():
            raise InvalidArgumentError(
                "attn_metadata", "a FlashInfer batch not planned for this layer's shape",
                "metadata whose build() planned it before CUDA graph capture: run one step "
                "eagerly first, so the builder learns the layer's shape and dtypes",
            )
        if key not in self.known_keys:
            self.known_keys.append(key)
        pages = int(meta.paged_kv_indptr_cpu[-1]) if meta.num_reqs else 0
        decode = meta.num_reqs > 0 and meta.max_query_len == 1
        graph = (decode and meta.num_reqs in self.cuda_graph_sizes
                 and pages <= self.graph_max_pages)
        wrapper = self._wrapper(key, meta.num_reqs if graph else None)
        wrapper.plan(
            meta.query_start_loc_cpu, meta.paged_kv_indptr_cpu, meta.paged_kv_indices,
            meta.paged_kv_last_page_len_cpu, key.num_heads, key.num_kv_heads,
            key.head_size, key.block_size,
            causal=key.causal, sm_scale=key.scale, window_left=key.window_left,
            logits_soft_cap=key.logits_soft_cap,
            q_data_type=key.q_dtype, kv_data_type=key.kv_dtype,
        )
        self.num_plans += 1
        epoch = self._epochs.get(id(wrapper), 0) + 1
        self._epochs[id(wrapper)] = epoch
        return FlashInferPlan(key, wrapper, epoch, cuda_graph=graph)


class FlashInferMetadataBuilder(AttentionMetadataBuilder[FlashInferMetadata]):
    """Builds the CSR page description and plans every layer shape served so far.

    The planner exists where FlashInfer's kernel can run on the builder's device. A
    builder learns a layer shape (heads, scale, window, dtypes) at the first
    ``forward`` that needs it (planned then, eagerly); every later ``build`` plans it
    up front, outside any CUDA graph.
    """

    def __init__(self, spec: AttentionLayerSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        self.planner: FlashInferPlanner | None = (
            FlashInferPlanner(device) if FLASHINFER_KERNEL.unavailable_reason(device) is None
            else None
        )
        self._graph_sizes = CUDA_GRAPH_SIZES

    @property
    def cuda_graph_sizes(self) -> frozenset[int]:
        """Request counts of the decode batches planned for CUDA-graph replay."""
        return self._graph_sizes

    @cuda_graph_sizes.setter
    def cuda_graph_sizes(self, sizes: Iterable[int]) -> None:
        got: list[object] = list(sizes)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in got):
            raise InvalidArgumentError("cuda_graph_sizes", got, "positive request counts")
        self._graph_sizes = frozenset(n for n in got if isinstance(n, int))
        if self.planner is not None:
            self.planner.cuda_graph_sizes = self._graph_sizes

    def build(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        meta = FlashInferMetadata(**common_fields(common), **_csr_pages(common),
                                  planner=self.planner)
        if self.planner is not None and common.num_reqs:
            for key in self.planner.known_keys:
                if key.block_size == common.block_size and key.causal == common.causal:
                    meta.plans[key] = self.planner.plan(key, meta)
        return meta


@dataclass(frozen=True)
class FlashInferPagedKernel(VendorKernel):
    """``flashinfer.BatchPrefillWithPagedKVCacheWrapper`` (FlashInfer picks its sm90
    kernels on Hopper), planned by the builder; fp8 caches with one scale per tensor."""

    def run(self, call: VendorCall) -> None:
        meta = call.meta
        if not isinstance(meta, FlashInferMetadata):
            raise InvalidTypeError("attn_metadata", type(meta).__name__, "FlashInferMetadata")
        n, spec, kv = call.num_tokens, call.spec, call.kv
        if n == 0:
            return
        hnd = call.layout is KVCacheLayout.SPLIT_HND
        key = PlanKey.of(spec, block_size=kv.block_size, causal=call.causal,
                         q_dtype=call.query.dtype, kv_dtype=call.kv_cache.dtype, hnd=hnd)
        planner = meta.planner
        if planner is None:  # metadata built where FlashInfer could not run
            planner = FlashInferPlanner(kv.device)
            object.__setattr__(meta, "planner", planner)
        plan = meta.plans.get(key)
        if plan is None or not planner.is_current(plan):
            plan = planner.plan(key, meta)
            meta.plans[key] = plan
        if not plan.cuda_graph and _capturing():  # its buffers would not outlive the step
            raise InvalidArgumentError(
                "attn_metadata",
                f"a FlashInfer batch of {meta.num_reqs} requests (longest query "
                f"{meta.max_query_len}) planned outside the CUDA-graph buffers",
                "a decode batch whose request count is in the builder's cuda_graph_sizes "
                f"{sorted(planner.cuda_graph_sizes)} to capture it (set "
                "FlashInferMetadataBuilder.cuda_graph_sizes to the sizes you capture)",
            )
        # HND: hand FlashInfer the physical (nb, 2, H, bs, D) tensor it addresses.
        cache = call.kv_cache.permute(0, 1, 3, 2, 4) if hnd else call.kv_cache
        scaled = kv.cache_dtype != "auto"
        out = call.output[:n]
        result = plan.wrapper.run(
            call.query[:n], cache,
            k_scale=host_scale(kv.k_scale) if scaled else None,
            v_scale=host_scale(kv.v_scale) if scaled else None,
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
