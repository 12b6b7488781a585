"""Launches of the writes that compute a scale per row: per-(token, head) int8/fp8
(``per_token_head_kernel``) and the 656-byte ``fp8_ds_mla`` entry with a scale per
128-value tile (``fp8_ds_mla_kernel``)."""

from __future__ import annotations

import torch

from vllm.attention.writers.kernels.device import next_pow2
from vllm.attention.writers.kernels.launch import (
    _IN_KIND,
    _MAX_TILE,
    Launch,
    _bits,
    _rows,
)


def per_token_head_launch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_view: torch.Tensor,
    v_view: torch.Tensor,
    slot_mapping: torch.Tensor,
    int8: bool,
) -> Launch:
    """:func:`per_token_head`'s launch."""
    _, bs, h, d4 = k_view.shape
    d = d4 - 4
    block_d = next_pow2(d)
    block_h = min(next_pow2(h), max(1, _MAX_TILE // block_d))
    return Launch(
        "per_token_head_kernel", (slot_mapping.shape[0], -(-h // block_h)),
        (slot_mapping, slot_mapping.stride(0),
         *_rows(key), *_rows(value),
         k_view, *k_view.stride(), v_view, *v_view.stride(),
         h, bs, k_view.shape[0] * bs, d),
        {"IN_KIND": _IN_KIND[key.dtype], "INT8": int8, "BLOCK_H": block_h, "BLOCK_D": block_d},
    )


def per_token_head(
    key: torch.Tensor,
    value: torch.Tensor,
    k_view: torch.Tensor,
    v_view: torch.Tensor,
    slot_mapping: torch.Tensor,
    int8: bool,
) -> None:
    """Quantise rows per (token, head) into uint8 ``[nb, bs, H, D + 4]`` views."""
    per_token_head_launch(key, value, k_view, v_view, slot_mapping, int8).run()


def fp8_ds_mla_launch(
    kv_c_normed: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> Launch:
    """:func:`fp8_ds_mla`'s launch."""
    return Launch(
        "fp8_ds_mla_kernel", (slot_mapping.shape[0],),
        (slot_mapping, slot_mapping.stride(0),
         _bits(kv_c_normed), *kv_c_normed.stride(),
         _bits(k_pe), *k_pe.stride(),
         kv_cache, *kv_cache.stride(),
         kv_cache.shape[1], kv_cache.shape[0] * kv_cache.shape[1]),
        {"IN_KIND": _IN_KIND[kv_c_normed.dtype]},
    )


def fp8_ds_mla(
    kv_c_normed: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write 656-byte entries: ``kv_c_normed`` ``[>= T, 512]``, ``k_pe`` ``[>= T, 64]``,
    ``kv_cache`` uint8 ``(nb, bs, 656)``."""
    fp8_ds_mla_launch(kv_c_normed, k_pe, kv_cache, slot_mapping).run()
