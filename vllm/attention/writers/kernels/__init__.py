"""The Triton kernels of the cache writers and their launchers.

``triton_kernels`` holds every ``@triton.jit`` function of the writes (one module:
the interpreter loads a kernel module as one copy, and the kernels share their
element helpers). The launchers never import Triton at import time:

* ``scatter``: split K/V, DiffKV, MLA latent (bf16 and per-tensor fp8), legacy paged
  and AITER shuffled writes;
* ``row_scaled``: per-(token, head) int8/fp8 and the 656-byte ``fp8_ds_mla`` entry;
* ``rope``: RoPE fused with any of the ``scatter`` writes;
* ``device``: which hardware paths the compiled kernels take on a device;
* ``launch``: the kernel module, :class:`ScatterTarget` and :class:`Launch`;
* ``cached``: replaying a validated signature's launch without Triton's binding.

The writers one folder up validate every argument before calling in here.
Layouts: ``docs/layouts.md``; which vendor runs which path: ``docs/kernels.md``.
"""

from __future__ import annotations

from vllm.attention.writers.kernels.cached import (
    LIVE_ROLES,
    BoundLaunch,
    CachedLaunch,
    hooks_quiet,
)
from vllm.attention.writers.kernels.device import (
    GPU,
    TRITON_DEFAULT_WARPS,
    direct_launch,
    fast_division,
    gpu_of,
    hardware_fp8,
    hardware_fp8_nan,
    input_tiles,
    nvidia_gpu,
    packed_widen,
    pairs_fit,
)
from vllm.attention.writers.kernels.launch import (
    Launch,
    ScatterTarget,
    load_kernels,
    triton_importable,
)
from vllm.attention.writers.kernels.rope import (
    ROPE_OPTIONS,
    ROPE_TILED_FROM,
    rope_geometry,
    rope_kv_launch,
    rope_launch,
)
from vllm.attention.writers.kernels.row_scaled import (
    fp8_ds_mla,
    fp8_ds_mla_launch,
    per_token_head,
    per_token_head_launch,
)
from vllm.attention.writers.kernels.scatter import (
    TILED_MIN_TOKENS,
    ScatterKernel,
    scatter_kernel_for,
    scatter_kv,
    scatter_kv_launch,
    tokens_per_program,
)

__all__ = [
    "GPU",
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
    "direct_launch",
    "fast_division",
    "fp8_ds_mla",
    "fp8_ds_mla_launch",
    "gpu_of",
    "hardware_fp8",
    "hardware_fp8_nan",
    "hooks_quiet",
    "input_tiles",
    "load_kernels",
    "nvidia_gpu",
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
