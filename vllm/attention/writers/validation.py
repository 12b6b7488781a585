"""Argument checks every writer runs before it writes anything.

The cheap checks (dtypes, shapes, devices) always run: they read tensor metadata
only. Slot-range and duplicate checks read ``slot_mapping``'s values, which costs
a device sync, so they run only in checked mode (``VLLM_KV_CHECKED=1`` or
``Attention(checked=True)``).
"""

from __future__ import annotations

import torch

from vllm.attention.env import env_flag
from vllm.attention.errors import InvalidTypeError, KVCacheWriteError
from vllm.attention.types import KVCacheDType, KVQuant, is_fp8_scaled
from vllm.attention.writers.quant import FP8_DTYPES

_FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)


def checked_mode_from_env() -> bool:
    """``VLLM_KV_CHECKED`` set to 1/true/yes/on turns checked mode on by default."""
    return env_flag("VLLM_KV_CHECKED")


def check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(name, type(t).__name__, "a torch.Tensor")
    return t


def check_cache_tensor(kv_cache: object) -> torch.Tensor:
    """``kv_cache`` is a tensor whose elements each have their own memory.

    An ``expand()``-ed or otherwise self-overlapping view would turn a write to one
    slot into a write to others. Metadata only: axes sorted by stride must each step
    past everything the smaller ones span (all nested layouts pass).
    """
    cache = check_tensor("kv_cache", kv_cache)
    reach = 0  # the largest element offset the axes checked so far can reach
    for stride, size in sorted((st, sz) for sz, st in zip(cache.shape, cache.stride())
                               if sz > 1):
        if stride <= reach:
            raise KVCacheWriteError(
                "kv_cache.stride", tuple(cache.stride()),
                f"strides giving every element of shape {tuple(cache.shape)} its own memory "
                "(no expand()-ed or overlapping axes)",
            )
        reach += (size - 1) * stride
    return cache


def check_rows(name: str, t: object, *, num_tokens: int, tail: tuple[int, ...],
               tail_desc: str) -> torch.Tensor:
    """``t`` is a float input of shape ``[>= num_tokens, *tail]``."""
    x = check_tensor(name, t)
    if x.dtype not in _FLOAT_INPUTS:
        raise KVCacheWriteError(f"{name}.dtype", x.dtype, "torch.float32, float16 or bfloat16")
    if x.dim() != 1 + len(tail) or tuple(x.shape[1:]) != tail or x.shape[0] < num_tokens:
        raise KVCacheWriteError(
            f"{name}.shape", tuple(x.shape),
            f"[>= num_tokens={num_tokens}, {tail_desc}] = [>= {num_tokens}, "
            + ", ".join(map(str, tail)) + "]",
        )
    return x


def check_slot_mapping(slot_mapping: object, device: torch.device) -> torch.Tensor:
    s = check_tensor("slot_mapping", slot_mapping)
    if s.dtype != torch.int64:
        raise KVCacheWriteError("slot_mapping.dtype", s.dtype, "torch.int64")
    if s.dim() != 1:
        raise KVCacheWriteError("slot_mapping.shape", tuple(s.shape), "[num_tokens]")
    if s.device != device:
        raise KVCacheWriteError("slot_mapping.device", str(s.device), f"{device} (the cache's)")
    return s


def check_same_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise KVCacheWriteError(f"{name}.device", str(t.device), f"{device} (the cache's)")


def check_quant(quant: object, *, num_kv_heads: int, device: torch.device,
                allowed: tuple[KVCacheDType, ...]) -> KVQuant:
    if not isinstance(quant, KVQuant):
        raise InvalidTypeError("quant", type(quant).__name__, "a vllm.attention.KVQuant")
    if quant.kv_cache_dtype not in allowed:
        raise KVCacheWriteError(
            "quant.kv_cache_dtype", quant.kv_cache_dtype, f"one of {', '.join(allowed)}"
        )
    if is_fp8_scaled(quant.kv_cache_dtype):
        for name, sc in (("quant.k_scale", quant.k_scale), ("quant.v_scale", quant.v_scale)):
            if sc.numel() not in (1, num_kv_heads):
                raise KVCacheWriteError(
                    f"{name}.shape", tuple(sc.shape), f"[1] or [num_kv_heads={num_kv_heads}]"
                )
            check_same_device(name, sc, device)
    return quant


def check_cache_dtype(kv_cache: torch.Tensor, cache_dtype: KVCacheDType,
                      input_dtype: torch.dtype) -> None:
    """The cache tensor's dtype is the one ``cache_dtype`` stores."""
    if cache_dtype == "auto":
        expected = input_dtype
    elif cache_dtype in FP8_DTYPES:
        expected = FP8_DTYPES[cache_dtype]
    else:
        expected = torch.uint8
    if kv_cache.dtype != expected:
        raise KVCacheWriteError(
            "kv_cache.dtype", kv_cache.dtype,
            f"{expected} for kv_cache_dtype={cache_dtype!r} with {input_dtype} inputs",
        )


def check_kv_inputs(
    key: object,
    value: object,
    slot_mapping: object,
    quant: object,
    *,
    cache: torch.Tensor,
    num_kv_heads: int,
    head_size: int,
    head_size_v: int,
    cache_dtypes: tuple[KVCacheDType, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, KVQuant]:
    """The cheap checks of a K/V write into ``cache``; returns key, value, slots, quant."""
    slots = check_slot_mapping(slot_mapping, cache.device)
    n = slots.shape[0]
    k = check_rows("key", key, num_tokens=n, tail=(num_kv_heads, head_size),
                   tail_desc="num_kv_heads, head_size")
    v = check_rows("value", value, num_tokens=n, tail=(num_kv_heads, head_size_v),
                   tail_desc="num_kv_heads, head_size_v")
    if v.dtype != k.dtype:
        raise KVCacheWriteError("value.dtype", v.dtype, f"{k.dtype} (key's dtype)")
    check_same_device("key", k, cache.device)
    check_same_device("value", v, cache.device)
    q = check_quant(quant, num_kv_heads=num_kv_heads, device=cache.device, allowed=cache_dtypes)
    check_cache_dtype(cache, q.kv_cache_dtype, k.dtype)
    return k, v, slots, q


def check_slots_in_range(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Checked mode: every non-negative slot is below ``num_slots`` and none repeats."""
    if slot_mapping.numel() == 0:
        return
    valid = slot_mapping[slot_mapping >= 0]
    if valid.numel() == 0:
        return
    hi = int(valid.max().item())
    if hi >= num_slots:
        bad = int((valid >= num_slots).sum().item())
        raise KVCacheWriteError(
            "slot_mapping", f"{bad} slot(s) up to {hi}",
            f"slots in [0, {num_slots}) (num_blocks * block_size) or negative to skip",
        )
    uniq = torch.unique(valid)
    if uniq.numel() != valid.numel():
        vals, counts = torch.unique(valid, return_counts=True)
        dup = vals[counts > 1][:5].tolist()
        raise KVCacheWriteError(
            "slot_mapping", f"duplicate slots {dup}",
            "each non-negative slot at most once per write (duplicates are rejected "
            "in checked mode; unchecked, the slot's contents are unspecified)",
        )
