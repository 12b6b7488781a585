"""Validate a write's call signature once; repeat calls look it up and launch.

A layer writes with the same shapes, strides, dtypes and devices step after step
(one signature per padded batch size), and every check a writer runs reads only
that metadata. So a writer validates a signature the first time it sees it and
keeps the resulting runner (:class:`~vllm.attention.ops.triton_writers.CachedLaunch`
on the Triton path, the torch reference otherwise); a repeat call costs the
signature, one dict lookup and the launch. Anything not part of a signature
(an object that is not exactly a ``torch.Tensor`` / ``KVQuant`` / ``RoPE``) is
never cached, so it always meets the full checks and their errors; a signature
that fails validation is never stored, so a bad call after good ones raises the
same error it always did, before anything is written.

Value checks (slot ranges, positions) belong to checked mode and run in the layer
on every call, cached or not. ``VLLM_KV_WRITER_PATH`` is read when a signature is
first validated.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Final

import torch

from vllm.attention.rope import RoPE
from vllm.attention.types import KVQuant

Runner = Callable[[Sequence[torch.Tensor]], None]
"""Runs a validated write on live tensors, ordered as
:data:`~vllm.attention.ops.triton_writers.LIVE_ROLES`."""

Signature = tuple[Hashable, ...]
"""What a write's checks read: shapes, strides, dtypes, devices, formats, the path."""

MAX_SIGNATURES: Final = 64
"""Signatures kept per writer; the table is cleared when it would grow past this."""

_Tensor: Final = torch.Tensor


def write_signature(a: torch.Tensor, b: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, quant: KVQuant,
                    path: str | None) -> Signature | None:
    """Everything the checks of ``write(a, b, kv_cache, slot_mapping, quant, path=path)``
    read, or None when an argument is not exactly a tensor / :class:`KVQuant` (the
    annotations are what callers should pass; this is where other objects are caught)."""
    if (type(a) is not _Tensor or type(b) is not _Tensor or type(kv_cache) is not _Tensor
            or type(slot_mapping) is not _Tensor or type(quant) is not KVQuant):
        return None
    dt = quant.kv_cache_dtype
    if dt == "auto":  # unscaled: no check reads the scales (KVQuant checked their type)
        return (a.shape, a.stride(), a.dtype, a.device,
                b.shape, b.stride(), b.dtype, b.device,
                kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.device,
                slot_mapping.shape, slot_mapping.stride(), slot_mapping.dtype,
                slot_mapping.device, dt, path)
    ks, vs = quant.k_scale, quant.v_scale
    return (a.shape, a.stride(), a.dtype, a.device,
            b.shape, b.stride(), b.dtype, b.device,
            kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.device,
            slot_mapping.shape, slot_mapping.stride(), slot_mapping.dtype, slot_mapping.device,
            dt, ks.shape, ks.stride(), ks.device, vs.shape, vs.stride(), vs.device, path)


def rope_signature(base: Signature | None, query: torch.Tensor | None,
                   positions: torch.Tensor, rope: RoPE) -> Signature | None:
    """:func:`write_signature` extended by the RoPE arguments of ``write_with_rope``."""
    if base is None or type(positions) is not _Tensor or type(rope) is not RoPE:
        return None
    if query is None:
        q: Signature = ()
    elif type(query) is _Tensor:
        q = (query.shape, query.stride(), query.dtype, query.device)
    else:
        return None
    cs = rope.cos_sin_cache
    return (*base, q, positions.shape, positions.stride(), positions.dtype, positions.device,
            cs.shape, cs.stride(), cs.dtype, cs.device, rope.style)


class SignatureCache(dict[Signature | None, Runner]):
    """``signature -> runner`` for one writer instance; ``get`` is the plain dict lookup
    (``get(None)`` finds nothing: ``put`` never stores None). Bounded: cleared when it
    would grow past :data:`MAX_SIGNATURES`."""

    def put(self, sig: Signature | None, runner: Runner) -> None:
        if sig is None:
            return
        if len(self) >= MAX_SIGNATURES:
            self.clear()
        self[sig] = runner
