"""A one-line Triton kernel around the writers' ``_reciprocal`` for the GPU test
(imported only where CUDA and Triton are: it binds the compiled kernels module)."""

from __future__ import annotations

import triton
import triton.language as tl

from vllm.attention.writers.kernels import load_kernels

_reciprocal = load_kernels(interpret=False)._reciprocal


@triton.jit
def reciprocal_kernel(s_ptr, r_ptr, n, FAST: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    s = tl.load(s_ptr + i, mask=m, other=1.0)
    tl.store(r_ptr + i, _reciprocal(s, FAST), mask=m)
