"""Per-step state that layers read while a model runs.

The forward context is the only carrier of ``slot_mapping``: metadata classes
never hold it, and only the write path in :mod:`vllm.attention.layer` reads it.
It lives in a :class:`contextvars.ContextVar`, so threads and asyncio tasks each
see their own.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

import torch

from vllm.attention.errors import ForwardContextError, InvalidArgumentError, InvalidTypeError

if TYPE_CHECKING:
    from vllm.attention.backend import AttentionMetadata


class KVConnector(Protocol):
    """Sees every layer's cache right after its write (offload, transfer, ...)."""

    def on_kv_written(
        self, layer_name: str, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None: ...


@dataclass(frozen=True)
class ForwardContext:
    """What one model step's layers read.

    ``attn_metadata`` and ``slot_mapping`` are keyed by layer name; layers of one
    KV-cache group share one metadata object and one int64 ``[num_tokens]`` tensor.
    """

    attn_metadata: Mapping[str, AttentionMetadata]
    slot_mapping: Mapping[str, torch.Tensor]
    num_tokens: int | None = None
    kv_connector: KVConnector | None = None
    extras: Mapping[str, object] = field(default_factory=dict)

    def slot_mapping_for(self, layer_name: str) -> torch.Tensor:
        """The layer's slot mapping, or a :class:`ForwardContextError` naming what is there."""
        try:
            return self.slot_mapping[layer_name]
        except KeyError:
            raise ForwardContextError(
                f"slot_mapping has no entry for layer {layer_name!r}; "
                f"layers present: {sorted(self.slot_mapping)}"
            ) from None

    def attn_metadata_for(self, layer_name: str) -> AttentionMetadata:
        """The layer's metadata, or a :class:`ForwardContextError` naming what is there."""
        try:
            return self.attn_metadata[layer_name]
        except KeyError:
            raise ForwardContextError(
                f"attn_metadata has no entry for layer {layer_name!r}; "
                f"layers present: {sorted(self.attn_metadata)}"
            ) from None


_CURRENT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "vllm_forward_context", default=None
)


def _check_slot_mappings(slot_mapping: Mapping[str, torch.Tensor]) -> None:
    for name, slots in slot_mapping.items():
        if not isinstance(slots, torch.Tensor):
            raise InvalidTypeError(
                f"slot_mapping[{name!r}]", type(slots).__name__, "a torch.Tensor"
            )
        if slots.dtype != torch.int64:
            raise InvalidArgumentError(
                f"slot_mapping[{name!r}].dtype", slots.dtype, "torch.int64"
            )
        if slots.dim() != 1:
            raise InvalidArgumentError(
                f"slot_mapping[{name!r}].shape", tuple(slots.shape), "[num_tokens]"
            )


@contextlib.contextmanager
def set_forward_context(
    *,
    attn_metadata: Mapping[str, AttentionMetadata],
    slot_mapping: Mapping[str, torch.Tensor],
    num_tokens: int | None = None,
    kv_connector: KVConnector | None = None,
    extras: Mapping[str, object] | None = None,
) -> Iterator[ForwardContext]:
    """Make a :class:`ForwardContext` current for the ``with`` block.

    Args:
        attn_metadata: layer name -> that layer's backend metadata.
        slot_mapping: layer name -> int64 ``[num_tokens]`` slots (-1 = skip).
        num_tokens: tokens in this step, padding included (informational).
        kv_connector: called after each layer's write.
        extras: anything else a model wants to pass down (read-only).

    The previous context (or none) is restored on exit, also after an exception.
    """
    _check_slot_mappings(slot_mapping)
    ctx = ForwardContext(
        attn_metadata=MappingProxyType(dict(attn_metadata)),
        slot_mapping=MappingProxyType(dict(slot_mapping)),
        num_tokens=num_tokens,
        kv_connector=kv_connector,
        extras=MappingProxyType(dict(extras or {})),
    )
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def get_forward_context() -> ForwardContext:
    """The current context; raises :class:`ForwardContextError` outside one."""
    ctx = _CURRENT.get()
    if ctx is None:
        raise ForwardContextError(
            "get_forward_context() was called outside a forward context; "
            "wrap the model call in `with set_forward_context(attn_metadata=..., "
            "slot_mapping=...)`"
        )
    return ctx


def is_forward_context_available() -> bool:
    """True inside ``set_forward_context``."""
    return _CURRENT.get() is not None
