"""``vllm.model_executor.layers.attention.Attention``: the layer a legacy impl is called
with.

Upstream's impls read scales and names off the layer (``layer._k_scale``,
``layer._k_scale_float``, ``layer.layer_name``...). The adapter hands a legacy impl this
view of the new :class:`vllm.attention.Attention` layer instead of the layer itself: the
scales are upstream's 0-d float32 tensors (views of the layer's own ``[1]`` scales, so
they follow it), there is no query or probability scale (``1.0``), and every other
attribute is the layer's. Models build layers with :class:`vllm.attention.Attention`;
this class is not constructed by hand.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from vllm.attention.backend import AttentionLayerSpec
from vllm.attention.errors import LegacyBackendError
from vllm.attention.types import KVQuant, host_scale

__all__ = ["Attention"]


class _NewLayer(Protocol):
    @property
    def layer_name(self) -> str: ...

    @property
    def kv_quant(self) -> KVQuant: ...

    spec: AttentionLayerSpec
    kv_cache: torch.Tensor


def _as_upstream_scale(scale: torch.Tensor) -> torch.Tensor:
    """vLLM's per-tensor scale is 0-d; a per-head one stays ``[num_kv_heads]``."""
    return scale.view(()) if scale.numel() == 1 else scale


class Attention:
    """A legacy impl's view of one :class:`vllm.attention.Attention` layer."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise LegacyBackendError(
            "vllm.model_executor.layers.attention.Attention(...): here this is the view of a "
            "layer that the adapter hands to legacy impls, not a layer to build; build "
            "layers with vllm.attention.Attention (see migration_guide.md)")

    @classmethod
    def view(cls, layer: _NewLayer, impl: Any, attn_backend: type,
             kv_cache_dtype: str) -> Attention:
        """The view of ``layer`` for the legacy ``impl`` of ``attn_backend``."""
        self = cls.__new__(cls)
        self._bind(layer, impl, attn_backend, kv_cache_dtype)
        return self

    def _bind(self, layer: _NewLayer, impl: Any, attn_backend: type,
              kv_cache_dtype: str) -> None:
        spec = layer.spec
        self.layer = layer
        self.impl = impl
        self.attn_backend = attn_backend
        self.layer_name = layer.layer_name
        self.num_heads = spec.num_heads
        self.head_size = spec.head_size
        self.head_size_v = spec.v_head_size
        self.num_kv_heads = spec.num_kv_heads
        self.sliding_window = spec.sliding_window
        self.attn_type = spec.attn_type
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = spec.kv_sharing_target_layer_name
        self.use_output = bool(getattr(attn_backend, "accept_output_buffer", False))
        self._ones: torch.Tensor | None = None

    def get_attn_backend(self) -> type:
        return self.attn_backend

    @property
    def kv_cache(self) -> list[torch.Tensor]:
        """One cache per virtual engine, as upstream keeps them (there is one)."""
        return [self.layer.kv_cache]

    @property
    def _k_scale(self) -> torch.Tensor:
        return _as_upstream_scale(self.layer.kv_quant.k_scale)

    @property
    def _v_scale(self) -> torch.Tensor:
        return _as_upstream_scale(self.layer.kv_quant.v_scale)

    @property
    def _k_scale_cpu(self) -> torch.Tensor:
        return self._k_scale.cpu()

    @property
    def _v_scale_cpu(self) -> torch.Tensor:
        return self._v_scale.cpu()

    @property
    def _q_scale(self) -> torch.Tensor:
        return self._unit()

    @property
    def _prob_scale(self) -> torch.Tensor:
        return self._unit()

    @property
    def _q_scale_float(self) -> float:
        return 1.0

    @property
    def _k_scale_float(self) -> float:
        return self._float("k", self.layer.kv_quant.k_scale)

    @property
    def _v_scale_float(self) -> float:
        return self._float("v", self.layer.kv_quant.v_scale)

    def _unit(self) -> torch.Tensor:
        device = self.layer.kv_quant.k_scale.device
        if self._ones is None or self._ones.device != device:
            self._ones = torch.ones((), dtype=torch.float32, device=device)
        return self._ones

    def _float(self, which: str, scale: torch.Tensor) -> float:
        """Read once per version of the scale tensor (upstream sets these floats once, at
        load)."""
        if scale.numel() != 1:
            raise LegacyBackendError(
                f"layer._{which}_scale_float of {self.layer_name!r}: the layer has "
                f"per-head scales ({scale.numel()}), which have no single float")
        return host_scale(scale)

    def __getattr__(self, name: str) -> Any:
        if name == "layer":  # not yet set: __init__ failed
            raise AttributeError(name)
        return getattr(self.layer, name)
