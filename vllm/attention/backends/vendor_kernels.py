"""Vendor attention kernels as declared data plus one ``run`` each.

A :class:`VendorKernel` says where it runs (platform, CUDA arch, import name) and
which calls it takes (dtypes, cache formats, layouts, head/block sizes, features);
:meth:`VendorKernel.rejects` derives "why not this call" from those declarations,
so a call it does not take runs the backend's portable path instead, and the
backend's ``compute_path_notes`` can say so. Every vendor import happens inside
``unavailable_reason`` / ``run``, only on a device of the right platform, so
``import vllm`` never needs a vendor package.

The FlashAttention kernels live here because FLASH_ATTN and FLASH_ATTN_DIFFKV
share them; FlashInfer's and AITER's live in their backends' modules.
"""

from __future__ import annotations

import abc
import functools
import importlib
import warnings
from dataclasses import dataclass
from typing import Any, Final, Literal

import torch

from vllm.attention.backend import (
    AttentionLayerSpec,
    PagedAttentionMetadata,
    SizeSpec,
    dtype_name,
    multiple_of,
)
from vllm.attention.layouts import diffkv_views, split_kv_views
from vllm.attention.ops.paged_kv import PagedKV
from vllm.attention.types import KVCacheDType, KVCacheLayout
from vllm.attention.writers.kernels.device import gpu_of

Platform = Literal["cuda", "rocm"]
HALF: Final = frozenset({torch.float16, torch.bfloat16})


@dataclass(frozen=True, eq=False)
class VendorCall:
    """One attention call, as every compute path sees it.

    ``query``: ``[num_tokens, num_heads, head_size]``; ``output``:
    ``[num_tokens, num_heads, head_size_v]`` (rows ``< query_start_loc[-1]`` are
    written); ``kv_cache``: the backend's logical cache (read only); ``kv``: the same
    cache described through ``layout``; ``tree_mask``: ``[num_tokens, max_query_len]``
    bool or None (TREE_ATTN).
    """

    spec: AttentionLayerSpec
    query: torch.Tensor
    kv_cache: torch.Tensor
    kv: PagedKV
    meta: PagedAttentionMetadata
    output: torch.Tensor
    causal: bool
    layout: KVCacheLayout
    tree_mask: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.meta.query_start_loc_cpu[-1]) if self.meta.num_reqs else 0

    @property
    def window_left(self) -> int | None:
        """Keys a query sees before its own position (FlashAttention's ``window_size[0]``)."""
        sw = self.spec.sliding_window
        return None if sw is None else sw - 1


def device_platform(device: torch.device) -> str:
    """``rocm`` for a ROCm GPU (torch calls it ``cuda``), else the device type."""
    if device.type == "cuda" and torch.version.hip is not None:
        return "rocm"
    return device.type


