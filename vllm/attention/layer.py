"""The attention layer: write this step's K/V, then compute.

This module's write path is the only code in ``vllm`` that reads ``slot_mapping``
(from the ForwardContext). Order per call: validate -> write -> connector hook ->
compute. KV-sharing layers and encoder-only attention never write.

Given ``positions`` and a :class:`~vllm.attention.rope.RoPE`, ``forward`` also
rotates the query (in place) and the keys: in the write kernel itself when the
writer is a :class:`~vllm.attention.FusedRoPEKVCacheWriter`, else by a rotation
before the write. Under ``torch.compile`` the write and the compute run as the
``vllm_kv`` custom ops (:mod:`vllm.attention.ops.custom_ops`), one graph node each.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from vllm.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerProtocol,
    AttentionLayerSpec,
    num_blocks_of,
)
from vllm.attention.errors import InvalidArgumentError, InvalidTypeError
from vllm.attention.ops import custom_ops
from vllm.attention.rope import RoPE, apply_rope, check_positions_in_range, rotate_reference
from vllm.attention.types import (
    AttentionType,
    KVCacheDType,
    KVCacheLayout,
    KVQuant,
    parse_kv_cache_dtype,
)
from vllm.attention.writer import (
    FusedRoPEKVCacheWriter,
    FusedRoPEMLAKVCacheWriter,
    KVCacheWriter,
    MLAKVCacheWriter,
)
from vllm.attention.writers.validation import check_slots_in_range, checked_mode_from_env
from vllm.forward_context import ForwardContext, get_forward_context


@runtime_checkable
class ProvidesKVCacheWriter(Protocol):
    """An impl that supplies its own writer bound to the layer (the legacy adapter's
    impls do, to route the write through the old ``do_kv_cache_update``)."""

    def kv_cache_writer(self, layer: AttentionLayerProtocol) -> KVCacheWriter: ...


@runtime_checkable
class BindsLayerGeometry(Protocol):
    """A writer whose cache shape does not carry the layer's head count and size
    (``legacy_paged``): the layer binds it, and the bound writer rejects keys of any
    other geometry instead of writing them to the wrong places."""

    def bound_to(self, *, num_kv_heads: int, head_size: int,
                 head_size_v: int) -> KVCacheWriter: ...


def _scale_tensor(name: str, scale: float | torch.Tensor | None, num_kv_heads: int) -> torch.Tensor:
    if scale is None:
        return torch.ones(1, dtype=torch.float32)
    t = torch.as_tensor(scale, dtype=torch.float32).reshape(-1).clone()
    if t.numel() not in (1, num_kv_heads) or not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
        raise InvalidArgumentError(
            name, scale, f"a positive finite float or [1] / [num_kv_heads={num_kv_heads}] tensor"
        )
    return t


def _cache_dtype_for(backend: object, kv_cache_dtype: str) -> KVCacheDType:
    """``kv_cache_dtype`` in the spelling ``backend`` declares (``fp8_e4m3`` -> ``fp8``,
    ``bfloat16`` -> ``auto``), so its code sees only its own spellings."""
    parsed = parse_kv_cache_dtype(kv_cache_dtype)
    if isinstance(backend, type) and issubclass(backend, AttentionBackend):
        return backend.cache_dtype_spelling(parsed) or parsed
    return parsed  # not a backend: the layer's own check names it


class _LayerBase(nn.Module):
    """What :class:`Attention` and :class:`MLAAttention` share: backend, cache, quant."""

    kv_cache: torch.Tensor
    _k_scale: torch.Tensor
    _v_scale: torch.Tensor

    def __init__(
        self,
        *,
        backend: type[AttentionBackend[Any]],
        spec: AttentionLayerSpec,
        layer_name: str,
        k_scale: float | torch.Tensor | None,
        v_scale: float | torch.Tensor | None,
        checked: bool | None,
    ) -> None:
        super().__init__()
        candidate: object = backend
        if not (isinstance(candidate, type) and issubclass(candidate, AttentionBackend)):
            raise InvalidTypeError(
                "backend", backend, "an AttentionBackend subclass (see vllm.attention.registry)"
            )
        self.backend = backend
        self.spec = spec
        self._layer_name = layer_name
        self.checked = checked_mode_from_env() if checked is None else checked
        self.register_buffer("_k_scale", _scale_tensor("k_scale", k_scale, spec.num_kv_heads))
        self.register_buffer("_v_scale", _scale_tensor("v_scale", v_scale, spec.num_kv_heads))
        self.kv_cache = torch.empty(0)
        self.block_size: int | None = None
        self.impl: AttentionImpl[Any] = backend.get_impl_cls()(spec)
        self._metadata_cls = backend.get_metadata_cls()
        self._kv_quant: KVQuant | None = None

    @property
    def layer_name(self) -> str:
        return self._layer_name

    @property
    def kv_cache_dtype(self) -> KVCacheDType:
        return self.spec.kv_cache_dtype

    @property
    def kv_quant(self) -> KVQuant:
        q = self._kv_quant  # built once per pair of scale tensors: a write reads it each step
        if q is None or q.k_scale is not self._k_scale or q.v_scale is not self._v_scale:
            q = KVQuant(self.spec.kv_cache_dtype, self._k_scale, self._v_scale)
            self._kv_quant = q
        return q

    @property
    def writes_kv_cache(self) -> bool:
        """False for KV-sharing layers and encoder-only attention."""
        return (
            self.spec.kv_sharing_target_layer_name is None
            and self.spec.attn_type is not AttentionType.ENCODER_ONLY
        )

    def bind_kv_cache(self, kv_cache: torch.Tensor, block_size: int) -> None:
        """Attach this layer's cache (a KV-sharing layer binds its target's tensor)."""
        if not isinstance(kv_cache, torch.Tensor):
            raise InvalidTypeError("kv_cache", type(kv_cache).__name__, "a torch.Tensor")
        if not self.backend.block_sizes.admits(block_size):
            raise InvalidArgumentError(
                "block_size", block_size,
                f"{self.backend.block_sizes.describe()} for {self.backend.name}",
            )
        self._check_cache_shape(kv_cache, block_size)
        self.kv_cache = kv_cache
        self.block_size = block_size
        if self._k_scale.device != kv_cache.device:  # scales live with the cache
            self._k_scale = self._k_scale.to(kv_cache.device)
            self._v_scale = self._v_scale.to(kv_cache.device)

    def _check_cache_shape(self, kv_cache: torch.Tensor, block_size: int) -> None:
        # The writer addresses slots by the cache's own shape, checked mode by the bound
        # block_size: a cache of another block size would pass the range check and be
        # written out of bounds.
        spec = self.spec
        if spec.attn_type is AttentionType.ENCODER_ONLY:
            return  # no cache
        head_size = spec.head_size
        if self.backend.kv_cache_layout_for(spec.kv_cache_dtype) is KVCacheLayout.DIFFKV_PACKED:
            head_size += spec.v_head_size
        want: tuple[int, ...] | None = None
        try:
            want = tuple(self.backend.get_kv_cache_shape(
                num_blocks_of(self.backend, kv_cache), block_size, spec.num_kv_heads,
                head_size, spec.kv_cache_dtype))
        except (IndexError, ValueError):
            pass  # a cache of the wrong rank: reported below
        if tuple(kv_cache.shape) != want:
            raise InvalidArgumentError(
                "kv_cache.shape", tuple(kv_cache.shape),
                f"{self.backend.name}'s cache shape for block_size={block_size}, "
                f"num_kv_heads={spec.num_kv_heads}, head_size={head_size}, "
                f"kv_cache_dtype={spec.kv_cache_dtype!r}"
                + ("" if want is None else f": {want}"),
            )

    def _context_and_metadata(self) -> tuple[ForwardContext, Any]:
        ctx = get_forward_context()
        meta = ctx.attn_metadata_for(self.layer_name)
        if not isinstance(meta, self._metadata_cls):
            raise InvalidTypeError(
                f"attn_metadata[{self.layer_name!r}]", type(meta).__name__,
                f"{self._metadata_cls.__name__} (from {self.backend.name}.get_metadata_cls())",
            )
        return ctx, meta

    def _slots_for_write(self, ctx: ForwardContext) -> torch.Tensor:
        slots = ctx.slot_mapping_for(self.layer_name)
        if self.checked:
            if self.block_size is None:
                raise InvalidArgumentError("kv_cache", "unbound", "bind_kv_cache() before forward")
            check_slots_in_range(slots, self.num_cache_slots())
        return slots

    def num_cache_slots(self) -> int:
        """``num_blocks * block_size`` of the bound cache."""
        if self.block_size is None:
            return 0
        return num_blocks_of(self.backend, self.kv_cache) * self.block_size

    def _checked_positions(self, positions: torch.Tensor, rope: RoPE) -> None:
        if self.checked:
            check_positions_in_range(positions, rope)

    def attend_for_op(self, query: torch.Tensor, key: torch.Tensor | None,
                      value: torch.Tensor | None, kv_cache: torch.Tensor,
                      output: torch.Tensor) -> None:
        """``vllm_kv::attention``'s body: the impl over ``kv_cache`` into ``output``."""
        _, meta = self._context_and_metadata()
        result = self.impl.forward(self, query, key, value, kv_cache, meta, output)
        if result is not output:
            output.copy_(result)


