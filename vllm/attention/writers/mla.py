"""Writer for the MLA latent cache ``(nb, bs, kv_lora_rank + rope_dim)``.

Each token's row is ``kv_c_normed`` then ``k_pe``, stored as the model dtype
(``auto``) or as fp8 with ``k_scale`` for both parts. It is the split scatter with
one "head" and two operands of different widths (latent and rope).
"""

from __future__ import annotations

from typing import ClassVar, Final

import torch

from vllm.attention.errors import KVCacheWriteError
from vllm.attention.layouts import mla_latent_views
from vllm.attention.rope import RoPE
from vllm.attention.types import KVCacheDType, KVCacheLayout, KVQuant
from vllm.attention.writers.dispatch import WritePath, WriterBase, resolve_path
from vllm.attention.writers.launch_cache import Runner, SignatureCache, rope_meta, write_meta
from vllm.attention.writers.split import (
    SPLIT_CACHE_DTYPES,
    check_rope_inputs,
    rope_runner,
    views_runner,
)
from vllm.attention.writers.validation import (
    check_cache_tensor,
    check_cache_dtype,
    check_quant,
    check_rows,
    check_same_device,
    check_slot_mapping,
    check_tensor,
)

MLA_CACHE_DTYPES: Final[tuple[KVCacheDType, ...]] = SPLIT_CACHE_DTYPES


