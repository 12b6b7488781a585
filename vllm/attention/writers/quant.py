"""Reference quantisation shared by every writer and every compute path's dequant.

fp8: ``stored = to_fp8(clamp(float32(x) / scale, -fp8_max, fp8_max))``, round to
nearest even, NaN stays NaN. The Triton kernels reproduce this bit for bit.
"""

from __future__ import annotations

from typing import Final

import torch

from vllm.attention.types import KVCacheDType

FP8_DTYPES: Final[dict[str, torch.dtype]] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def fp8_dtype_of(cache_dtype: KVCacheDType) -> torch.dtype:
    return FP8_DTYPES[cache_dtype]


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def head_scale(scale: torch.Tensor) -> torch.Tensor:
    """``[1]`` or ``[H]`` scale as ``[1, H_or_1, 1]`` for rows ``[T, H, D]``."""
    return scale.view(1, -1, 1)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x``: ``[T, H, D]`` any float dtype; ``scale``: ``[1]`` or ``[H]`` float32."""
    m = fp8_max(dtype)
    return (x.to(torch.float32) / head_scale(scale)).clamp(-m, m).to(dtype)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8` up to rounding: ``[T, H, D]`` in ``out_dtype``."""
    return (x.to(torch.float32) * head_scale(scale)).to(out_dtype)


def store_values(x: torch.Tensor, cache_dtype: KVCacheDType, scale: torch.Tensor,
                 storage: torch.dtype) -> torch.Tensor:
    """Rows ``[T, H, D]`` as the cache stores them (``auto``: a cast to the cache dtype)."""
    if cache_dtype in FP8_DTYPES:
        return quantize_fp8(x, scale, storage)
    return x.to(storage)


def load_values(x: torch.Tensor, cache_dtype: KVCacheDType, scale: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """Cache rows ``[..., H, D]`` back as ``out_dtype`` (compute paths' dequant)."""
    if cache_dtype in FP8_DTYPES:
        return (x.to(torch.float32) * scale.view(*([1] * (x.dim() - 2)), -1, 1)).to(out_dtype)
    return x.to(out_dtype)
