"""Writers for the split K/V layouts: NHD, HND, K/V-first and block-interleaved.

All four are a K view and a V view ``[nb, bs, H, D]`` of one tensor with some
stride order (``vllm.attention.layouts.split_kv_views``); the writer addresses
through those views' strides, so a view of a larger hybrid buffer works too.
DiffKV and the MLA latent reuse :func:`write_kv_views` with their own views.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar, Final

import torch

from vllm.attention.errors import KVCacheWriteError
from vllm.attention.layouts import split_kv_views
from vllm.attention.rope import RoPE, check_query, check_rope_args, rotate_reference
from vllm.attention.types import KVCacheDType, KVCacheLayout, KVQuant
from vllm.attention.writers.dispatch import WritePath, WriterBase, resolve_path
from vllm.attention.writers.kernels import (
    CachedLaunch,
    Launch,
    ScatterTarget,
    rope_kv_launch,
    scatter_kv,
    scatter_kv_launch,
)
from vllm.attention.writers.launch_cache import (
    Runner,
    SignatureCache,
    rope_meta,
    write_meta,
)
from vllm.attention.writers.quant import as_bits, store_values
from vllm.attention.writers.validation import check_cache_tensor, check_kv_inputs, check_tensor

SPLIT_CACHE_DTYPES: Final[tuple[KVCacheDType, ...]] = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
SPLIT_LAYOUTS: Final[tuple[KVCacheLayout, ...]] = (
    KVCacheLayout.SPLIT_NHD,
    KVCacheLayout.SPLIT_HND,
    KVCacheLayout.SPLIT_KV_FIRST,
    KVCacheLayout.SPLIT_BLOCK_INTERLEAVED,
)
_SCATTER_MODE: Final[dict[str, int]] = {"auto": 0, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 2}


def scatter_mode(cache_dtype: KVCacheDType) -> int:
    """The scatter kernel's MODE constant: 0 copy, 1 E4M3, 2 E5M2."""
    return _SCATTER_MODE[cache_dtype]


