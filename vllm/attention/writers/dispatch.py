"""Which implementation a writer runs: the Triton kernel or the torch reference.

CUDA tensors with Triton importable run the kernel; everything else the torch
reference. ``VLLM_KV_WRITER_PATH=torch`` (or ``triton``) overrides the default,
and every writer's ``write(..., path=...)`` overrides both (``path="triton"`` on
CPU tensors runs the kernels under Triton's interpreter: slow, for tests).
"""

from __future__ import annotations

import os
from typing import ClassVar, Literal, get_args

import torch

from vllm.attention.errors import KVCacheWriteError
from vllm.attention.types import KVCacheDType, KVCacheLayout
from vllm.attention.writers.kernels import triton_importable

WritePath = Literal["torch", "triton"]
"""The implementation of a write: ``"triton"`` kernel or ``"torch"`` reference."""

WRITE_PATHS: tuple[WritePath, ...] = get_args(WritePath)


def default_path(device: torch.device) -> WritePath:
    """``"triton"`` for CUDA with Triton importable, else ``"torch"`` (env override first)."""
    forced = os.environ.get("VLLM_KV_WRITER_PATH", "").strip().lower()
    if forced == "torch":
        return "torch"
    if forced == "triton" and triton_importable():
        return "triton"
    if device.type == "cuda" and triton_importable():
        return "triton"
    return "torch"


def resolve_path(device: torch.device, path: WritePath | None) -> WritePath:
    """``path`` if given (checked), else :func:`default_path`."""
    if path is None:
        return default_path(device)
    if path not in WRITE_PATHS:
        raise KVCacheWriteError("path", path, "'torch', 'triton' or None")
    if path == "triton" and not triton_importable():
        raise KVCacheWriteError("path", path, "'torch' or None: triton is not importable here")
    return path


class WriterBase:
    """What every writer reports besides ``write``: its layout, the cache dtypes it
    accepts and which implementation it would run on a device."""

    layout: KVCacheLayout
    cache_dtypes: tuple[KVCacheDType, ...]
    supports_fused_rope: ClassVar[bool] = False
    """True where ``write_with_rope`` exists (:class:`~vllm.attention.FusedRoPEKVCacheWriter`)."""

    def path(self, device: torch.device | str) -> WritePath:
        """``"triton"`` or ``"torch"``: what ``write`` runs for a cache on ``device``."""
        return default_path(torch.device(device))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.layout.value})"
