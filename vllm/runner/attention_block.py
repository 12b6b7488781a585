"""What a decoder layer's attention looks like to the model: the projections around
one attention layer (:class:`AttentionBlock`), and the head size a backend's cache is
allocated with. Llama (``model.py``) and MLA (``mla.py``) blocks both build on it."""

from __future__ import annotations

import abc
from typing import Any

import torch
from torch import nn

from vllm.attention.backend import AttentionBackend
from vllm.attention.layer import Attention, MLAAttention
from vllm.attention.types import KVCacheLayout

AttentionLayer = Attention | MLAAttention
"""The attention layer modules the runner binds caches to."""

AttnInputs = tuple[torch.Tensor, ...]
"""What a layer's attention call takes (``q, k, v`` or ``q, kv_c_normed, k_pe``)."""


def cache_head_size(backend: type[AttentionBackend[Any]], head_size: int, v_head_size: int) -> int:
    """The ``head_size`` a backend's cache is allocated (and checked) with: ``Dk + Dv``
    for the packed DiffKV layout, else the layer's head size."""
    if backend.kv_cache_layout is KVCacheLayout.DIFFKV_PACKED:
        return head_size + v_head_size
    return head_size


class AttentionBlock(nn.Module, abc.ABC):
    """Projections around one attention layer. ``project`` and ``finish`` are pure
    tensor code (graph-capturable); ``attend`` runs the attention layer (write, then
    compute) and is always eager."""

    @abc.abstractmethod
    def project(self, h: torch.Tensor, positions: torch.Tensor) -> AttnInputs: ...

    @abc.abstractmethod
    def attend(self, inputs: AttnInputs, output: torch.Tensor) -> torch.Tensor:
        """Fill and return ``output`` (see :meth:`output_shape`)."""

    @abc.abstractmethod
    def output_shape(self, num_tokens: int) -> tuple[int, ...]: ...

    @abc.abstractmethod
    def finish(self, attn_out: torch.Tensor) -> torch.Tensor:
        """The output projection (all-reduced over ranks)."""

    @property
    @abc.abstractmethod
    def layer(self) -> AttentionLayer:
        """The attention layer (its cache, backend and spec)."""

    def finalize(self, backend: type[AttentionBackend[Any]], kv_cache_dtype: str) -> None:
        """Called once the weights are in place (MLA needs them to build its layer)."""