def kept_slots(slot_mapping: torch.Tensor, num_blocks: int, block_size: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(keep, blocks, offsets)``: the mask of the slots a write stores (those in
    ``[0, num_blocks * block_size)``: negative ones are padding, larger ones are past the
    cache and skipped outside checked mode) and their block/offset."""
    keep = (slot_mapping >= 0) & (slot_mapping < num_blocks * block_size)
    slots = slot_mapping[keep]
    return keep, slots // block_size, slots % block_size


def reference_split_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_view: torch.Tensor,
    v_view: torch.Tensor,
    slot_mapping: torch.Tensor,
    quant: KVQuant,
) -> None:
    """The torch reference: ``k_view[slot // bs, slot % bs] = store(key[i])``.

    ``k_view``/``v_view``: ``[nb, bs, H, D]`` views (any strides) of the cache.
    """
    n = slot_mapping.shape[0]
    keep, blocks, offsets = kept_slots(slot_mapping, k_view.shape[0], k_view.shape[1])
    dt = quant.kv_cache_dtype
    k = store_values(key[:n][keep], dt, quant.k_scale, k_view.dtype)
    v = store_values(value[:n][keep], dt, quant.v_scale, v_view.dtype)
    as_bits(k_view)[blocks, offsets] = as_bits(k)
    as_bits(v_view)[blocks, offsets] = as_bits(v)


class SplitKVCacheWriter(WriterBase):
    """:class:`~vllm.attention.KVCacheWriter` for a split K/V layout; also a
    :class:`~vllm.attention.FusedRoPEKVCacheWriter`."""

    supports_fused_rope: ClassVar[bool] = True

    def __init__(self, layout: KVCacheLayout,
                 cache_dtypes: tuple[KVCacheDType, ...] = SPLIT_CACHE_DTYPES) -> None:
        if layout not in SPLIT_LAYOUTS:
            raise KVCacheWriteError("layout", layout.value,
                                    f"one of {', '.join(x.value for x in SPLIT_LAYOUTS)}")
        self.layout = layout
        self.cache_dtypes = cache_dtypes
        self._runners = SignatureCache()

    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor, quant: KVQuant, *,
              path: WritePath | None = None) -> None:
        """See :class:`~vllm.attention.KVCacheWriter`; ``kv_cache`` in the layout's
        logical shape (``(nb, 2, bs, H, D)`` or ``(2, nb, bs, H, D)``), any strides.
        A repeated call signature skips straight to the launch
        (:mod:`vllm.attention.writers.launch_cache`)."""
        meta = write_meta(key, value, slot_mapping)
        run = self._runners.recall(meta, kv_cache, quant, path)
        if run is None:
            def make() -> Runner:
                cache = self._checked(key, value, kv_cache, slot_mapping, quant)
                return split_runner(self.layout, quant.kv_cache_dtype,
                                    resolve_path(cache.device, path))

            run = self._runners.lookup(meta, kv_cache, quant, path, None, make)
        run((key, value, kv_cache, slot_mapping, quant.k_scale, quant.v_scale))

    def write_with_rope(self, query: torch.Tensor | None, key: torch.Tensor,
                        value: torch.Tensor, kv_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, quant: KVQuant, positions: torch.Tensor,
                        rope: RoPE, *, path: WritePath | None = None) -> None:
        """See :class:`~vllm.attention.FusedRoPEKVCacheWriter`: one kernel rotates
        ``query`` in place and stores the rotated keys and the values."""
        meta = rope_meta(write_meta(key, value, slot_mapping), query, positions)
        run = self._runners.recall(meta, kv_cache, quant, path, rope)
        if run is None:
            def make() -> Runner:
                cache = self._checked(key, value, kv_cache, slot_mapping, quant)
                check_rope_inputs(query, key, slot_mapping, positions, rope, cache.device)
                layout = self.layout
                return rope_runner(lambda c: split_kv_views(c, layout), quant.kv_cache_dtype,
                                   rope.style, query is not None,
                                   resolve_path(cache.device, path))

            run = self._runners.lookup(meta, kv_cache, quant, path, rope, make)
        run((key, value, kv_cache, slot_mapping, quant.k_scale, quant.v_scale,
             key if query is None else query, positions, rope.cos_sin_cache))

    def _checked(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, quant: KVQuant) -> torch.Tensor:
        """Every check of a write's arguments (a new signature); returns the cache."""
        cache = check_cache_tensor(kv_cache)
        k_view, v_view = split_kv_views(cache, self.layout)
        validate_kv_views(key, value, k_view, v_view, slot_mapping, quant, self.cache_dtypes)
        return cache

    def clear_launch_cache(self) -> None:
        """Forget every validated signature (the next call of each is checked again)."""
        self._runners.clear()


Views = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""The ``[nb, bs, H, D]`` K and V (for MLA: rope and latent) views of a cache tensor."""

Rows = Callable[[torch.Tensor], torch.Tensor]
"""The live key / value as ``[T, H, D]`` rows (a view at the same address)."""


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def split_runner(layout: KVCacheLayout, cache_dtype: KVCacheDType, path: WritePath) -> Runner:
    """The runner of a validated split write (live tensors: key, value, cache, slots,
    k_scale, v_scale)."""
    return views_runner(lambda c: split_kv_views(c, layout), cache_dtype, path)


def views_runner(views: Views, cache_dtype: KVCacheDType, path: WritePath, *,
                 same_scale: bool = False, rows: Rows = _same) -> Runner:
    """The runner of a validated write through ``views`` of the cache. ``same_scale``:
    the caller's live ``k_scale`` and ``v_scale`` are always one tensor (MLA). ``rows``:
    makes the live key and value ``[T, H, D]`` (a view at the same address: MLA's
    ``[T, W]`` rows), applied when a launch is built, not on every call."""
    if path == "triton":
        mode = scatter_mode(cache_dtype)

        def build(live: Sequence[torch.Tensor]) -> Launch:
            k_view, v_view = views(live[2])
            return scatter_kv_launch(rows(live[0]), rows(live[1]),
                                     ScatterTarget.token_major(k_view),
                                     ScatterTarget.token_major(v_view), live[3], mode,
                                     live[4], live[5], same_scale=same_scale)

        return CachedLaunch(build)

    def reference(live: Sequence[torch.Tensor]) -> None:
        k_view, v_view = views(live[2])
        reference_split_write(rows(live[0]), rows(live[1]), k_view, v_view, live[3],
                              KVQuant.of_checked(cache_dtype, live[4], live[5]))

    return reference


def rope_runner(views: Views, cache_dtype: KVCacheDType, style: str, has_query: bool,
                path: WritePath, *, same_scale: bool = False, rows: Rows = _same) -> Runner:
    """The runner of a validated fused RoPE write (live tensors: key, value, cache, slots,
    k_scale, v_scale, query (the key when there is none), positions, cos_sin_cache);
    ``same_scale`` and ``rows`` (for the key and value) as :func:`views_runner`'s."""
    neox = style == "neox"
    if path == "triton":
        mode = scatter_mode(cache_dtype)

        def build(live: Sequence[torch.Tensor]) -> Launch:
            k_view, v_view = views(live[2])
            return rope_kv_launch(live[6] if has_query else None, rows(live[0]),
                                  rows(live[1]),
                                  ScatterTarget.token_major(k_view),
                                  ScatterTarget.token_major(v_view), live[3], live[7],
                                  live[8], neox, mode, live[4], live[5],
                                  same_scale=same_scale)

        return CachedLaunch(build)

    def reference(live: Sequence[torch.Tensor]) -> None:
        k_view, v_view = views(live[2])
        scatter_kv_views_with_rope(
            live[6] if has_query else None, rows(live[0]), rows(live[1]), k_view, v_view,
            live[3],
            KVQuant.of_checked(cache_dtype, live[4], live[5]), live[7],
            RoPE(live[8], "neox" if neox else "gptj"), path="torch")

    return reference


def validate_kv_views(
    key: torch.Tensor,
    value: torch.Tensor,
    k_view: torch.Tensor,
    v_view: torch.Tensor,
    slot_mapping: torch.Tensor,
    quant: KVQuant,
    cache_dtypes: tuple[KVCacheDType, ...] = SPLIT_CACHE_DTYPES,
) -> None:
    """Check every argument of a split write. Writes nothing."""
    check_tensor("k_view", k_view)
    check_tensor("v_view", v_view)
    if k_view.dim() != 4 or v_view.dim() != 4 or k_view.shape[:3] != v_view.shape[:3]:
        raise KVCacheWriteError(
            "kv_cache views", (tuple(k_view.shape), tuple(v_view.shape)),
            "K and V views [num_blocks, block_size, num_kv_heads, head_size(_v)]",
        )
    if v_view.dtype != k_view.dtype or v_view.device != k_view.device:
        raise KVCacheWriteError("value_cache", f"{v_view.dtype} on {v_view.device}",
                                f"{k_view.dtype} on {k_view.device} (key_cache's)")
    _, _, h, d = k_view.shape
    check_kv_inputs(key, value, slot_mapping, quant, cache=k_view, num_kv_heads=h,
                    head_size=d, head_size_v=v_view.shape[3], cache_dtypes=cache_dtypes)


def write_kv_views(
    key: torch.Tensor,
    value: torch.Tensor,
    k_view: torch.Tensor,
    v_view: torch.Tensor,
    slot_mapping: torch.Tensor,
    quant: KVQuant,
    cache_dtypes: tuple[KVCacheDType, ...] = SPLIT_CACHE_DTYPES,
    *,
    path: WritePath | None = None,
) -> None:
    """Validate, then write into ``[nb, bs, H, D]`` K and V views (any strides)."""
    validate_kv_views(key, value, k_view, v_view, slot_mapping, quant, cache_dtypes)
    scatter_kv_views(key, value, k_view, v_view, slot_mapping, quant, path=path)


def scatter_kv_views(
    key: torch.Tensor,
    value: torch.Tensor,
    k_view: torch.Tensor,
    v_view: torch.Tensor,
    slot_mapping: torch.Tensor,
    quant: KVQuant,
    *,
    path: WritePath | None = None,
) -> None:
    """:func:`write_kv_views` without the checks, for writers that ran their own."""
    if resolve_path(k_view.device, path) == "triton":
        scatter_kv(key, value, ScatterTarget.token_major(k_view),
                   ScatterTarget.token_major(v_view), slot_mapping,
                   scatter_mode(quant.kv_cache_dtype), quant.k_scale, quant.v_scale)
    else:
        reference_split_write(key, value, k_view, v_view, slot_mapping, quant)


def check_rope_inputs(query: object, key: torch.Tensor, slot_mapping: torch.Tensor,
                      positions: object, rope: object, device: torch.device) -> None:
    """The RoPE arguments of a fused write whose K/V arguments are already checked."""
    pos, r = check_rope_args(positions, rope, num_tokens=slot_mapping.shape[0],
                             head_size=key.shape[-1], device=device)
    if query is not None:
        check_query(query, rows=pos.shape[0], head_size=key.shape[-1], dtype=key.dtype,
                    device=device)


def scatter_kv_views_with_rope(
    query: torch.Tensor | None,
    key: torch.Tensor,
    value: torch.Tensor,
    k_view: torch.Tensor,
    v_view: torch.Tensor,
    slot_mapping: torch.Tensor,
    quant: KVQuant,
    positions: torch.Tensor,
    rope: RoPE,
    *,
    path: WritePath | None = None,
) -> None:
    """Rotate ``query`` rows ``[0, N)`` in place and write the rotated ``key`` rows and
    the ``value`` rows into ``[nb, bs, H, D]`` views, without the checks. The torch path
    is the definition: :func:`~vllm.attention.rope.rotate_reference`, then
    :func:`reference_split_write`."""
    if resolve_path(k_view.device, path) == "triton":
        rope_kv_launch(query, key, value, ScatterTarget.token_major(k_view),
                       ScatterTarget.token_major(v_view), slot_mapping, positions,
                       rope.cos_sin_cache, rope.is_neox, scatter_mode(quant.kv_cache_dtype),
                       quant.k_scale, quant.v_scale).run()
        return
    n = slot_mapping.shape[0]
    if query is not None:
        rows = positions.shape[0]
        query[:rows] = rotate_reference(query[:rows], positions, rope)
    rotated = rotate_reference(key[:n], positions[:n], rope)
    reference_split_write(rotated, value, k_view, v_view, slot_mapping, quant)
