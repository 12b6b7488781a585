"""What the nine standard (non-MLA) backends share.

* :class:`StandardBackend`: the declarations every one of them adds to
  :class:`~vllm.attention.backend.AttentionBackend` (per-dtype tolerances, vendor
  kernels as data, the portable path it falls back to) and the path choice the
  CLI and registry report.
* :class:`StandardImpl`: compute over the backend's own layout. Per call it runs
  the first vendor kernel that can run here and takes the call, else the
  portable path (on CUDA: torch's flash varlen kernel for prefills, Triton, or
  compiled flex_attention; torch anywhere), and records which one ran in
  ``last_compute_path``.

Batch metadata: each backend has its own frozen dataclass, a subclass of
:class:`~vllm.attention.backend.PagedAttentionMetadata` (plus what its kernel
needs); none carries ``slot_mapping``. Table and paths: ``docs/backends.md``.
"""

from __future__ import annotations

import importlib.util
from typing import Any, ClassVar, Literal, TypeVar

import torch

from vllm.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerProtocol,
    AttentionLayerSpec,
    ComputePath,
    PagedAttentionMetadata,
)
from vllm.attention.backends.vendor_kernels import VendorCall, VendorKernel
from vllm.attention.errors import InvalidArgumentError, UnsupportedBackendError
from vllm.attention.ops.flex_paged import FlexMode
from vllm.attention.ops.paged_kv import PagedKV
from vllm.attention.ops.reference import attend
from vllm.attention.types import AttentionType, KVCacheDType, KVCacheLayout
from vllm.attention.writer import KVCacheWriter

SM = TypeVar("SM", bound=PagedAttentionMetadata)

PortablePath = Literal["triton", "flex_attention"]


def _portable_unavailable(path: PortablePath, device: torch.device) -> str | None:
    if path == "flex_attention":
        return _flex_unavailable(device)
    if device.type != "cuda":  # as ops.paged_attention.resolve_path("auto"): no interpreter
        return f"device={device.type}, the Triton kernels run on cuda"
    from vllm.attention.ops.paged_attention import triton_unavailable_reason

    return triton_unavailable_reason(device)


def _flex_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"device={device.type}, flex_attention runs (compiled) on cuda only here"
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    from vllm.attention.ops.triton_paged_attention import triton_import_error

    err = triton_import_error()
    return None if err is None else f"torch.compile of flex_attention needs triton ({err})"


def _flash_varlen_unavailable(device: torch.device) -> str | None:
    from vllm.attention.ops.flash_varlen import flash_varlen_unavailable

    return flash_varlen_unavailable(device)


def _flash_varlen_note(device: torch.device) -> str:
    reason = _flash_varlen_unavailable(device)
    if reason is not None:
        return f"flash_varlen (prefill): {reason}"
    from vllm.attention.ops.flash_varlen import MAX_HEAD_SIZE, writes_in_place

    copy = "" if writes_in_place() else "; this torch has no out-variant, so the result is copied"
    return ("flash_varlen takes compute-heavy prefills (fp16/bf16, auto cache, head size "
            f"<= {MAX_HEAD_SIZE}, no soft cap) over K/V gathered from the cache{copy}; "
            "other calls run triton")