@functools.cache
def import_error(module: str) -> str | None:
    """Why ``import module`` fails here (None when it works); cached per process."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a vendor's import-time notice is not a failure
            importlib.import_module(module)
    except Exception as exc:  # any import-time failure means "this kernel is absent"
        return f"{type(exc).__name__}: {exc}"
    return None


def _names(items: frozenset[str]) -> str:
    return "/".join(sorted(items))


@dataclass(frozen=True)
class VendorKernel(abc.ABC):
    """A vendor kernel: where it runs and which calls it takes (class-level data)."""

    name: str
    """The compute-path name the registry, CLI and tests report."""
    module: str
    """Import name that must import for the kernel to run."""
    platform: Platform
    layouts: frozenset[KVCacheLayout]
    dtypes: frozenset[torch.dtype] = HALF
    cache_dtypes: frozenset[KVCacheDType] = frozenset({"auto"})
    head_sizes: SizeSpec = multiple_of(8, max=256)
    block_sizes: SizeSpec = multiple_of(16)
    arch_majors: frozenset[int] | None = None
    """CUDA compute-capability majors it is built for (None: any on its platform)."""
    softcap: bool = True
    sliding_window: bool = True
    per_head_scales: bool = False
    non_causal: bool = True

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Why the kernel cannot run on ``device`` at all (None: it can)."""
        plat = device_platform(device)
        if plat != self.platform:
            need = "ROCm" if self.platform == "rocm" else "CUDA"
            return f"device={plat}, {self.module.split('.')[0]} needs {need}"
        gpu = gpu_of(device)  # (not None: the platform is CUDA or ROCm)
        if self.arch_majors is not None and gpu is not None:
            major, minor = gpu.capability
            if major not in self.arch_majors:
                allowed = ", ".join(f"sm{m}x" for m in sorted(self.arch_majors))
                return f"compute capability {major}.{minor}, {self.name} runs on {allowed}"
        err = import_error(self.module)
        return None if err is None else f"{self.module} not importable ({err})"

    def rejects(self, call: VendorCall) -> str | None:
        """Why the kernel does not take ``call`` (None: it does)."""
        spec, kv = call.spec, call.kv
        if call.query.dtype not in self.dtypes:
            return (f"dtype={dtype_name(call.query.dtype)}, takes "
                    f"{'/'.join(sorted(dtype_name(d) for d in self.dtypes))}")
        if kv.cache_dtype not in self.cache_dtypes:
            return f"kv_cache_dtype={kv.cache_dtype!r}, takes {_names(self.cache_dtypes)}"
        if call.layout not in self.layouts:
            return f"layout={call.layout.value}, takes {_names(frozenset(x.value for x in self.layouts))}"
        for what, size in (("head_size", kv.head_size), ("head_size_v", kv.head_size_v)):
            if not self.head_sizes.admits(size):
                return f"{what}={size}, takes {self.head_sizes.describe()}"
        if not self.block_sizes.admits(kv.block_size):
            return f"block_size={kv.block_size}, takes {self.block_sizes.describe()}"
        if spec.logits_soft_cap is not None and not self.softcap:
            return f"logits_soft_cap={spec.logits_soft_cap}, takes none"
        if spec.sliding_window is not None and not self.sliding_window:
            return f"sliding_window={spec.sliding_window}, takes none"
        if spec.sliding_window is not None and not call.causal:
            return f"sliding_window={spec.sliding_window} on non-causal attention, takes causal only"
        if not call.causal and not self.non_causal:
            return "non-causal attention, takes causal only"
        if kv.k_scale.numel() > 1 and kv.cache_dtype != "auto" and not self.per_head_scales:
            return f"k_scale/v_scale per kv head ({kv.k_scale.numel()}), takes one scale"
        if call.tree_mask is not None:
            return "a draft-tree mask"
        return self.call_rejects(call)

    def call_rejects(self, call: VendorCall) -> str | None:
        """Kernel-specific limits beyond the declared data (None: none apply)."""
        return None

    def describe(self) -> str:
        """What calls it takes, for ``compute_path_notes`` and the docs."""
        parts = [
            "dtype " + "/".join(sorted(dtype_name(d) for d in self.dtypes)),
            "cache " + _names(self.cache_dtypes),
            "block_size " + self.block_sizes.describe(),
            "head_size " + self.head_sizes.describe(),
        ]
        if not self.softcap:
            parts.append("no soft cap")
        if not self.sliding_window:
            parts.append("no sliding window")
        if not self.per_head_scales and self.cache_dtypes != frozenset({"auto"}):
            parts.append("per-tensor scales")
        return ", ".join(parts)

    @abc.abstractmethod
    def run(self, call: VendorCall) -> None:
        """Fill ``call.output[:num_tokens]``."""


