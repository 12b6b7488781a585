"""Launches of the fused RoPE kernel (``rope_kv_kernel``): rotate the query and key
rows, and with a write store the rotated keys and the values in the cache as the
scatter does (:mod:`~vllm.attention.writers.kernels.scatter`)."""

from __future__ import annotations

from typing import Final

import torch

from vllm.attention.writers.kernels.device import fp8_consts, next_pow2, packed_widen
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


ROPE_OPTIONS: Final[dict[str, int | bool]] = {"enable_fp_fusion": False}
"""No FMA contraction: products and sums round one by one, as the torch reference does."""

ROPE_TILED_FROM: Final = 1024
"""Rows from which the fused RoPE kernel launches :func:`rope_geometry`'s large-batch
geometry; smaller batches take one token a program at Triton's 4 warps (they want
every program they can get)."""


def rope_geometry(rows: int, mode: int, token_tile: int) -> tuple[int, int]:
    """``(BLOCK_T, num_warps)`` of the fused RoPE kernel for ``rows`` rows, cache MODE and
    ``token_tile`` elements a token (key head group x its widest operand). From
    :data:`ROPE_TILED_FROM` rows: two tokens at 4 warps (the 64 threads a token of a
    one-token 2-warp launch, half the programs), except fp8 writes of tiles under 1024
    values (the MLA latent's 512: the rotated rope part is one 64-wide head), which keep
    one token at 2 warps. H200, T=8192, against the plain write in the same process:
    split bf16 0.995 x (one token: 1.008 x), split fp8 at scale 0.37 1.044 x (one token:
    1.197 x; four at 8 warps: 1.049 x)
    (``benchmarks/results/h200/2026-11-30-b19cb4c/fast_div_ab/tune_rope.txt``); MLA bf16
    5.91 us (one token at 4 warps: 9.06 us), MLA fp8 6.56 / 6.72 us at scale 1.0 / 0.37
    at one token and 2 warps against 6.87 / 7.45 us at two and 4
    (``2026-11-30-bc07181/mla_rope.txt``)."""
    if rows < ROPE_TILED_FROM:
        return 1, 4
    if mode != 0 and token_tile < 1024:
        return 1, 2
    return 2, 4


