"""Reference quantisation shared by every writer and every compute path's dequant.

fp8: ``stored = to_fp8(clamp(float32(x) / scale, -fp8_max, fp8_max))``, round to
nearest even, NaN stays NaN (always stored as the byte ``0x7F``, whatever the
input NaN's sign or payload). The Triton kernels reproduce this bit for bit.
"""

from __future__ import annotations

from typing import Final

import torch

from vllm.attention.types import KVCacheDType

FP8_NAN_BYTE: Final = 0x7F
"""The one NaN every writer stores, in E4M3 and E5M2 alike (positive, all bits set)."""

FP8_DTYPES: Final[dict[str, torch.dtype]] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


_BITS: Final[dict[int, torch.dtype]] = {1: torch.uint8, 2: torch.int16, 4: torch.int32,
                                        8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as same-size integers (strides unchanged). Reference writes and
    reads index through this: not every device's index kernels take fp8."""
    return t.view(_BITS[t.element_size()])


def fp8_dtype_of(cache_dtype: KVCacheDType) -> torch.dtype:
    return FP8_DTYPES[cache_dtype]


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def head_scale(scale: torch.Tensor) -> torch.Tensor:
    """``[1]`` or ``[H]`` scale as ``[1, H_or_1, 1]`` for rows ``[T, H, D]``."""
    return scale.view(1, -1, 1)


def to_fp8(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``y`` to ``dtype`` (E4M3 / E5M2), saturating, round to nearest even,
    NaN stored as :data:`FP8_NAN_BYTE`."""
    m = fp8_max(dtype)
    q = y.clamp(-m, m).to(dtype).view(torch.uint8)
    # torch keeps the NaN's sign bit (0xFF); one canonical byte keeps reference
    # and kernels byte-identical. (uint8 because not every device op takes fp8.)
    return q.masked_fill(y.isnan(), FP8_NAN_BYTE).view(dtype)


def canonical_nan(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` with every NaN replaced by the positive quiet NaN ``0x7FC00000``
    (torch reductions may produce other NaN bit patterns; stored scales must not)."""
    return x.masked_fill(x.isnan(), float("nan"))


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x``: ``[T, H, D]`` any float dtype; ``scale``: ``[1]`` or ``[H]`` float32."""
    return to_fp8(x.to(torch.float32) / head_scale(scale), dtype)


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
