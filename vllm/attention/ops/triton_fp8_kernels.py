"""fp8 cache bytes widened exactly inside Triton kernels (imported on first use, by
the MLA kernel modules through :func:`~vllm.attention.ops.triton_loader.load_kernel_module`,
so that an interpreted kernel calls the interpreted helper)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import triton
import triton.language as tl

jit: Callable[[Callable[..., Any]], Any] = triton.jit
"""``triton.jit`` with a type, so mypy accepts the decorated kernels (as ``Any``)."""


@jit
def widen_fp8(raw: tl.tensor, E5M2: tl.constexpr, HW_FP8: tl.constexpr) -> tl.tensor:
    """fp8 bytes (``uint8``) as float16, which holds every E4M3 and E5M2 value exactly.

    E5M2 is the upper byte of a float16. E4M3 goes through Triton's conversion where
    the GPU has one (``HW_FP8``: sm_89+); elsewhere its sign, exponent and mantissa are
    placed in a float16, whose exponent bias (15, not 7) makes it 2**8 too small,
    subnormals included, and the all-ones magnitude (E4M3's only NaN) becomes NaN.
    """
    b = raw.to(tl.uint16)
    if E5M2:
        return (b << 8).to(tl.float16, bitcast=True)
    if HW_FP8:
        return raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    h = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), h * 256.0)
