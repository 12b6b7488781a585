"""Read stored rows back out of any layout's cache, and the torch reference write.

``read_slots(layout, kv_cache, slots)`` returns the rows of the given slots in
storage form (what the writer put there, in the cache's element type);
``dequantize(rows, quant)`` (or ``read_slots(..., dequantize=True)``) turns them into
float32 values for compute and for comparisons. ``reference_write`` runs the torch
reference writer of any layout. Layouts: ``docs/layouts.md``.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, overload

import torch

from vllm.attention.errors import InvalidArgumentError, InvalidTypeError
from vllm.attention.layouts import (
    FP8_DS_MLA_ENTRY_BYTES,
    FP8_DS_MLA_LATENT,
    FP8_DS_MLA_TILE,
    PER_TOKEN_HEAD_SCALE_BYTES,
    aiter_shuffled_views,
    diffkv_views,
    legacy_paged_views,
    mla_latent_views,
    split_kv_views,
)
from vllm.attention.types import KVCacheLayout, KVQuant
from vllm.attention.writers import reference_write
from vllm.attention.writers.fp8_ds_mla import ds_mla_rope_dtype
from vllm.attention.writers.per_token_head import PER_TOKEN_HEAD_VALUE_DTYPE
from vllm.attention.writers.quant import FP8_DTYPES, as_bits

__all__ = [
    "FP8DsMLARows",
    "KVRows",
    "MLARows",
    "PerTokenHeadRows",
    "StoredRows",
    "dequantize",
    "read_slots",
    "reference_write",
]

_FP8_STORAGE = tuple(set(FP8_DTYPES.values()))


class KVRows(NamedTuple):
    """Split / legacy / AITER / DiffKV rows: ``key`` ``[n, H, D]``, ``value`` ``[n, H, Dv]``,
    in the cache dtype (model dtype or fp8)."""

    key: torch.Tensor
    value: torch.Tensor


class PerTokenHeadRows(NamedTuple):
    """Per-token-head rows: values ``[n, H, D]`` (int8 or float8_e4m3fn) and their
    float32 scales ``[n, H]``."""

    key: torch.Tensor
    value: torch.Tensor
    key_scale: torch.Tensor
    value_scale: torch.Tensor


class MLARows(NamedTuple):
    """MLA latent rows: ``latent`` ``[n, L]`` and ``rope`` ``[n, R]`` in the cache dtype."""

    latent: torch.Tensor
    rope: torch.Tensor


class FP8DsMLARows(NamedTuple):
    """fp8_ds_mla entries: ``latent`` float8_e4m3fn ``[n, 512]``, ``scales`` float32
    ``[n, 4]`` (one per 128-value tile), ``rope`` ``[n, 64]`` (bf16 or fp16)."""

    latent: torch.Tensor
    scales: torch.Tensor
    rope: torch.Tensor


StoredRows = KVRows | PerTokenHeadRows | MLARows | FP8DsMLARows


def _slots(slots: object, kv_cache: torch.Tensor, num_slots: int, checked: bool) -> torch.Tensor:
    if not isinstance(slots, torch.Tensor):
        raise InvalidTypeError("slots", type(slots).__name__, "an int64 torch.Tensor")
    if slots.dtype != torch.int64 or slots.dim() != 1:
        raise InvalidArgumentError("slots", f"{slots.dtype} {tuple(slots.shape)}",
                                   "an int64 tensor [n]")
    s = slots.to(kv_cache.device)
    if checked and s.numel() and not bool(((s >= 0) & (s < num_slots)).all()):
        bad = s[(s < 0) | (s >= num_slots)][:5].tolist()
        raise InvalidArgumentError("slots", f"out-of-range slots {bad}",
                                   f"slots in [0, {num_slots}) (num_blocks * block_size)")
    return s


def _need(name: str, value: int | None, layout: KVCacheLayout) -> int:
    if value is None:
        raise InvalidArgumentError(name, None, f"an int: layout {layout.value} needs it to read")
    return value


def _rows_of(view: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Rows ``view[slot // bs, slot % bs]`` of a ``[nb, bs, ...]`` view."""
    bs = view.shape[1]
    return as_bits(view)[s // bs, s % bs].view(view.dtype)


@overload
def read_slots(layout: KVCacheLayout, kv_cache: torch.Tensor, slots: torch.Tensor, *,
               quant: KVQuant | None = ..., num_kv_heads: int | None = ...,
               head_size: int | None = ..., head_size_v: int | None = ...,
               kv_lora_rank: int = ..., model_dtype: torch.dtype | None = ...,
               dequantize: Literal[False] = ..., checked: bool = ...) -> StoredRows: ...


@overload
def read_slots(layout: KVCacheLayout, kv_cache: torch.Tensor, slots: torch.Tensor, *,
               quant: KVQuant | None = ..., num_kv_heads: int | None = ...,
               head_size: int | None = ..., head_size_v: int | None = ...,
               kv_lora_rank: int = ..., model_dtype: torch.dtype | None = ...,
               dequantize: Literal[True], checked: bool = ...
               ) -> tuple[torch.Tensor, torch.Tensor]: ...


def read_slots(
    layout: KVCacheLayout,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    quant: KVQuant | None = None,
    num_kv_heads: int | None = None,
    head_size: int | None = None,
    head_size_v: int | None = None,
    kv_lora_rank: int = 512,
    model_dtype: torch.dtype | None = None,
    dequantize: bool = False,
    checked: bool = True,
) -> StoredRows | tuple[torch.Tensor, torch.Tensor]:
    """The stored rows of ``slots`` (int64 ``[n]``, non-negative) in ``kv_cache``.

    Args:
        layout: how ``kv_cache`` (the backend's logical cache tensor) is laid out.
        quant: needed to dequantise fp8 (its scales) and to read per-token-head
            caches (``kv_cache_dtype`` says int8 or fp8).
        num_kv_heads, head_size: needed by ``legacy_paged``, whose shape lacks them.
        head_size, head_size_v: DiffKV's ``Dk`` / ``Dv`` (one is enough; neither
            means ``Dk = Dv``).
        kv_lora_rank: MLA latent width (the rest of the row is rope).
        model_dtype: fp8_ds_mla's input dtype, which fixes the rope's 16-bit dtype
            (fp16 for fp16, bf16 otherwise); default bf16.
        dequantize: return float32 ``(K, V)`` (MLA: ``(latent, rope)``) instead.
        checked: check every slot is in ``[0, num_blocks * block_size)`` (a sync).
    Returns:
        :data:`StoredRows` (a named tuple per family), or two float32 tensors.
    """
    if not isinstance(kv_cache, torch.Tensor):
        raise InvalidTypeError("kv_cache", type(kv_cache).__name__, "a torch.Tensor")
    rows = _read(layout, kv_cache, slots, quant=quant, num_kv_heads=num_kv_heads,
                 head_size=head_size, head_size_v=head_size_v, kv_lora_rank=kv_lora_rank,
                 model_dtype=model_dtype, checked=checked)
    return _dequantize(rows, quant) if dequantize else rows


def _read(layout: KVCacheLayout, kv_cache: torch.Tensor, slots: torch.Tensor, *,
          quant: KVQuant | None, num_kv_heads: int | None, head_size: int | None,
          head_size_v: int | None, kv_lora_rank: int, model_dtype: torch.dtype | None,
          checked: bool) -> StoredRows:
    if layout in (KVCacheLayout.SPLIT_NHD, KVCacheLayout.SPLIT_HND,
                  KVCacheLayout.SPLIT_KV_FIRST, KVCacheLayout.SPLIT_BLOCK_INTERLEAVED):
        k_view, v_view = split_kv_views(kv_cache, layout)
        s = _slots(slots, kv_cache, k_view.shape[0] * k_view.shape[1], checked)
        return KVRows(_rows_of(k_view, s), _rows_of(v_view, s))
    if layout is KVCacheLayout.DIFFKV_PACKED:
        if kv_cache.dim() != 4:
            raise InvalidArgumentError("kv_cache.shape", tuple(kv_cache.shape),
                                       "(num_blocks, block_size, num_kv_heads, Dk + Dv)")
        total = kv_cache.shape[3]
        dk = head_size if head_size is not None else (
            total - head_size_v if head_size_v is not None else total // 2)
        k_view, v_view = diffkv_views(kv_cache, dk)
        s = _slots(slots, kv_cache, k_view.shape[0] * k_view.shape[1], checked)
        return KVRows(_rows_of(k_view, s), _rows_of(v_view, s))
    if layout is KVCacheLayout.LEGACY_PAGED:
        h = _need("num_kv_heads", num_kv_heads, layout)
        d = _need("head_size", head_size, layout)
        k5, v4 = legacy_paged_views(kv_cache, h, d)
        s = _slots(slots, kv_cache, k5.shape[0] * k5.shape[3], checked)
        k = _rows_of(k5.permute(0, 3, 1, 2, 4), s)  # [n, H, D/x, x]
        return KVRows(k.reshape(k.shape[0], h, d), _rows_of(v4.permute(0, 3, 1, 2), s))
    if layout is KVCacheLayout.AITER_SHUFFLED:
        k5, v5 = aiter_shuffled_views(kv_cache)
        _, nb, bs, h, d = kv_cache.shape
        x = k5.shape[4]
        s = _slots(slots, kv_cache, nb * bs, checked)
        k = _rows_of(k5.permute(0, 3, 1, 2, 4), s).reshape(s.shape[0], h, d)
        blocks, offsets = s // bs, s % bs
        v = as_bits(v5).permute(0, 2, 4, 1, 3)[blocks, offsets // x, offsets % x].view(v5.dtype)
        return KVRows(k, v)
    if layout is KVCacheLayout.PER_TOKEN_HEAD_QUANT:
        if quant is None or quant.kv_cache_dtype not in PER_TOKEN_HEAD_VALUE_DTYPE:
            raise InvalidArgumentError(
                "quant", None if quant is None else quant.kv_cache_dtype,
                f"a KVQuant with kv_cache_dtype in {', '.join(PER_TOKEN_HEAD_VALUE_DTYPE)}",
            )
        k_view, v_view = split_kv_views(kv_cache, layout)
        s = _slots(slots, kv_cache, k_view.shape[0] * k_view.shape[1], checked)
        d = k_view.shape[3] - PER_TOKEN_HEAD_SCALE_BYTES
        vdt = PER_TOKEN_HEAD_VALUE_DTYPE[quant.kv_cache_dtype]
        parts: list[torch.Tensor] = []
        for view in (k_view, v_view):
            row = _rows_of(view, s)
            parts.append(row[..., :d].contiguous().view(vdt))
            parts.append(row[..., d:].contiguous().view(torch.float32)[..., 0])
        return PerTokenHeadRows(parts[0], parts[2], parts[1], parts[3])
    if layout is KVCacheLayout.MLA_LATENT:
        latent, rope = mla_latent_views(kv_cache, kv_lora_rank)
        s = _slots(slots, kv_cache, kv_cache.shape[0] * kv_cache.shape[1], checked)
        return MLARows(_rows_of(latent, s), _rows_of(rope, s))
    if layout is KVCacheLayout.MLA_FP8_DS:
        if kv_cache.dim() != 3 or kv_cache.shape[2] != FP8_DS_MLA_ENTRY_BYTES:
            raise InvalidArgumentError("kv_cache.shape", tuple(kv_cache.shape),
                                       f"(num_blocks, block_size, {FP8_DS_MLA_ENTRY_BYTES})")
        s = _slots(slots, kv_cache, kv_cache.shape[0] * kv_cache.shape[1], checked)
        entry = _rows_of(kv_cache.view(torch.uint8), s)
        rope_dtype = ds_mla_rope_dtype(model_dtype or torch.bfloat16)
        return FP8DsMLARows(
            entry[:, :FP8_DS_MLA_LATENT].contiguous().view(torch.float8_e4m3fn),
            entry[:, FP8_DS_MLA_LATENT:FP8_DS_MLA_LATENT + 16].contiguous().view(torch.float32),
            entry[:, FP8_DS_MLA_LATENT + 16:].contiguous().view(rope_dtype),
        )
    raise InvalidArgumentError("layout", layout, "a KVCacheLayout")


def _scaled(x: torch.Tensor, scale: torch.Tensor | None, what: str) -> torch.Tensor:
    """``x`` as float32, times ``scale`` (``[1]`` or ``[H]`` over ``[n, H, D]``) if fp8."""
    if x.dtype not in _FP8_STORAGE:
        return x.to(torch.float32)
    if scale is None:
        raise InvalidArgumentError("quant", None, f"a KVQuant with the scales of the fp8 {what}")
    shape = (1, -1, 1) if x.dim() == 3 else (1, -1)
    return x.to(torch.float32) * scale.to(device=x.device).view(shape)


def dequantize(rows: StoredRows, quant: KVQuant | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 values of stored rows: ``(K, V)`` ``[n, H, D]``, MLA ``(latent, rope)``.

    ``quant`` gives the fp8 scales (MLA: ``k_scale`` for both parts); the
    per-token-head and fp8_ds_mla rows carry their own.
    """
    return _dequantize(rows, quant)


def _dequantize(rows: StoredRows, quant: KVQuant | None) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(rows, KVRows):
        return (_scaled(rows.key, None if quant is None else quant.k_scale, "K"),
                _scaled(rows.value, None if quant is None else quant.v_scale, "V"))
    if isinstance(rows, PerTokenHeadRows):
        return (rows.key.to(torch.float32) * rows.key_scale.unsqueeze(-1),
                rows.value.to(torch.float32) * rows.value_scale.unsqueeze(-1))
    if isinstance(rows, MLARows):
        scale = None if quant is None else quant.k_scale
        return _scaled(rows.latent, scale, "latent"), _scaled(rows.rope, scale, "rope")
    if isinstance(rows, FP8DsMLARows):
        n = rows.latent.shape[0]
        tiles = rows.latent.to(torch.float32).reshape(n, FP8_DS_MLA_LATENT // FP8_DS_MLA_TILE,
                                                      FP8_DS_MLA_TILE)
        latent = (tiles * rows.scales.unsqueeze(-1)).reshape(n, FP8_DS_MLA_LATENT)
        return latent, rows.rope.to(torch.float32)
    raise InvalidTypeError("rows", type(rows).__name__, "rows returned by read_slots")