def nhd_views(call: VendorCall) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[nb, bs, H, D]`` views of the cache (split NHD / K-V-first / DiffKV)."""
    if call.layout is KVCacheLayout.DIFFKV_PACKED:
        return diffkv_views(call.kv_cache, call.spec.head_size)
    return split_kv_views(call.kv_cache, call.layout)


def _fa_window(call: VendorCall, none: Any) -> tuple[Any, Any]:
    left = call.window_left
    if left is None:
        return (none, none)
    return (left, 0)


@dataclass(frozen=True)
class FlashAttnCuteKernel(VendorKernel):
    """flash-attn-4's ``flash_attn.cute.flash_attn_varlen_func`` with a page table.

    It reads pages through ``page_table`` with ``seqused_k``. A page size equal to the
    kernel's key tile (64..144, by head size) takes its TMA page path, which loads
    whole pages: rows past a sequence's length in its last page are then read and must
    be finite, which the paged-cache contract does not promise (freshly allocated or
    recycled blocks hold anything). Block sizes below 64 always take the row-gather
    path, so only those are routed here.
    """

    def run(self, call: VendorCall) -> None:
        from flash_attn.cute import flash_attn_varlen_func

        meta, spec, n = call.meta, call.spec, call.num_tokens
        if n == 0:
            return
        k, v = nhd_views(call)
        result = flash_attn_varlen_func(
            call.query[:n], k, v,
            cu_seqlens_q=meta.query_start_loc,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            seqused_k=meta.seq_lens,
            page_table=meta.block_table,
            softmax_scale=spec.scale,
            causal=call.causal,
            window_size=_fa_window(call, None),
            softcap=spec.logits_soft_cap or 0.0,
        )
        out = result[0] if isinstance(result, tuple) else result
        call.output[:n].copy_(out)


@dataclass(frozen=True)
class FlashAttn2Kernel(VendorKernel):
    """flash-attn 2's ``flash_attn_varlen_func(..., block_table=)``: its paged path needs
    pages of a multiple of 256 tokens."""

    def run(self, call: VendorCall) -> None:
        from flash_attn.flash_attn_interface import flash_attn_varlen_func

        meta, spec, n = call.meta, call.spec, call.num_tokens
        if n == 0:
            return
        k, v = nhd_views(call)
        cu_k = torch.zeros(meta.num_reqs + 1, dtype=torch.int32, device=k.device)
        cu_k[1:] = torch.cumsum(meta.seq_lens, 0)
        out = flash_attn_varlen_func(
            call.query[:n], k, v, meta.query_start_loc, cu_k,
            meta.max_query_len, meta.max_seq_len,
            softmax_scale=spec.scale, causal=call.causal,
            window_size=_fa_window(call, -1), softcap=spec.logits_soft_cap or 0.0,
            block_table=meta.block_table,
        )
        call.output[:n].copy_(out)


FA_PAGED_LAYOUTS: Final = frozenset({KVCacheLayout.SPLIT_NHD, KVCacheLayout.DIFFKV_PACKED})

FLASH_ATTN_CUTE: Final = FlashAttnCuteKernel(
    name="flash_attn.cute", module="flash_attn.cute", platform="cuda",
    layouts=FA_PAGED_LAYOUTS, arch_majors=frozenset({9, 10, 11}),
    block_sizes=SizeSpec(multiple_of=16, min=16, max=48),
)
"""flash-attn-4 on Hopper / Blackwell (its paged KV does not run on sm8x or sm12x)."""

FLASH_ATTN_2: Final = FlashAttn2Kernel(
    # flash-attn-4 alone leaves ``flash_attn`` importable as a namespace package: probe
    # flash-attn 2's own interface module instead.
    name="flash_attn", module="flash_attn.flash_attn_interface", platform="cuda",
    layouts=frozenset({KVCacheLayout.SPLIT_NHD}), arch_majors=frozenset({8, 9}),
    block_sizes=SizeSpec(multiple_of=256, min=256),
)
"""flash-attn 2 on Ampere / Ada / Hopper, for pages of 256k tokens (K and V of one head size)."""