def _check_rope_pair(positions: torch.Tensor | None, rope: RoPE | None) -> None:
    if (positions is None) != (rope is None):
        raise InvalidArgumentError(
            "positions/rope", "one of them None", "both (rotate q and k) or neither")


class Attention(_LayerBase):
    """Multi-head / grouped-query attention over a paged cache.

    ``forward(query, key, value)``: ``query`` ``[T, num_heads, head_size]`` (or
    flattened ``[T, num_heads * head_size]``), ``key``/``value``
    ``[T, num_kv_heads, head_size(_v)]``. Returns ``[T, num_heads, head_size_v]``
    (flattened if ``query`` was).
    """

    def __init__(
        self,
        *,
        num_heads: int,
        head_size: int,
        scale: float,
        backend: type[AttentionBackend[Any]],
        layer_name: str,
        num_kv_heads: int | None = None,
        head_size_v: int | None = None,
        kv_cache_dtype: str = "auto",
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        attn_type: AttentionType = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
        checked: bool | None = None,
    ) -> None:
        spec = AttentionLayerSpec(
            num_heads=num_heads,
            head_size=head_size,
            num_kv_heads=num_heads if num_kv_heads is None else num_kv_heads,
            scale=scale,
            head_size_v=head_size_v,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            attn_type=attn_type,
            kv_cache_dtype=_cache_dtype_for(backend, kv_cache_dtype),
            kv_sharing_target_layer_name=kv_sharing_target_layer_name,
        )
        super().__init__(backend=backend, spec=spec, layer_name=layer_name,
                         k_scale=k_scale, v_scale=v_scale, checked=checked)
        writer: KVCacheWriter | MLAKVCacheWriter
        if isinstance(self.impl, ProvidesKVCacheWriter):
            writer = self.impl.kv_cache_writer(self)
        else:
            writer = backend.get_kv_cache_writer(spec.kv_cache_dtype)
        if isinstance(writer, BindsLayerGeometry):
            writer = writer.bound_to(num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                                     head_size_v=spec.v_head_size)
        if not isinstance(writer, KVCacheWriter):
            raise InvalidTypeError("writer", writer, "a KVCacheWriter")
        self.kv_cache_writer: KVCacheWriter = writer
        self._fused_rope: FusedRoPEKVCacheWriter | None = (
            writer if isinstance(writer, FusedRoPEKVCacheWriter) and writer.supports_fused_rope
            else None)
        self._op_key = custom_ops.register_layer(self, layer_name)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, ctx: ForwardContext) -> None:
        """The write path: the slot mapping from ``ctx`` into this layer's cache."""
        self._write(key, value, ctx, self.kv_cache)

    def _write(self, key: torch.Tensor, value: torch.Tensor, ctx: ForwardContext,
               kv_cache: torch.Tensor) -> None:
        slots = self._slots_for_write(ctx)
        self.kv_cache_writer.write(key, value, kv_cache, slots, self.kv_quant)
        if ctx.kv_connector is not None:
            ctx.kv_connector.on_kv_written(self.layer_name, kv_cache, slots)

    def write_kv_with_rope(self, query: torch.Tensor | None, key: torch.Tensor,
                           value: torch.Tensor, positions: torch.Tensor, rope: RoPE,
                           ctx: ForwardContext) -> None:
        """The write path with RoPE: ``query`` rotated in place, the keys rotated into
        the cache (``key`` itself is left as it was)."""
        self._write_with_rope(query, key, value, positions, rope, ctx, self.kv_cache)

    def _write_with_rope(self, query: torch.Tensor | None, key: torch.Tensor,
                         value: torch.Tensor, positions: torch.Tensor, rope: RoPE,
                         ctx: ForwardContext, kv_cache: torch.Tensor) -> None:
        slots = self._slots_for_write(ctx)
        self._checked_positions(positions, rope)
        fused = self._fused_rope
        if fused is not None:
            fused.write_with_rope(query, key, value, kv_cache, slots, self.kv_quant, positions,
                                  rope)
        else:
            rotated = key.clone()
            apply_rope(query, rotated, positions, rope)
            self.kv_cache_writer.write(rotated, value, kv_cache, slots, self.kv_quant)
        if ctx.kv_connector is not None:
            ctx.kv_connector.on_kv_written(self.layer_name, kv_cache, slots)

    def write_for_op(self, key: torch.Tensor, value: torch.Tensor,
                     kv_cache: torch.Tensor) -> None:
        """``vllm_kv::write_kv``'s body."""
        self._write(key, value, get_forward_context(), kv_cache)

    def write_rope_for_op(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          kv_cache: torch.Tensor, positions: torch.Tensor,
                          cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
        """``vllm_kv::write_kv_rope``'s body."""
        rope = RoPE(cos_sin_cache, "neox" if is_neox else "gptj")
        self._write_with_rope(query, key, value, positions, rope, get_forward_context(),
                              kv_cache)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        output: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
        rope: RoPE | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V, then attend.

        With ``positions`` (int64 ``[N]``, N >= the step's tokens) and ``rope``, the
        query rows ``[0, N)`` are rotated in place and the keys are rotated on their
        way into the cache; ``key`` itself is not modified, and compute reads the
        rotated keys from the cache (a layer without a cache write rotates a copy).
        """
        compiling = torch.compiler.is_compiling()
        found = None if compiling else self._context_and_metadata()
        spec = self.spec
        flat = query.dim() == 2
        q = query.view(query.shape[0], spec.num_heads, spec.head_size) if flat else query
        if (key is None) != (value is None):
            raise InvalidArgumentError(
                "key/value", "one of them None", "both tensors, or both None (cross-attention "
                "after its first step)",
            )
        _check_rope_pair(positions, rope)
        if key is None and spec.attn_type is not AttentionType.ENCODER_DECODER:
            raise InvalidArgumentError(
                "key", None, f"a tensor for attn_type={spec.attn_type.value}"
            )
        out = output
        if out is None:
            out = torch.empty(q.shape[0], spec.num_heads, spec.v_head_size,
                              dtype=q.dtype, device=q.device)
        writes = key is not None and value is not None and self.writes_kv_cache
        if found is None:
            result = self._forward_ops(q, key, value, out, writes, positions, rope)
        else:
            ctx, meta = found
            if writes and key is not None and value is not None:
                if positions is not None and rope is not None:
                    self.write_kv_with_rope(q, key, value, positions, rope, ctx)
                else:
                    self.write_kv(key, value, ctx)
            elif positions is not None and rope is not None:
                key = _rotate_without_write(q, key, positions, rope)
            result = self.impl.forward(self, q, key, value, self.kv_cache, meta, out)
        return result.flatten(1) if flat else result

    def _forward_ops(self, q: torch.Tensor, key: torch.Tensor | None,
                     value: torch.Tensor | None, out: torch.Tensor, writes: bool,
                     positions: torch.Tensor | None, rope: RoPE | None) -> torch.Tensor:
        """``forward`` as custom ops: what ``torch.compile`` traces (no ForwardContext
        access here; the ops read it when they run)."""
        if writes and key is not None and value is not None:
            if positions is not None and rope is not None:
                torch.ops.vllm_kv.write_kv_rope(q, key, value, self.kv_cache, positions,
                                                rope.cos_sin_cache, rope.is_neox, self._op_key)
            else:
                torch.ops.vllm_kv.write_kv(key, value, self.kv_cache, self._op_key)
        elif positions is not None and rope is not None:
            key = _rotate_reference_without_write(q, key, positions, rope)
        torch.ops.vllm_kv.attention(q, key, value, self.kv_cache, out, self._op_key)
        return out


def _rotate_without_write(q: torch.Tensor, key: torch.Tensor | None, positions: torch.Tensor,
                          rope: RoPE) -> torch.Tensor | None:
    """No cache write (KV sharing, encoder-only): rotate ``q`` in place, ``key`` as a copy."""
    rotated = None if key is None else key.clone()
    apply_rope(q, rotated, positions, rope)
    return rotated


def _rotate_reference_without_write(q: torch.Tensor, key: torch.Tensor | None,
                                    positions: torch.Tensor, rope: RoPE) -> torch.Tensor | None:
    """:func:`_rotate_without_write` in traceable torch ops (the same bytes)."""
    n = positions.shape[0]
    q[:n] = rotate_reference(q[:n], positions, rope)
    return None if key is None else rotate_reference(key, positions, rope)


class MLAAttention(_LayerBase):
    """Multi-head latent attention: writes ``(kv_c_normed, k_pe)`` through the
    backend's :class:`~vllm.attention.MLAKVCacheWriter`, then runs the MLA impl
    (whose metadata and projections ``docs/mla.md`` describes)."""

    def __init__(
        self,
        *,
        spec: AttentionLayerSpec,
        backend: type[AttentionBackend[Any]],
        layer_name: str,
        k_scale: float | torch.Tensor | None = None,
        checked: bool | None = None,
    ) -> None:
        spelled = _cache_dtype_for(backend, spec.kv_cache_dtype)
        if spelled != spec.kv_cache_dtype:
            spec = dataclasses.replace(spec, kv_cache_dtype=spelled)
        super().__init__(backend=backend, spec=spec, layer_name=layer_name,
                         k_scale=k_scale, v_scale=k_scale, checked=checked)
        writer = backend.get_kv_cache_writer(spec.kv_cache_dtype)
        if not isinstance(writer, MLAKVCacheWriter):
            raise InvalidTypeError("writer", writer, "an MLAKVCacheWriter")
        self.kv_cache_writer: MLAKVCacheWriter = writer
        self._fused_rope: FusedRoPEMLAKVCacheWriter | None = (
            writer if isinstance(writer, FusedRoPEMLAKVCacheWriter)
            and writer.supports_fused_rope else None)
        self._op_key = custom_ops.register_layer(self, layer_name)

    def write_latent(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                     ctx: ForwardContext) -> None:
        self._write(kv_c_normed, k_pe, ctx, self.kv_cache)

    def _write(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, ctx: ForwardContext,
               kv_cache: torch.Tensor) -> None:
        slots = self._slots_for_write(ctx)
        self.kv_cache_writer.write(kv_c_normed, k_pe, kv_cache, slots, self.kv_quant)
        if ctx.kv_connector is not None:
            ctx.kv_connector.on_kv_written(self.layer_name, kv_cache, slots)

    def write_latent_with_rope(self, q_pe: torch.Tensor | None, kv_c_normed: torch.Tensor,
                               k_pe: torch.Tensor, positions: torch.Tensor, rope: RoPE,
                               ctx: ForwardContext) -> None:
        """The write path with RoPE: ``q_pe`` ``[N, num_heads, rope_dim]`` (a view of the
        query) rotated in place, ``k_pe`` rotated into the cache (not modified)."""
        self._write_with_rope(q_pe, kv_c_normed, k_pe, positions, rope, ctx, self.kv_cache)

    def _write_with_rope(self, q_pe: torch.Tensor | None, kv_c_normed: torch.Tensor,
                         k_pe: torch.Tensor, positions: torch.Tensor, rope: RoPE,
                         ctx: ForwardContext, kv_cache: torch.Tensor) -> None:
        slots = self._slots_for_write(ctx)
        self._checked_positions(positions, rope)
        fused = self._fused_rope
        if fused is not None:
            fused.write_with_rope(q_pe, kv_c_normed, k_pe, kv_cache, slots, self.kv_quant,
                                  positions, rope)
        else:
            rotated = k_pe.reshape(k_pe.shape[0], 1, k_pe.shape[-1]).clone()
            apply_rope(q_pe, rotated, positions, rope)
            self.kv_cache_writer.write(kv_c_normed, rotated, kv_cache, slots, self.kv_quant)
        if ctx.kv_connector is not None:
            ctx.kv_connector.on_kv_written(self.layer_name, kv_cache, slots)

    def _q_pe(self, q: torch.Tensor) -> torch.Tensor:
        return q[..., q.shape[-1] - self._rope_dim():]

    def _rope_dim(self) -> int:
        from vllm.attention.backends.mla.common import MLALayerSpec

        spec = self.spec
        if not isinstance(spec, MLALayerSpec):
            raise InvalidTypeError("spec", type(spec).__name__, "an MLALayerSpec")
        return spec.qk_rope_head_dim

    def write_for_op(self, key: torch.Tensor, value: torch.Tensor,
                     kv_cache: torch.Tensor) -> None:
        """``vllm_kv::write_kv``'s body (``key`` is ``kv_c_normed``, ``value`` ``k_pe``)."""
        self._write(key, value, get_forward_context(), kv_cache)

    def write_rope_for_op(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          kv_cache: torch.Tensor, positions: torch.Tensor,
                          cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
        """``vllm_kv::write_kv_rope``'s body: ``query`` is the full ``[T, N, P + R]`` query,
        whose rope part is rotated in place."""
        rope = RoPE(cos_sin_cache, "neox" if is_neox else "gptj")
        self._write_with_rope(self._q_pe(query), key, value, positions, rope,
                              get_forward_context(), kv_cache)

    def forward(
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        output: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
        rope: RoPE | None = None,
    ) -> torch.Tensor:
        """Write this step's latent rows, then attend.

        Args:
            q: ``[T, num_heads, qk_nope_head_dim + qk_rope_head_dim]`` (or flattened).
            kv_c_normed: ``[T, kv_lora_rank]``; k_pe: ``[T, rope_dim]`` (or ``[T, 1, R]``).
            output: ``[T, num_heads * v_head_dim]``, allocated when None.
            positions, rope: rotate the query's rope part (in place) and ``k_pe`` (into
                the cache; ``k_pe`` itself is not modified), fused where the writer can.
        Returns:
            ``output``.
        """
        from vllm.attention.backends.mla.common import MLALayerSpec

        spec = self.spec
        if not isinstance(spec, MLALayerSpec):
            raise InvalidTypeError("spec", type(spec).__name__, "an MLALayerSpec")
        compiling = torch.compiler.is_compiling()
        found = None if compiling else self._context_and_metadata()
        _check_rope_pair(positions, rope)
        if q.dim() == 2:
            q = q.view(q.shape[0], spec.num_heads, spec.qk_head_dim)
        out = output
        if out is None:
            out = torch.empty(q.shape[0], spec.num_heads * spec.v_head_dim, dtype=q.dtype,
                              device=q.device)
        if found is None:
            if self.writes_kv_cache:
                if positions is not None and rope is not None:
                    torch.ops.vllm_kv.write_kv_rope(q, kv_c_normed, k_pe, self.kv_cache,
                                                    positions, rope.cos_sin_cache, rope.is_neox,
                                                    self._op_key)
                else:
                    torch.ops.vllm_kv.write_kv(kv_c_normed, k_pe, self.kv_cache, self._op_key)
            elif positions is not None and rope is not None:
                q_pe = self._q_pe(q)
                n = positions.shape[0]
                q_pe[:n] = rotate_reference(q_pe[:n], positions, rope)
            torch.ops.vllm_kv.attention(q, kv_c_normed, k_pe, self.kv_cache, out, self._op_key)
            return out
        ctx, meta = found
        if self.writes_kv_cache:
            if positions is not None and rope is not None:
                self.write_latent_with_rope(self._q_pe(q), kv_c_normed, k_pe, positions, rope,
                                            ctx)
            else:
                self.write_latent(kv_c_normed, k_pe, ctx)
        elif positions is not None and rope is not None:
            apply_rope(self._q_pe(q), None, positions, rope)
        return self.impl.forward(self, q, kv_c_normed, k_pe, self.kv_cache, meta, out)
