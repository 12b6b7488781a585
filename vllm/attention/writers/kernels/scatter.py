"""Launches of the scatter kernels: the split K/V layouts, DiffKV, the MLA latent
(bf16 and per-tensor fp8), the legacy paged and AITER shuffled x-split layouts.

Token-major targets run ``scatter_kv_tiled_kernel``, x-split ones the generic
``scatter_kv_kernel`` (:func:`scatter_kernel_for`).
"""

from __future__ import annotations

import os
from typing import Final, Literal

import torch

from vllm.attention.writers.kernels.device import (
    TRITON_DEFAULT_WARPS,
    fp8_consts,
    next_pow2,
    packed_widen,
)
from vllm.attention.writers.kernels.launch import (
    _IN_KIND,
    _MAX_TILE,
    Launch,
    ScatterTarget,
    _bits,
    _bs_shift,
    _one_scale,
    _rows,
)


def scatter_kv_launch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_target: ScatterTarget,
    v_target: ScatterTarget,
    slot_mapping: torch.Tensor,
    mode: int,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    same_scale: bool = False,
) -> Launch:
    """:func:`scatter_kv`'s launch. ``same_scale``: the caller always passes one ``[1]``
    scale as both ``k_scale`` and ``v_scale`` (the MLA writers): it is loaded once."""
    scale_roles = ("k_scale", "v_scale")
    if mode == 0:  # unscaled: the scale pointers are never read; keep them on the device
        k_scale = v_scale = slot_mapping
        scale_roles = ("slots", "slots")
    n = slot_mapping.shape[0]
    h = k_target.num_heads
    dk, dv = k_target.head_size, v_target.head_size
    block_dk, block_dv = next_pow2(dk), next_pow2(dv)
    block_h = min(next_pow2(h), max(1, _MAX_TILE // max(block_dk, block_dv)))
    if scatter_kernel_for(k_target, v_target) == "tiled":
        block_t = tokens_per_program(n, block_h * max(block_dk, block_dv))
        consts: dict[str, int | bool] = {
            "IN_KIND": _IN_KIND[key.dtype], "MODE": mode,
            **fp8_consts(mode, k_target.tensor.device),
            "BLOCK_T": block_t, "BLOCK_H": block_h, "BLOCK_DK": block_dk,
            "BLOCK_DV": block_dv, "SCALAR_S": _one_scale(mode, k_scale, v_scale),
            "SLOT_LINEAR": k_target.slot_linear and v_target.slot_linear,
            "SAME_SCALE": same_scale and _one_scale(mode, k_scale, v_scale),
            "BS_SHIFT": _bs_shift(k_target.block_size), "CACHE_HINTS": 0}
        consts["PACKED_WIDEN"] = packed_widen("scatter_kv_tiled_kernel", consts,
                                              TRITON_DEFAULT_WARPS)
        return Launch(
            "scatter_kv_tiled_kernel", (-(-n // block_t), -(-h // block_h)),
            (slot_mapping, slot_mapping.stride(0), n,
             *_rows(key), *_rows(value),
             _bits(k_target.tensor), k_target.stride_block, k_target.stride_off_hi,
             k_target.stride_head, k_target.stride_dim_hi,
             _bits(v_target.tensor), v_target.stride_block, v_target.stride_off_hi,
             v_target.stride_head, v_target.stride_dim_hi,
             k_scale, 0 if k_scale.numel() == 1 else k_scale.stride(0),
             v_scale, 0 if v_scale.numel() == 1 else v_scale.stride(0),
             h, k_target.block_size, k_target.num_slots, dk, dv),
            consts, roles=("slots", "key", "value", "cache", "cache", *scale_roles),
        )
    return Launch(
        "scatter_kv_kernel", (n, -(-h // block_h)),
        (slot_mapping, slot_mapping.stride(0),
         *_rows(key), *_rows(value),
         *k_target.args(), *v_target.args(),
         k_scale, 0 if k_scale.numel() == 1 else k_scale.stride(0),
         v_scale, 0 if v_scale.numel() == 1 else v_scale.stride(0),
         h, k_target.block_size, k_target.num_slots, dk, dv),
        {"IN_KIND": _IN_KIND[key.dtype], "MODE": mode,
         "K_XO": k_target.off_split, "K_XD": k_target.dim_split,
         "V_XO": v_target.off_split, "V_XD": v_target.dim_split,
         "BLOCK_H": block_h, "BLOCK_DK": block_dk, "BLOCK_DV": block_dv},
        roles=("slots", "key", "value", "cache", "cache", *scale_roles),
    )


ScatterKernel = Literal["generic", "tiled"]
"""``generic``: ``scatter_kv_kernel``, one program per token, any :class:`ScatterTarget`;
``tiled``: ``scatter_kv_tiled_kernel``, token-major targets only (``docs/performance.md``)."""

TILED_MIN_TOKENS: Final = 1024
"""From this many tokens the tiled kernel takes several tokens per program."""


def scatter_kernel_for(k_target: ScatterTarget, v_target: ScatterTarget) -> ScatterKernel:
    """The tiled kernel for token-major targets (split layouts, DiffKV, MLA latent), the
    generic one for x-split layouts; ``VLLM_KV_SCATTER_KERNEL=generic`` forces the generic
    one everywhere (for A/B measurements)."""
    if os.environ.get("VLLM_KV_SCATTER_KERNEL", "") == "generic":
        return "generic"
    for t in (k_target, v_target):
        if t.off_split != 1 or t.dim_split != 1:
            return "generic"
    return "tiled"


def tokens_per_program(num_tokens: int, tile: int) -> int:
    """``BLOCK_T`` of the tiled kernel: 1 below :data:`TILED_MIN_TOKENS` (small batches
    want every program they can get), else enough tokens for about 16 elements per thread
    of a 4-warp program per operand, at most 16. fp8 writes too: with the leaner
    quantiser the repeated H200 sweep put split fp8 at 0.98 x the copy ceiling at 2 tokens
    a program against 0.87-0.96 x at 4, MLA fp8 within 0.01 x of its best
    (``benchmarks/results/h200/2026-11-30-d2486ac/tune_split.json``, ``tune_mla.json``)."""
    if num_tokens < TILED_MIN_TOKENS:
        return 1
    return max(1, min(16, 16 * 128 // max(1, tile)))


def scatter_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_target: ScatterTarget,
    v_target: ScatterTarget,
    slot_mapping: torch.Tensor,
    mode: int,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[>= T, H, D]`` rows of the ``T = slot_mapping.shape[0]``
    tokens through the targets. ``mode``: 0 copy (``auto``), 1 E4M3, 2 E5M2;
    scales float32 ``[1]`` or ``[H]`` (ignored for mode 0)."""
    scatter_kv_launch(key, value, k_target, v_target, slot_mapping, mode,
                      k_scale, v_scale).run()
