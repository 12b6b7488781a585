"""The write and the attention as ``torch.library`` custom ops (namespace ``vllm_kv``).

Under ``torch.compile`` the layers call these ops instead of running the writer
and the impl inline, so a decoder layer traces into one graph whatever the
backend: each op is one opaque node whose fake (meta) implementation only says
what it mutates, and its real implementation reads the step's slot mapping and
metadata from the ForwardContext at run time (Dynamo cannot trace a
``ContextVar``). Eager calls do not go through the ops (the dispatcher would add
several microseconds per call); both routes run the same writer and impl code.

Ops (``layer`` is the key :func:`register_layer` returned for the calling layer):

* ``vllm_kv::write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, str layer) -> ()``
  writes this step's rows (MLA: ``kv_c_normed``, ``k_pe``) into ``kv_cache``.
* ``vllm_kv::write_kv_rope(Tensor(a!) query, Tensor key, Tensor value,
  Tensor(b!) kv_cache, Tensor positions, Tensor cos_sin_cache, bool is_neox,
  str layer) -> ()`` rotates ``query`` in place and writes the rotated keys (MLA:
  the query's rope part and ``k_pe``).
* ``vllm_kv::attention(Tensor query, Tensor? key, Tensor? value, Tensor kv_cache,
  Tensor(a!) output, str layer) -> ()`` fills ``output``; reads ``kv_cache``, which
  orders it after the write in a functionalised graph.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Final, Protocol

import torch

from vllm.attention.errors import InvalidArgumentError

NAMESPACE: Final = "vllm_kv"


class OpLayer(Protocol):
    """What a layer provides to the ops (both :class:`~vllm.attention.layer.Attention`
    and :class:`~vllm.attention.layer.MLAAttention` do)."""

    def write_for_op(self, key: torch.Tensor, value: torch.Tensor,
                     kv_cache: torch.Tensor) -> None: ...

    def write_rope_for_op(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          kv_cache: torch.Tensor, positions: torch.Tensor,
                          cos_sin_cache: torch.Tensor, is_neox: bool) -> None: ...

    def attend_for_op(self, query: torch.Tensor, key: torch.Tensor | None,
                      value: torch.Tensor | None, kv_cache: torch.Tensor,
                      output: torch.Tensor) -> None: ...


_LAYERS: weakref.WeakValueDictionary[str, OpLayer] = weakref.WeakValueDictionary()
_COUNTER = itertools.count()
_LOCK = threading.Lock()


def register_layer(layer: OpLayer, layer_name: str) -> str:
    """A key naming ``layer`` in op calls (unique per live layer; held weakly)."""
    with _LOCK:
        key = f"{layer_name}#{next(_COUNTER)}"
        _LAYERS[key] = layer
    return key


def layer_for(key: str) -> OpLayer:
    """The live layer registered under ``key``."""
    layer = _LAYERS.get(key)
    if layer is None:
        raise InvalidArgumentError("layer", key, "the key of a live Attention / MLAAttention "
                                   "layer (vllm.attention.ops.custom_ops.register_layer)")
    return layer


@torch.library.custom_op(
    f"{NAMESPACE}::write_kv", mutates_args=("kv_cache",),
    schema="(Tensor key, Tensor value, Tensor(a!) kv_cache, str layer) -> ()",
)
def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             layer: str) -> None:
    """Write this step's K/V (MLA: latent, rope) rows of ``layer`` into ``kv_cache``."""
    layer_for(layer).write_for_op(key, value, kv_cache)


@write_kv.register_fake
def _write_kv_fake(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   layer: str) -> None:
    return None


@torch.library.custom_op(
    f"{NAMESPACE}::write_kv_rope", mutates_args=("query", "kv_cache"),
    schema="(Tensor(a!) query, Tensor key, Tensor value, Tensor(b!) kv_cache, "
           "Tensor positions, Tensor cos_sin_cache, bool is_neox, str layer) -> ()",
)
def write_kv_rope(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  kv_cache: torch.Tensor, positions: torch.Tensor,
                  cos_sin_cache: torch.Tensor, is_neox: bool, layer: str) -> None:
    """Rotate ``query`` in place and write the rotated keys (fused where the writer can)."""
    layer_for(layer).write_rope_for_op(query, key, value, kv_cache, positions, cos_sin_cache,
                                       is_neox)


@write_kv_rope.register_fake
def _write_kv_rope_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        kv_cache: torch.Tensor, positions: torch.Tensor,
                        cos_sin_cache: torch.Tensor, is_neox: bool, layer: str) -> None:
    return None


@torch.library.custom_op(
    f"{NAMESPACE}::attention", mutates_args=("output",),
    schema="(Tensor query, Tensor? key, Tensor? value, Tensor kv_cache, Tensor(a!) output, "
           "str layer) -> ()",
)
def attention(query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
              kv_cache: torch.Tensor, output: torch.Tensor, layer: str) -> None:
    """``layer``'s compute over ``kv_cache`` into ``output`` (the cache is only read)."""
    layer_for(layer).attend_for_op(query, key, value, kv_cache, output)


@attention.register_fake
def _attention_fake(query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                    kv_cache: torch.Tensor, output: torch.Tensor, layer: str) -> None:
    return None


__all__ = [
    "NAMESPACE",
    "OpLayer",
    "attention",
    "layer_for",
    "register_layer",
    "write_kv",
    "write_kv_rope",
]
