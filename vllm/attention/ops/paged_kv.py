"""Address math of every split/paged K/V cache layout, for the compute paths.

A :class:`PagedKV` describes where element ``(block, offset, head, dim)`` of K and
of V lives, as six strides and two split factors per operand::

    addr = block * s_block + head * s_head
         + (offset // token_split) * s_tok_hi + (offset % token_split) * s_tok_lo
         + (dim // dim_split) * s_dim_hi + (dim % dim_split) * s_dim_lo

The plain layouts (NHD, HND, K/V-first, block-interleaved, DiffKV, per-token-head)
have ``token_split = block_size`` and ``dim_split = head_size``; the legacy paged
K (``[nb, H, D/x, bs, x]``) has ``dim_split = x``; the AITER shuffled V
(``[nb, H, bs/x, D, x]``) has ``token_split = x``. The Triton kernels take these
strides as arguments and the split factors as constants, so one kernel body
serves every layout. Layout diagrams: ``docs/layouts.md``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from vllm.attention.errors import InvalidArgumentError
from vllm.attention.layouts import (
    PER_TOKEN_HEAD_SCALE_BYTES,
    aiter_shuffled_views,
    diffkv_views,
    kv_cache_shape,
    legacy_paged_views,
    paged_x,
    split_kv_views,
)
from vllm.attention.types import KVCacheDType, KVCacheLayout, KVQuant, is_fp8_scaled

PAGED_LAYOUTS: tuple[KVCacheLayout, ...] = (
    KVCacheLayout.SPLIT_NHD,
    KVCacheLayout.SPLIT_HND,
    KVCacheLayout.SPLIT_KV_FIRST,
    KVCacheLayout.SPLIT_BLOCK_INTERLEAVED,
    KVCacheLayout.DIFFKV_PACKED,
    KVCacheLayout.LEGACY_PAGED,
    KVCacheLayout.AITER_SHUFFLED,
    KVCacheLayout.PER_TOKEN_HEAD_QUANT,
)
"""The non-MLA layouts the portable compute paths read."""

_PER_TOKEN_HEAD_STORAGE: dict[str, torch.dtype] = {
    "int8_per_token_head": torch.int8,
    "fp8_per_token_head": torch.float8_e4m3fn,
}


class Dequant(enum.IntEnum):
    """How stored elements become values; the Triton kernels take it as a constant."""

    NONE = 0
    """Stored in the model dtype (``auto``)."""
    SCALED = 1
    """fp8 with a float32 scale per tensor (``[1]``) or per kv head (``[H]``)."""
    PER_TOKEN_HEAD = 2
    """int8/fp8 with a float32 scale per (token, head) stored next to the row."""


@dataclass(frozen=True)
class PagedOperand:
    """K or V of a paged cache: element ``(block, offset, head, dim)`` as strides.

    ``data``: a tensor whose ``data_ptr()`` is element ``(0, 0, 0, 0)`` and whose
    dtype is the stored element type (model dtype, fp8, or int8). ``strides`` are
    in elements: ``(s_block, s_head, s_tok_hi, s_tok_lo, s_dim_hi, s_dim_lo)``.
    ``scales``: per-token-head only, a float32 ``[nb, bs, H]`` view of the scales.
    """

    data: torch.Tensor
    strides: tuple[int, int, int, int, int, int]
    token_split: int
    dim_split: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_size: int
    scales: torch.Tensor | None = None

    def block_view(self) -> torch.Tensor:
        """A view ``[nb, bs/ts, ts, H, D/ds, ds]`` (``ts``/``ds`` the splits) of ``data``;
        indexing its first axis and reshaping gives logical rows ``[n*bs, H, D]``."""
        sb, sh, sth, stl, sdh, sdl = self.strides
        ts, ds = self.token_split, self.dim_split
        strided = self.data.as_strided(
            (self.num_blocks, self.num_heads, self.block_size // ts, ts, self.head_size // ds, ds),
            (sb, sh, sth, stl, sdh, sdl),
            self.data.storage_offset(),
        )
        return strided.permute(0, 2, 3, 1, 4, 5)

    def gather(self, block_ids: torch.Tensor, length: int) -> torch.Tensor:
        """Stored rows ``[length, H, D]`` (storage dtype) of one request's positions
        ``0..length-1``; ``block_ids``: the request's block-table row (int32)."""
        nblk = -(-length // self.block_size)
        ids = block_ids[:nblk].long()
        rows = self.block_view()[ids].reshape(nblk * self.block_size, self.num_heads,
                                              self.head_size)
        return rows[:length]

    def gather_scales(self, block_ids: torch.Tensor, length: int) -> torch.Tensor:
        """Per-token-head scales ``[length, H]`` float32 (only when ``scales`` is set)."""
        if self.scales is None:
            raise InvalidArgumentError("PagedOperand.scales", None, "a per-token-head cache")
        nblk = -(-length // self.block_size)
        ids = block_ids[:nblk].long()
        return self.scales[ids].reshape(nblk * self.block_size, self.num_heads)[:length]


@dataclass(frozen=True)
class PagedKV:
    """K and V of one layer's paged cache, with how to dequantise them.

    Build with :meth:`from_cache`; the compute paths (torch, Triton, flex) all take it.
    The torch paths read rows through ``vllm.attention.writers.readback``; the
    operands' strides are what the Triton kernels address (``PagedOperand.gather`` is
    the same address math in torch, for tests).
    ``k_scale``/``v_scale``: float32 ``[1]`` or ``[H]``, used when ``dequant`` is SCALED.
    """

    layout: KVCacheLayout
    cache: torch.Tensor
    """The logical cache tensor the operands view."""
    key: PagedOperand
    value: PagedOperand
    quant: KVQuant
    cache_dtype: KVCacheDType
    dequant: Dequant
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.key.block_size

    @property
    def num_kv_heads(self) -> int:
        return self.key.num_heads

    @property
    def num_blocks(self) -> int:
        return self.key.num_blocks

    @property
    def head_size(self) -> int:
        return self.key.head_size

    @property
    def head_size_v(self) -> int:
        return self.value.head_size

    @property
    def device(self) -> torch.device:
        return self.key.data.device

    @classmethod
    def from_cache(
        cls,
        kv_cache: torch.Tensor,
        layout: KVCacheLayout,
        quant: KVQuant,
        *,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        head_size_v: int | None = None,
    ) -> PagedKV:
        """Describe ``kv_cache`` (the backend's logical cache tensor) in ``layout``.

        Args:
            kv_cache: the cache in the logical shape of ``layout`` (any physical strides
                for the split layouts; the legacy and AITER layouts need a contiguous
                row per block, as their writers produce).
            quant: the cache format and its ``k_scale``/``v_scale``.
            head_size: K's head size (DiffKV: ``Dk``); ``head_size_v``: V's, if different.
        """
        dv = head_size if head_size_v is None else head_size_v
        if dv != head_size and layout is not KVCacheLayout.DIFFKV_PACKED:
            raise InvalidArgumentError(
                "head_size_v", head_size_v, f"None or {head_size} for layout {layout.value}"
            )
        dtype = quant.kv_cache_dtype
        _check_cache_dtype(layout, dtype, kv_cache)
        nb = _num_blocks(layout, kv_cache)
        d_total = head_size + dv if layout is KVCacheLayout.DIFFKV_PACKED else head_size
        expected = kv_cache_shape(layout, nb, block_size, num_kv_heads, d_total)
        if tuple(kv_cache.shape) != expected:
            raise InvalidArgumentError(
                "kv_cache.shape", tuple(kv_cache.shape),
                f"{expected} for layout {layout.value} with block_size={block_size}, "
                f"num_kv_heads={num_kv_heads}, head_size={d_total}",
            )
        if layout is KVCacheLayout.PER_TOKEN_HEAD_QUANT:
            key, value = _per_token_head(kv_cache, dtype, nb, block_size, num_kv_heads, head_size)
            deq = Dequant.PER_TOKEN_HEAD
        else:
            key, value = _operands(layout, kv_cache, nb, block_size, num_kv_heads, head_size, dv)
            deq = Dequant.SCALED if is_fp8_scaled(dtype) else Dequant.NONE
        if deq is Dequant.SCALED:
            for name, sc in (("quant.k_scale", quant.k_scale), ("quant.v_scale", quant.v_scale)):
                if sc.numel() not in (1, num_kv_heads):
                    raise InvalidArgumentError(
                        f"{name}.shape", tuple(sc.shape), f"[1] or [num_kv_heads={num_kv_heads}]"
                    )
        return cls(
            layout=layout, cache=kv_cache, key=key, value=value, quant=quant,
            cache_dtype=dtype, dequant=deq,
            k_scale=quant.k_scale.to(kv_cache.device), v_scale=quant.v_scale.to(kv_cache.device),
        )


def _check_cache_dtype(layout: KVCacheLayout, dtype: KVCacheDType, kv_cache: torch.Tensor) -> None:
    if layout not in PAGED_LAYOUTS:
        raise InvalidArgumentError(
            "layout", layout.value, f"one of {', '.join(x.value for x in PAGED_LAYOUTS)}"
        )
    per_token = layout is KVCacheLayout.PER_TOKEN_HEAD_QUANT
    if per_token != (dtype in _PER_TOKEN_HEAD_STORAGE):
        allowed = (", ".join(_PER_TOKEN_HEAD_STORAGE) if per_token
                   else "auto, fp8, fp8_e4m3 or fp8_e5m2")
        raise InvalidArgumentError("quant.kv_cache_dtype", dtype,
                                   f"{allowed} for layout {layout.value}")
    if per_token and kv_cache.dtype != torch.uint8:
        raise InvalidArgumentError("kv_cache.dtype", kv_cache.dtype, f"torch.uint8 for {dtype}")
    if dtype in ("fp8", "fp8_e4m3") and kv_cache.dtype != torch.float8_e4m3fn:
        raise InvalidArgumentError("kv_cache.dtype", kv_cache.dtype,
                                   f"torch.float8_e4m3fn for {dtype}")
    if dtype == "fp8_e5m2" and kv_cache.dtype != torch.float8_e5m2:
        raise InvalidArgumentError("kv_cache.dtype", kv_cache.dtype, "torch.float8_e5m2")
    if dtype == "auto" and kv_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise InvalidArgumentError("kv_cache.dtype", kv_cache.dtype,
                                   "float32, float16 or bfloat16 for kv_cache_dtype='auto'")


def _num_blocks(layout: KVCacheLayout, kv_cache: torch.Tensor) -> int:
    first_is_two = layout in (
        KVCacheLayout.SPLIT_KV_FIRST, KVCacheLayout.AITER_SHUFFLED, KVCacheLayout.LEGACY_PAGED
    )
    if kv_cache.dim() < 2:
        raise InvalidArgumentError("kv_cache.shape", tuple(kv_cache.shape),
                                   f"the logical shape of layout {layout.value}")
    return int(kv_cache.shape[1] if first_is_two else kv_cache.shape[0])


def _plain(view: torch.Tensor, nb: int, bs: int, h: int, d: int) -> PagedOperand:
    """A ``[nb, bs, H, D]`` strided view as an operand."""
    sb, st, sh, sd = view.stride()
    return PagedOperand(view, (sb, sh, 0, st, 0, sd), bs, d, nb, bs, h, d)


def _operands(layout: KVCacheLayout, kv_cache: torch.Tensor, nb: int, bs: int, h: int,
              dk: int, dv: int) -> tuple[PagedOperand, PagedOperand]:
    if layout is KVCacheLayout.DIFFKV_PACKED:
        k_view, v_view = diffkv_views(kv_cache, dk)
        return _plain(k_view, nb, bs, h, dk), _plain(v_view, nb, bs, h, dv)
    if layout in (KVCacheLayout.LEGACY_PAGED, KVCacheLayout.AITER_SHUFFLED):
        x = paged_x(kv_cache.dtype)
        if layout is KVCacheLayout.LEGACY_PAGED:
            k5, v4 = legacy_paged_views(kv_cache, h, dk)
            t0, t1, t2, t3 = v4.stride()
            value = PagedOperand(v4, (t0, t1, 0, t3, 0, t2), bs, dv, nb, bs, h, dv)
        else:
            k5, v5 = aiter_shuffled_views(kv_cache)
            t0, t1, t2, t3, t4 = v5.stride()
            value = PagedOperand(v5, (t0, t1, t2, t4, 0, t3), x, dv, nb, bs, h, dv)
        s0, s1, s2, s3, s4 = k5.stride()
        key = PagedOperand(k5, (s0, s1, 0, s3, s2, s4), bs, x, nb, bs, h, dk)
        return key, value
    k_view, v_view = split_kv_views(kv_cache, layout)
    return _plain(k_view, nb, bs, h, dk), _plain(v_view, nb, bs, h, dv)


def _per_token_head(kv_cache: torch.Tensor, dtype: KVCacheDType, nb: int, bs: int, h: int,
                    d: int) -> tuple[PagedOperand, PagedOperand]:
    if d % PER_TOKEN_HEAD_SCALE_BYTES:
        raise InvalidArgumentError("head_size", d, "a multiple of 4 for per-token-head caches")
    values = kv_cache.view(_PER_TOKEN_HEAD_STORAGE[dtype])
    try:
        scales = kv_cache.view(torch.float32)[..., d // PER_TOKEN_HEAD_SCALE_BYTES]
    except RuntimeError as exc:
        raise InvalidArgumentError(
            "kv_cache.stride", tuple(kv_cache.stride()),
            "a contiguous last axis (the float32 scale is read in place)",
        ) from exc
    ops: list[PagedOperand] = []
    for i in (0, 1):
        op = _plain(values[:, i, :, :, :d], nb, bs, h, d)
        ops.append(PagedOperand(op.data, op.strides, bs, d, nb, bs, h, d, scales[:, i]))
    return ops[0], ops[1]