def check_mla_inputs(
    kv_c_normed: object, k_pe: object, slot_mapping: object, cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked ``kv_c_normed`` ``[>= T, L]``, ``k_pe`` as ``[>= T, R]`` (a ``[T, 1, R]``
    is accepted) and ``slot_mapping`` ``[T]``, all on the cache's device."""
    slots = check_slot_mapping(slot_mapping, cache.device)
    n = slots.shape[0]
    kv_c = check_tensor("kv_c_normed", kv_c_normed)
    pe = check_tensor("k_pe", k_pe)
    if kv_c.dim() != 2:
        raise KVCacheWriteError("kv_c_normed.shape", tuple(kv_c.shape),
                                "[>= num_tokens, kv_lora_rank]")
    if pe.dim() == 3 and pe.shape[1] == 1:
        pe = pe[:, 0]
    if pe.dim() != 2:
        raise KVCacheWriteError("k_pe.shape", tuple(pe.shape),
                                "[>= num_tokens, rope_dim] or [>= num_tokens, 1, rope_dim]")
    check_rows("kv_c_normed", kv_c, num_tokens=n, tail=(kv_c.shape[1],),
               tail_desc="kv_lora_rank")
    check_rows("k_pe", pe, num_tokens=n, tail=(pe.shape[1],), tail_desc="rope_dim")
    if pe.dtype != kv_c.dtype:
        raise KVCacheWriteError("k_pe.dtype", pe.dtype, f"{kv_c.dtype} (kv_c_normed's dtype)")
    check_same_device("kv_c_normed", kv_c, cache.device)
    check_same_device("k_pe", pe, cache.device)
    return kv_c, pe, slots


class MLALatentCacheWriter(WriterBase):
    """:class:`~vllm.attention.MLAKVCacheWriter` for ``KVCacheLayout.MLA_LATENT``."""

    layout = KVCacheLayout.MLA_LATENT
    supports_fused_rope: ClassVar[bool] = True

    def __init__(self, cache_dtypes: tuple[KVCacheDType, ...] = MLA_CACHE_DTYPES) -> None:
        self.cache_dtypes = cache_dtypes
        self._runners = SignatureCache()

    def write(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor, quant: KVQuant, *,
              path: WritePath | None = None) -> None:
        """See :class:`~vllm.attention.MLAKVCacheWriter`; ``kv_cache``: ``(nb, bs, L + R)``;
        ``quant.k_scale`` (``[1]``) scales both parts, ``v_scale`` is unused."""
        meta = write_meta(kv_c_normed, k_pe, slot_mapping)
        run = self._runners.recall(meta, kv_cache, quant, path)
        if run is None:
            def make() -> Runner:
                kv_c, _, _, cache, both = self._checked(kv_c_normed, k_pe, kv_cache,
                                                        slot_mapping, quant)
                lora = kv_c.shape[1]
                return views_runner(lambda c: _latent_rope_views(c, lora),
                                    both.kv_cache_dtype, resolve_path(cache.device, path),
                                    same_scale=True, rows=_as_rows)

            run = self._runners.lookup(meta, kv_cache, quant, path, None, make)
        ks = quant.k_scale
        run((kv_c_normed, k_pe, kv_cache, slot_mapping, ks, ks))

    def write_with_rope(self, query_pe: torch.Tensor | None, kv_c_normed: torch.Tensor,
                        k_pe: torch.Tensor, kv_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, quant: KVQuant, positions: torch.Tensor,
                        rope: RoPE, *, path: WritePath | None = None) -> None:
        """See :class:`~vllm.attention.FusedRoPEMLAKVCacheWriter`: one kernel rotates
        ``query_pe`` ``[>= N, num_heads, rope_dim]`` in place and stores the latent and
        the rotated ``k_pe``."""
        meta = rope_meta(write_meta(kv_c_normed, k_pe, slot_mapping), query_pe, positions)
        run = self._runners.recall(meta, kv_cache, quant, path, rope)
        if run is None:
            def make() -> Runner:
                kv_c, pe, slots, cache, both = self._checked(kv_c_normed, k_pe, kv_cache,
                                                             slot_mapping, quant)
                check_rope_inputs(query_pe, pe.unsqueeze(1), slots, positions, rope,
                                  cache.device)
                lora = kv_c.shape[1]
                # the rotated operand is the rope part: "key" = k_pe, "value" = the latent
                return rope_runner(lambda c: _rope_latent_views(c, lora),
                                   both.kv_cache_dtype, rope.style, query_pe is not None,
                                   resolve_path(cache.device, path), same_scale=True,
                                   rows=_as_rows)

            run = self._runners.lookup(meta, kv_cache, quant, path, rope, make)
        ks = quant.k_scale
        run((k_pe, kv_c_normed, kv_cache, slot_mapping, ks, ks,
             k_pe if query_pe is None else query_pe, positions, rope.cos_sin_cache))

    def clear_launch_cache(self) -> None:
        """Forget every validated signature (the next call of each is checked again)."""
        self._runners.clear()

    def _checked(self, kv_c_normed: object, k_pe: object, kv_cache: object,
                 slot_mapping: object, quant: object
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, KVQuant]:
        cache = check_cache_tensor(kv_cache)
        kv_c, pe, slots = check_mla_inputs(kv_c_normed, k_pe, slot_mapping, cache)
        width = kv_c.shape[1] + pe.shape[1]
        if cache.dim() != 3 or cache.shape[2] != width:
            raise KVCacheWriteError(
                "kv_cache.shape", tuple(cache.shape),
                f"(num_blocks, block_size, kv_lora_rank + rope_dim = {kv_c.shape[1]} + "
                f"{pe.shape[1]} = {width})",
            )
        q = check_quant(quant, num_kv_heads=1, device=cache.device, allowed=self.cache_dtypes)
        check_cache_dtype(cache, q.kv_cache_dtype, kv_c.dtype)
        return kv_c, pe, slots, cache, KVQuant.of_checked(q.kv_cache_dtype, q.k_scale, q.k_scale)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """``[T, W]`` (or ``[T, 1, W]``) as ``[T, 1, W]``: one "head" (a view; validated)."""
    return x if x.dim() == 3 else x.unsqueeze(1)


def _latent_rope_views(cache: torch.Tensor, lora: int) -> tuple[torch.Tensor, torch.Tensor]:
    latent, rope = mla_latent_views(cache, lora)
    return latent.unsqueeze(2), rope.unsqueeze(2)


def _rope_latent_views(cache: torch.Tensor, lora: int) -> tuple[torch.Tensor, torch.Tensor]:
    latent, rope = mla_latent_views(cache, lora)
    return rope.unsqueeze(2), latent.unsqueeze(2)