def _rope_launch(
    query: torch.Tensor | None,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    neox: bool,
    write: tuple[torch.Tensor, ScatterTarget, ScatterTarget, torch.Tensor, int,
                 torch.Tensor, torch.Tensor] | None,
    same_scale: bool = False,
) -> Launch:
    """``write``: ``(value, k_target, v_target, slot_mapping, mode, k_scale, v_scale)``,
    or None to rotate ``key`` in place; ``same_scale`` as
    :func:`~vllm.attention.writers.kernels.scatter.scatter_kv_launch`'s."""
    n = positions.shape[0]
    hk, dk = key.shape[1], key.shape[2]
    half = cos_sin_cache.shape[1] // 2
    block_r = next_pow2(half)
    pass_k = 2 * half < dk
    block_pk = next_pow2(dk - 2 * half) if pass_k else 1
    if query is not None:
        hq = query.shape[1]
        block_hq = min(next_pow2(hq), max(1, _MAX_TILE // (2 * block_r)))
        q_groups = -(-hq // block_hq)
        q_args: tuple[torch.Tensor | int, ...] = (*_rows(query), hq, q_groups)
        q_role: tuple[str, ...] = ("query",)
    else:
        block_hq, q_groups = 1, 0
        q_args = (*_rows(key), 0, 0)  # never read
        q_role = ("key",)
    if write is None:
        width = 2 * block_r
        block_dv = 1
        rows = n
        mode = 0
        k_t: tuple[torch.Tensor | int, ...] = (_bits(key), 0, 0, 0, 0, 0, 0)  # never read
        w_args: tuple[torch.Tensor | int, ...] = (
            _bits(key), 0, 0, rows, *_rows(key)[:4], 0, *k_t, *k_t, _bits(key), 0, _bits(key), 0,
            1, 0)
        w_roles: tuple[str, ...] = ("key",) * 6
        xsplit = {"K_XO": 1, "K_XD": 1, "V_XO": 1, "V_XD": 1}
        scalar_s = False
        bs_shift = -1
    else:
        value, k_target, v_target, slot_mapping, mode, k_scale, v_scale = write
        scalar_s = _one_scale(mode, k_scale, v_scale)
        scale_roles = ("k_scale", "v_scale")
        if mode == 0:  # unscaled: the scale pointers are never read; keep them on the device
            k_scale = v_scale = slot_mapping
            scale_roles = ("slots", "slots")
        block_dv = next_pow2(v_target.head_size)
        width = max(2 * block_r, block_pk, block_dv)
        rows = n if query is not None else slot_mapping.shape[0]
        w_args = (slot_mapping, slot_mapping.stride(0), slot_mapping.shape[0], rows,
                  *_rows(value), v_target.head_size,
                  *k_target.args(), *v_target.args(),
                  k_scale, 0 if k_scale.numel() == 1 else k_scale.stride(0),
                  v_scale, 0 if v_scale.numel() == 1 else v_scale.stride(0),
                  k_target.block_size, k_target.num_slots)
        w_roles = ("slots", "value", "cache", "cache", *scale_roles)
        xsplit = {"K_XO": k_target.off_split, "K_XD": k_target.dim_split,
                  "V_XO": v_target.off_split, "V_XD": v_target.dim_split}
        bs_shift = _bs_shift(k_target.block_size)
    block_hk = min(next_pow2(hk), max(1, _MAX_TILE // width))
    kv_groups = -(-hk // block_hk)
    args: tuple[torch.Tensor | int, ...] = (
        positions, positions.stride(0),
        _bits(cos_sin_cache), cos_sin_cache.stride(0), cos_sin_cache.stride(1), half,
        *q_args,
        *_rows(key), hk, dk,
        *w_args)
    consts: dict[str, int | bool] = {
        "IN_KIND": _IN_KIND[key.dtype], "CS_KIND": _IN_KIND[cos_sin_cache.dtype],
        "MODE": mode, "NEOX": neox,
        "WRITE": write is not None, "PASS_K": pass_k, **xsplit,
        "BLOCK_HQ": block_hq, "BLOCK_HK": block_hk, "BLOCK_R": block_r,
        "BLOCK_PK": block_pk, "BLOCK_DV": block_dv, "CACHE_HINTS": 7,
        "SCALAR_S": scalar_s, "SAME_SCALE": same_scale and scalar_s,
        "BS_SHIFT": bs_shift, **fp8_consts(mode, key.device)}
    roles = ("positions", "cos_sin", *q_role, "key", *w_roles)
    block_t, warps = rope_geometry(rows, mode, block_hk * width)
    consts["BLOCK_T"] = block_t
    consts["PACKED_WIDEN"] = packed_widen("rope_kv_kernel", consts, warps)
    return Launch("rope_kv_kernel", (-(-rows // block_t), q_groups + kv_groups), args, consts,
                  options={**ROPE_OPTIONS, "num_warps": warps}, roles=roles)


def rope_launch(
    query: torch.Tensor | None,
    key: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    neox: bool,
) -> Launch:
    """Rotate rows ``[0, positions.shape[0])`` of ``query`` and ``key`` ``[>= N, H, D]``
    in place (``cos_sin_cache`` ``[max_position, rotary_dim]``)."""
    if key is None:
        if query is None:
            raise ValueError("rope_launch: query and key are both None")
        return _rope_launch(None, query, positions, cos_sin_cache, neox, None)
    return _rope_launch(query, key, positions, cos_sin_cache, neox, None)


def rope_kv_launch(
    query: torch.Tensor | None,
    key: torch.Tensor,
    value: torch.Tensor,
    k_target: ScatterTarget,
    v_target: ScatterTarget,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    neox: bool,
    mode: int,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    same_scale: bool = False,
) -> Launch:
    """Fused RoPE + write: rotate ``query`` rows ``[0, N)`` in place (``N =
    positions.shape[0]``; None: no query), and store the rotated ``key`` rows and the
    ``value`` rows of the ``T = slot_mapping.shape[0]`` tokens through the targets as
    :func:`~vllm.attention.writers.kernels.scatter.scatter_kv` does (``key`` itself is not
    modified). ``same_scale`` as
    :func:`~vllm.attention.writers.kernels.scatter.scatter_kv_launch`'s."""
    return _rope_launch(query, key, positions, cos_sin_cache, neox,
                        (value, k_target, v_target, slot_mapping, mode, k_scale, v_scale),
                        same_scale)