class StandardBackend(AttentionBackend[SM]):
    """Declarations the nine standard backends add; still class data only."""

    distinct_v_head_size: ClassVar[bool] = False
    """True when V's head size may differ from K's (the kit then uses ``Dv = D // 2``)."""
    vendor_kernels: ClassVar[tuple[VendorKernel, ...]] = ()
    """Vendor kernels in order of preference; each declares what it takes."""
    portable_path: ClassVar[PortablePath] = "triton"
    """What runs on CUDA when no vendor kernel takes the call (torch when it cannot run)."""
    flex_mode: ClassVar[FlexMode] = "auto"
    """How the flex path presents pages (``vllm.attention.ops.flex_paged``): ``auto``
    reads decode batches in place through the page table (compiled) and gathers the
    positions of every other batch."""

    @classmethod
    def get_kv_cache_writer(cls, cache_dtype: KVCacheDType = "auto") -> KVCacheWriter:
        """The standard writer of this backend's layout for ``cache_dtype``."""
        from vllm.attention.writers import writer_for_layout

        if cache_dtype not in cls.supported_kv_cache_dtypes:
            raise InvalidArgumentError(
                "cache_dtype", cache_dtype,
                f"one of {', '.join(sorted(cls.supported_kv_cache_dtypes))} for {cls.name}",
            )
        return writer_for_layout(cls.kv_cache_layout_for(cache_dtype))

    @classmethod
    def layer_unsupported_reasons(cls, spec: AttentionLayerSpec) -> list[str]:
        """Why this backend cannot run a layer of ``spec``: its options only (the model
        dtype and block size are checked when the cache is allocated and bound)."""
        reasons = cls.unsupported_reasons(
            dtype=min(cls.supported_dtypes, key=str), head_size=spec.head_size,
            block_size=cls.block_sizes.examples((16, 32, 64, 128, 256))[0],
            kv_cache_dtype=spec.kv_cache_dtype, attn_type=spec.attn_type,
            sliding_window=spec.sliding_window, logits_soft_cap=spec.logits_soft_cap,
        )
        if spec.head_size_v not in (None, spec.head_size) and not cls.distinct_v_head_size:
            reasons.append(f"head_size_v={spec.head_size_v}, {cls.name} needs None or "
                           f"head_size={spec.head_size}")
        return reasons

    # -- which path runs ----------------------------------------------------------------
    @classmethod
    def usable_vendor_kernels(cls, device: torch.device) -> list[VendorKernel]:
        """The vendor kernels that can run on ``device`` (imported, right platform/arch)."""
        return [k for k in cls.vendor_kernels if k.unavailable_reason(device) is None]

    @classmethod
    def fallback_path(cls, device: torch.device) -> ComputePath:
        """The portable path on ``device``: ``portable_path`` where it runs, else torch."""
        return cls.portable_path if _portable_unavailable(cls.portable_path, device) is None else "torch"

    @classmethod
    def compute_path(cls, device: torch.device) -> ComputePath:
        usable = cls.usable_vendor_kernels(device)
        return usable[0].name if usable else cls.fallback_path(device)

    @classmethod
    def runnable_paths(cls, device: torch.device) -> list[ComputePath]:
        """Every path a call may run on ``device``: the usable vendor kernels, then the
        portable ones (with Triton, torch's flash varlen kernel takes prefills; compiled
        flex_attention may run eagerly), torch."""
        paths: list[ComputePath] = [k.name for k in cls.usable_vendor_kernels(device)]
        fallback = cls.fallback_path(device)
        if fallback == "triton" and _flash_varlen_unavailable(device) is None:
            paths.append("flash_varlen")
        paths.append(fallback)
        if fallback == "flex_attention":
            paths.append("flex_attention.eager")  # where Inductor cannot lower a call
        if fallback != "torch":
            paths.append("torch")
        return paths

    @classmethod
    def compute_path_notes(cls, device: torch.device) -> list[str]:
        notes: list[str] = []
        usable = cls.usable_vendor_kernels(device)
        for kernel in cls.vendor_kernels:
            reason = kernel.unavailable_reason(device)
            if reason is not None:
                notes.append(f"{kernel.name}: {reason}")
        fallback = cls.fallback_path(device)
        if usable:
            notes.append(f"{usable[0].name} takes {usable[0].describe()}; other calls run "
                         f"{fallback}")
        elif fallback == "torch":
            reason = _portable_unavailable(cls.portable_path, device)
            notes.append(f"{cls.portable_path}: {reason}")
        if fallback == "triton":
            notes.append(_flash_varlen_note(device))
        elif fallback == "flex_attention":
            from vllm.attention.ops.flex_paged import compiled_note

            notes.append(compiled_note(device))
        return notes


