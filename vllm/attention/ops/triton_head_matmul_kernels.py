"""Triton kernel of :mod:`vllm.attention.ops.head_matmul`: one small matrix product a
head, ``C[t, n, :] = A[t, n, :] @ W[n]``.

A program computes one ``BLOCK_T x BLOCK_C`` tile of one head's product, stepping
over ``K`` (a constant: a layer's weights fix it) in ``BLOCK_K`` slices with float32
accumulation. Any strides: the query
slice ``q[..., :P]`` and the rows of a layer's output are read and written where
they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import triton
import triton.language as tl

jit: Callable[[Callable[..., Any]], Any] = triton.jit
"""``triton.jit`` with a type, so mypy accepts the decorated kernel (as ``Any``)."""


@jit
def head_matmul_kernel(
    a_ptr: tl.tensor, w_ptr: tl.tensor, c_ptr: tl.tensor,
    T: tl.tensor,
    s_at: tl.tensor, s_an: tl.tensor, s_ak: tl.tensor,
    s_wn: tl.tensor, s_wk: tl.tensor, s_wc: tl.tensor,
    s_ct: tl.tensor, s_cn: tl.tensor, s_cc: tl.tensor,
    K: tl.constexpr, C: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_C: tl.constexpr,
) -> None:
    n = tl.program_id(0).to(tl.int64)
    pc = tl.program_id(1)
    pt = tl.program_id(2)
    rt = pt * BLOCK_T + tl.arange(0, BLOCK_T)
    rc = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    rk = tl.arange(0, BLOCK_K)
    t_ok = rt < T
    c_ok = rc < C
    a = a_ptr + n * s_an + rt.to(tl.int64)[:, None] * s_at + rk[None, :] * s_ak
    w = w_ptr + n * s_wn + rk[:, None] * s_wk + rc[None, :] * s_wc
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a_tile = tl.load(a, mask=t_ok[:, None], other=0.0)
            if EVEN_C:
                w_tile = tl.load(w)
            else:
                w_tile = tl.load(w, mask=c_ok[None, :], other=0.0)
        else:
            k_ok = k0 + rk < K
            a_tile = tl.load(a, mask=t_ok[:, None] & k_ok[None, :], other=0.0)
            w_tile = tl.load(w, mask=k_ok[:, None] & c_ok[None, :], other=0.0)
        acc = tl.dot(a_tile, w_tile, acc)
        a += BLOCK_K * s_ak
        w += BLOCK_K * s_wk
    c = c_ptr + n * s_cn + rt.to(tl.int64)[:, None] * s_ct + rc[None, :] * s_cc
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])
