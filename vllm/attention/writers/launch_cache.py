"""Validate a write's call signature once; repeat calls look it up and launch.

A layer writes with the same shapes, strides, dtypes and devices step after step
(one signature per padded batch size), and every check a writer runs reads only
that metadata. So a writer validates a signature the first time it sees it and
keeps the resulting runner (:class:`~vllm.attention.writers.kernels.CachedLaunch`
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

import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Final

import torch

from vllm.attention.rope import RoPE
from vllm.attention.types import KVQuant

Runner = Callable[[Sequence[torch.Tensor]], None]
"""Runs a validated write on live tensors, ordered as
:data:`~vllm.attention.writers.kernels.LIVE_ROLES`."""

Signature = tuple[Hashable, ...]
"""What a write's checks read: shapes, strides, dtypes, devices, formats, the path."""

MAX_SIGNATURES: Final = 64
"""Signatures kept per writer; the table is cleared when it would grow past this."""

_Tensor: Final = torch.Tensor


Meta = tuple[Hashable, ...]
"""Shapes, strides, dtypes and devices of a call's per-step tensors (the new ones every
step: keys, values, slots, and for RoPE the query and positions)."""


def _meta4(t: torch.Tensor) -> Meta:
    return (t.shape, t.stride(), t.dtype, t.device)


def write_meta(a: torch.Tensor, b: torch.Tensor, slot_mapping: torch.Tensor) -> Meta | None:
    """:data:`Meta` of a write's per-step tensors, or None when one is not exactly a
    tensor."""
    if type(a) is not _Tensor or type(b) is not _Tensor or type(slot_mapping) is not _Tensor:
        return None
    return (a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(), b.dtype, b.device,
            slot_mapping.shape, slot_mapping.stride(), slot_mapping.dtype,
            slot_mapping.device)


def rope_meta(base: Meta | None, query: torch.Tensor | None,
              positions: torch.Tensor) -> Meta | None:
    """:func:`write_meta` extended by ``write_with_rope``'s per-step tensors."""
    if base is None or type(positions) is not _Tensor:
        return None
    if query is None:
        q: Meta = ()
    elif type(query) is _Tensor:
        q = _meta4(query)
    else:
        return None
    return (base, q, positions.shape, positions.stride(), positions.dtype, positions.device)


def signature_of(meta: Meta | None, kv_cache: torch.Tensor, quant: KVQuant,
                 path: str | None, rope: RoPE | None = None) -> Signature | None:
    """The whole signature: ``meta`` plus the long-lived arguments (the cache, the
    quantisation and its scales, the path, the RoPE table); None when ``meta`` is None or
    one of them is not exactly its type."""
    if meta is None or type(kv_cache) is not _Tensor or type(quant) is not KVQuant:
        return None
    dt = quant.kv_cache_dtype
    if dt == "auto":  # unscaled: no check reads the scales (KVQuant checked their type)
        scales: Signature = ()
    else:
        ks, vs = quant.k_scale, quant.v_scale
        scales = (ks.shape, ks.stride(), ks.device, vs.shape, vs.stride(), vs.device)
    sig = (meta, _meta4(kv_cache), dt, scales, path)
    if rope is None:
        return sig
    if type(rope) is not RoPE:
        return None
    return (*sig, _meta4(rope.cos_sin_cache), rope.style)


def write_signature(a: torch.Tensor, b: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, quant: KVQuant,
                    path: str | None) -> Signature | None:
    """Everything the checks of ``write(a, b, kv_cache, slot_mapping, quant, path=path)``
    read, or None when an argument is not exactly a tensor / :class:`KVQuant` (the
    annotations are what callers should pass; this is where other objects are caught)."""
    return signature_of(write_meta(a, b, slot_mapping), kv_cache, quant, path)


class _Recent:
    """The last validated call of one entry point: what a repeat must match by identity
    (the long-lived cache, quantisation and RoPE table, held weakly so a writer never
    keeps a freed cache alive), the cache's shape and strides (an in-place metadata
    change of the same tensor), and the per-step :data:`Meta`."""

    __slots__ = ("cache", "meta", "path", "quant", "rope", "run", "shape", "stride")

    def __init__(self, meta: Meta, kv_cache: torch.Tensor, quant: KVQuant, path: str | None,
                 rope: RoPE | None, run: Runner) -> None:
        self.meta = meta
        self.cache = weakref.ref(kv_cache)
        self.shape, self.stride = kv_cache.shape, kv_cache.stride()
        self.quant = weakref.ref(quant)
        self.path = path
        self.rope = None if rope is None else weakref.ref(rope)
        self.run = run


class SignatureCache(dict[Signature | None, Runner]):
    """``signature -> runner`` for one writer instance; ``get`` is the plain dict lookup
    (``get(None)`` finds nothing: ``put`` never stores None). Bounded: cleared when it
    would grow past :data:`MAX_SIGNATURES`.

    Before the signature, :meth:`recall` matches the call against the last validated
    call of the same entry point (``write``, or ``write_with_rope``: a call with a
    ``rope``): the same cache,
    :class:`KVQuant`, path and RoPE objects, the cache's shape and strides unchanged, and
    equal per-step :data:`Meta`. A match has the signature of that call, so it runs
    its runner without building and hashing the signature (a T=1 step re-reads the
    metadata of three tensors, not seven)."""

    def __init__(self) -> None:
        super().__init__()
        self._recent: list[_Recent | None] = [None, None]

    def recall(self, meta: Meta | None, kv_cache: torch.Tensor, quant: KVQuant,
               path: str | None, rope: RoPE | None = None) -> Runner | None:
        """The runner of the last validated call of the same entry point when this call
        matches it, else None (the hot path: no allocation)."""
        r = self._recent[rope is not None]
        if (r is None or meta is None or r.cache() is not kv_cache or r.quant() is not quant
                or path is not r.path or meta != r.meta
                or (rope is not None and (r.rope is None or r.rope() is not rope))
                or kv_cache.shape != r.shape or kv_cache.stride() != r.stride):
            return None
        return r.run

    def lookup(self, meta: Meta | None, kv_cache: torch.Tensor, quant: KVQuant,
               path: str | None, rope: RoPE | None, make: Callable[[], Runner]) -> Runner:
        """After a failed :meth:`recall`: the runner of this call's signature, or
        ``make()`` (which runs every check and raises on a bad call) stored under it; the
        call is then the one :meth:`recall` matches next."""
        sig = signature_of(meta, kv_cache, quant, path, rope)
        run = self.get(sig)
        if run is None:
            run = make()
            self.put(sig, run)
        if sig is not None and meta is not None:
            self._recent[rope is not None] = _Recent(meta, kv_cache, quant, path, rope, run)
        return run

    def put(self, sig: Signature | None, runner: Runner) -> None:
        if sig is None:
            return
        if len(self) >= MAX_SIGNATURES:
            dict.clear(self)  # the recalled calls stay valid: keep them
        self[sig] = runner

    def clear(self) -> None:
        """Forget every signature and the recalled calls."""
        super().clear()
        self._recent = [None, None]
