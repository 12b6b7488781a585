"""The Triton kernels of the cache writers and their launchers.

``triton_kernels`` holds every ``@triton.jit`` function of the writes; the other
modules turn tensors into launches of them and never import Triton at import time.
The writers one folder up validate every argument before calling in here.
Layouts: ``docs/layouts.md``; which vendor runs which path: ``docs/kernels.md``.
"""

from __future__ import annotations

from vllm.attention.writers.kernels.launch import (
    LIVE_ROLES,
    ROPE_OPTIONS,
    ROPE_TILED_FROM,
    TILED_MIN_TOKENS,
    TRITON_DEFAULT_WARPS,
    BoundLaunch,
    CachedLaunch,
    Launch,
    ScatterKernel,
    ScatterTarget,
    fast_division,
    fp8_ds_mla,
    fp8_ds_mla_launch,
    hardware_fp8,
    hardware_fp8_nan,
    hooks_quiet,
    input_tiles,
    load_kernels,
    packed_widen,
    pairs_fit,
    per_token_head,
    per_token_head_launch,
    rope_geometry,
    rope_kv_launch,
    rope_launch,
    scatter_kernel_for,
    scatter_kv,
    scatter_kv_launch,
    tokens_per_program,
    triton_importable,
)

__all__ = [
    "LIVE_ROLES",
    "ROPE_OPTIONS",
    "ROPE_TILED_FROM",
    "TILED_MIN_TOKENS",
    "TRITON_DEFAULT_WARPS",
    "BoundLaunch",
    "CachedLaunch",
    "Launch",
    "ScatterKernel",
    "ScatterTarget",
    "fast_division",
    "fp8_ds_mla",
    "fp8_ds_mla_launch",
    "hardware_fp8",
    "hardware_fp8_nan",
    "hooks_quiet",
    "input_tiles",
    "load_kernels",
    "packed_widen",
    "pairs_fit",
    "per_token_head",
    "per_token_head_launch",
    "rope_geometry",
    "rope_kv_launch",
    "rope_launch",
    "scatter_kernel_for",
    "scatter_kv",
    "scatter_kv_launch",
    "tokens_per_program",
    "triton_importable",
]