class StandardImpl(AttentionImpl[SM]):
    """Compute for a :class:`StandardBackend`; never writes ``kv_cache``.

    Subclasses set ``backend`` (their backend class). ``last_compute_path`` names the
    path the last :meth:`forward` ran; ``last_fallbacks`` says why each vendor kernel
    that could run here did not take that call.
    """

    backend: ClassVar[type[StandardBackend[Any]]]

    def __init__(self, spec: AttentionLayerSpec) -> None:
        super().__init__(spec)
        reasons = self.backend.layer_unsupported_reasons(spec)
        if reasons:
            raise UnsupportedBackendError(
                f"{self.backend.name} cannot run this layer: " + "; ".join(reasons)
            )
        self.last_compute_path: ComputePath | None = None
        self.last_fallbacks: list[str] = []

    def is_causal(self, meta: SM) -> bool:
        return self.spec.attn_type is AttentionType.DECODER and meta.causal

    def paged_kv(self, layer: AttentionLayerProtocol, kv_cache: torch.Tensor,
                 meta: SM) -> PagedKV:
        """``kv_cache`` described through the backend's layout for the layer's cache format."""
        quant = layer.kv_quant
        layout: KVCacheLayout = self.backend.kv_cache_layout_for(quant.kv_cache_dtype)
        return PagedKV.from_cache(
            kv_cache, layout, quant, block_size=meta.block_size,
            num_kv_heads=self.spec.num_kv_heads, head_size=self.spec.head_size,
            head_size_v=self.spec.head_size_v,
        )

    def tree_mask(self, meta: SM) -> torch.Tensor | None:
        """``[num_tokens, max_query_len]`` bool draft-tree mask, or None (TREE_ATTN only)."""
        return None

    def forward(
        self,
        layer: AttentionLayerProtocol,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: SM,
        output: torch.Tensor,
    ) -> torch.Tensor:
        self.last_fallbacks = []
        if self.spec.attn_type is AttentionType.ENCODER_ONLY:
            self.last_compute_path = "torch"
            return encoder_only_attention(self.spec, query, key, value, attn_metadata, output)
        kv = self.paged_kv(layer, kv_cache, attn_metadata)
        call = VendorCall(
            spec=self.spec, query=query, kv_cache=kv_cache, kv=kv, meta=attn_metadata,
            output=output, causal=self.is_causal(attn_metadata),
            layout=self.backend.kv_cache_layout_for(kv.cache_dtype),
            tree_mask=self.tree_mask(attn_metadata),
        )
        for kernel in self.backend.usable_vendor_kernels(kv.device):
            why = kernel.rejects(call)
            if why is None:
                kernel.run(call)
                self.last_compute_path = kernel.name
                return output
            self.last_fallbacks.append(f"{kernel.name}: {why}")
        return self.run_portable(call)

    def run_portable(self, call: VendorCall) -> torch.Tensor:
        """flex_attention, or the paged path :func:`choose_path` picks (torch's flash
        varlen kernel for compute-heavy prefills, Triton, torch)."""
        from vllm.attention.ops.paged_attention import choose_path, paged_attention

        path = self.backend.fallback_path(call.kv.device)
        spec = self.spec
        if path == "flex_attention":
            from vllm.attention.ops import flex_paged

            flex_paged.flex_paged_attention(
                call.query, call.kv, call.meta, scale=spec.scale, output=call.output,
                causal=call.causal, sliding_window=spec.sliding_window,
                logits_soft_cap=spec.logits_soft_cap, tree_mask=call.tree_mask,
                mode=self.backend.flex_mode,
            )
            run = flex_paged.last_run
            eager = run is not None and not run.compiled
            self.last_compute_path = "flex_attention.eager" if eager else "flex_attention"
            if run is not None and run.eager_reason is not None:
                self.last_fallbacks.append(f"flex_attention compiled: {run.eager_reason}")
            return call.output
        chosen = choose_path(
            call.query, call.kv, call.meta, causal=call.causal,
            sliding_window=spec.sliding_window, logits_soft_cap=spec.logits_soft_cap,
            tree_mask=call.tree_mask, paged="triton" if path == "triton" else "torch",
        )
        paged_attention(
            call.query, call.kv, call.meta, scale=spec.scale, output=call.output,
            causal=call.causal, sliding_window=spec.sliding_window,
            logits_soft_cap=spec.logits_soft_cap, tree_mask=call.tree_mask, path=chosen,
        )
        self.last_compute_path = chosen
        return call.output


def encoder_only_attention(
    spec: AttentionLayerSpec,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    meta: PagedAttentionMetadata,
    output: torch.Tensor,
) -> torch.Tensor:
    """Bidirectional attention over this step's own K/V (no cache), per request, in float32.

    ``key``/``value``: ``[num_tokens, num_kv_heads, head_size(_v)]``, rows as ``query``'s.
    """
    if key is None or value is None:
        raise InvalidArgumentError("key/value", None, "tensors for attn_type=encoder_only")
    starts = meta.query_start_loc_cpu.tolist()
    for i in range(meta.num_reqs):
        qs, qe = int(starts[i]), int(starts[i + 1])
        if qe == qs:
            continue
        out = attend(
            query[qs:qe].float(), key[qs:qe].float(), value[qs:qe].float(), scale=spec.scale,
            causal=False, sliding_window=None, logits_soft_cap=spec.logits_soft_cap,
        )
        output[qs:qe] = out.to(output.dtype)
    return output


__all__ = [
    "StandardBackend",
    "StandardImpl",
    "encoder_only_attention",
]
