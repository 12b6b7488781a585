"""Tensor-core Triton kernels of the dense MLA decode (imported on first use).

All query heads of one token share each latent row, so a program takes a tile of
``BLOCK_H`` heads as the M dimension of two matrix products per block of
``BLOCK_N`` cached rows: ``S = Q @ K^T`` over the ``L + R`` columns and
``O += P @ K[:, :L]`` (the values are the latent part of the same rows), with an
online softmax in float32 between them. The latent is handled in ``LAT_CHUNKS``
column chunks of ``LC`` (one TMA box is at most 256 wide). The launcher is
:mod:`vllm.attention.ops.triton_mla_decode`; ``docs/mla.md`` explains the choices.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import triton
import triton.language as tl

from vllm.attention.ops.triton_loader import load_kernel_module

jit: Callable[[Callable[..., Any]], Any] = triton.jit
"""``triton.jit`` with a type, so mypy accepts the decorated kernels (as ``Any``)."""

# the helper module in this module's mode: the loader imports an interpreted copy of
# this file with TRITON_INTERPRET=1 set
widen_fp8: Any = load_kernel_module(
    "vllm.attention.ops.triton_fp8_kernels",
    interpret=os.environ.get("TRITON_INTERPRET", "0") == "1").widen_fp8

# softmax in base 2: exp2 is one instruction, exp is a multiply and an exp2
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@jit
def _load_tile(
    LAT_DESC: tl.tensor_descriptor, PE_DESC: tl.tensor_descriptor, C: tl.tensor,
    BT: tl.tensor, req: tl.tensor, n0: tl.tensor, end: tl.tensor, col_a: tl.tensor,
    col_b: tl.tensor, stride_cb: tl.tensor, stride_cs: tl.tensor, stride_bt: tl.tensor,
    KV_LORA: tl.constexpr, ROPE: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr,
    HW_FP8: tl.constexpr, DOT: tl.constexpr, FULL: tl.constexpr, USE_TMA: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr, LAT_CHUNKS: tl.constexpr, LC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
) -> tl.tensor:  # (k_a [BLOCK_N, LC], k_b [BLOCK_N, LC], k_pe [BLOCK_N, BLOCK_R])
    """Rows ``n0 .. n0 + BLOCK_N`` of the request in the dot dtype: the latent
    columns from ``col_a`` and ``col_b`` (``k_b`` is ``k_a`` when ``LAT_CHUNKS == 1``)
    and the rope part. ``FULL``: every row is below ``end``; otherwise rows at or past
    ``end`` load as zeros (their bytes may be anything, NaN too, and a zero
    probability times NaN is NaN)."""
    if FULL and USE_TMA:
        # one page (BLOCK_N divides PAGE, tiles start at multiples of BLOCK_N); the
        # descriptors see the cache as [nb * PAGE, L + R]
        blk = tl.load(BT + req * stride_bt + n0 // PAGE)
        row = blk * PAGE + n0 % PAGE
        k_a = LAT_DESC.load([row, col_a])
        k_b = k_a
        if LAT_CHUNKS == 2:
            k_b = LAT_DESC.load([row, col_b])
        k_pe = PE_DESC.load([row, KV_LORA])
    else:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        offs_c = tl.arange(0, LC)
        offs_r = tl.arange(0, BLOCK_R)
        if TILE_IN_PAGE:
            blk = tl.load(BT + req * stride_bt + n0 // PAGE).to(tl.int64)
            base = C + blk * stride_cb + (n0 % PAGE).to(tl.int64) * stride_cs
            rows = base + tl.arange(0, BLOCK_N)[:, None] * stride_cs
        else:
            kpos = tl.where(valid, offs_n, 0)
            blk = tl.load(BT + req * stride_bt + kpos // PAGE, mask=valid, other=0)
            rows = C + (blk.to(tl.int64) * stride_cb
                        + (kpos % PAGE).to(tl.int64) * stride_cs)[:, None]
        k_a = tl.load(rows + col_a + offs_c[None, :],
                      mask=valid[:, None] & (col_a + offs_c < KV_LORA)[None, :], other=0)
        k_b = k_a
        if LAT_CHUNKS == 2:
            k_b = tl.load(rows + col_b + offs_c[None, :],
                          mask=valid[:, None] & (col_b + offs_c < KV_LORA)[None, :], other=0)
        k_pe = tl.load(rows + KV_LORA + offs_r[None, :],
                       mask=valid[:, None] & (offs_r < ROPE)[None, :], other=0)
    if FP8 != 0:
        # exact in float16 (and so in bfloat16); the dots run on the stored values
        k_a = widen_fp8(k_a, FP8 == 2, HW_FP8)
        k_b = widen_fp8(k_b, FP8 == 2, HW_FP8)
        k_pe = widen_fp8(k_pe, FP8 == 2, HW_FP8)
    return k_a.to(DOT), k_b.to(DOT), k_pe.to(DOT)


@jit
def split_range(n_keys: tl.tensor, num_splits: tl.tensor, sp: tl.tensor,
                BLOCK_N: tl.constexpr) -> tl.tensor:  # (start, end)
    """Keys ``start .. end`` of split ``sp`` of a token that sees ``n_keys``: equal
    ranges, each a multiple of ``BLOCK_N`` so a tile never straddles two pages (the
    last may be shorter). A split past the keys is empty (``end == start``), never
    negative: a whole-tile count must not round a negative length down. Shared with
    the Gluon kernel."""
    per_split = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
    start = sp * per_split
    end = tl.maximum(tl.minimum(start + per_split, n_keys), start)
    return start, end


@jit
def row_powers(amax: tl.tensor, TOP: tl.constexpr) -> tl.tensor:  # (down, up)
    """For rows whose largest magnitude is ``amax`` (float32, ``[M]``): ``down = 2**-e``,
    which puts that magnitude in ``[2**TOP, 2**(TOP + 1))``, and ``up = 2**e``.
    ``floor(log2)`` comes from the exponent bits; ``e`` is clamped so that both are
    normal float32 numbers (a zero row, padding, gets ``2**100`` and stays zero)."""
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - TOP
    e = tl.minimum(tl.maximum(e, -100), 100)
    down = ((127 - e) << 23).to(tl.float32, bitcast=True)
    up = ((127 + e) << 23).to(tl.float32, bitcast=True)
    return down, up


@jit
def fp16_row_powers(amax: tl.tensor) -> tl.tensor:  # (down, up)
    """:func:`row_powers` into float16's top binades: ``[2**14, 2**15)``."""
    return row_powers(amax, 14)


@jit
def query_as_fp16(q_a: tl.tensor, q_b: tl.tensor, q_pe: tl.tensor,
                   LAT_CHUNKS: tl.constexpr) -> tl.tensor:  # (q_a, q_b, q_pe, scale)
    """The query rows in float16, each scaled by the power of two ``2**-e`` that puts
    its largest magnitude in ``[2**14, 2**15)``, and ``2**e`` per row (float32) for the
    scores. Exact: a bfloat16 value is a float16 one once its exponent is in range;
    only values below ``2**-28`` of the row's largest lose bits (float16 subnormals).
    Shared with the Gluon kernel (``LAT_CHUNKS`` 1)."""
    amax = tl.max(tl.abs(q_a.to(tl.float32)), 1)
    if LAT_CHUNKS == 2:
        amax = tl.maximum(amax, tl.max(tl.abs(q_b.to(tl.float32)), 1))
    amax = tl.maximum(amax, tl.max(tl.abs(q_pe.to(tl.float32)), 1))
    down, up = fp16_row_powers(amax)
    down = down[:, None]
    q_a = (q_a.to(tl.float32) * down).to(tl.float16)
    if LAT_CHUNKS == 2:
        q_b = (q_b.to(tl.float32) * down).to(tl.float16)
    else:
        q_b = q_a
    q_pe = (q_pe.to(tl.float32) * down).to(tl.float16)
    return q_a, q_b, q_pe, up


@jit
def _attend_tile(
    n0: tl.tensor, end: tl.tensor, m_i: tl.tensor, l_i: tl.tensor, acc_a: tl.tensor,
    acc_b: tl.tensor, q_a: tl.tensor, q_b: tl.tensor, q_pe: tl.tensor, qk_scale: tl.tensor,
    LAT_DESC: tl.tensor_descriptor, PE_DESC: tl.tensor_descriptor, C: tl.tensor,
    BT: tl.tensor, req: tl.tensor, col_a: tl.tensor, col_b: tl.tensor,
    stride_cb: tl.tensor, stride_cs: tl.tensor, stride_bt: tl.tensor,
    KV_LORA: tl.constexpr, ROPE: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr,
    HW_FP8: tl.constexpr, FULL: tl.constexpr, USE_TMA: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr, LAT_CHUNKS: tl.constexpr, V_SPLIT: tl.constexpr,
    SPLIT_SCORES: tl.constexpr, HEADS_N: tl.constexpr, LC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
) -> tl.tensor:  # (m_i, l_i, acc_a, acc_b)
    """Online-softmax update of ``BLOCK_H`` heads by the rows ``n0 .. n0 + BLOCK_N``
    (scores and the running maximum ``m_i`` in base 2, pre-scaled per head)."""
    k_a, k_b, k_pe = _load_tile(
        LAT_DESC, PE_DESC, C, BT, req, n0, end, col_a, col_b, stride_cb, stride_cs,
        stride_bt, KV_LORA, ROPE, PAGE, FP8, HW_FP8, q_a.dtype, FULL, USE_TMA, TILE_IN_PAGE,
        LAT_CHUNKS, LC, BLOCK_N, BLOCK_R)
    if HEADS_N:
        m_i, l_i, acc_a, acc_b = _update_heads_n(
            n0, end, m_i, l_i, acc_a, acc_b, q_a, q_b, q_pe, qk_scale, k_a, k_b, k_pe,
            FULL, LAT_CHUNKS, V_SPLIT, BLOCK_N)
    else:
        m_i, l_i, acc_a, acc_b = _update_heads_m(
            n0, end, m_i, l_i, acc_a, acc_b, q_a, q_b, q_pe, qk_scale, k_a, k_b, k_pe,
            FULL, LAT_CHUNKS, V_SPLIT, SPLIT_SCORES, BLOCK_N)
    return m_i, l_i, acc_a, acc_b


@jit
def _update_heads_m(
    n0: tl.tensor, end: tl.tensor, m_i: tl.tensor, l_i: tl.tensor, acc_a: tl.tensor,
    acc_b: tl.tensor, q_a: tl.tensor, q_b: tl.tensor, q_pe: tl.tensor, qk_scale: tl.tensor,
    k_a: tl.tensor, k_b: tl.tensor, k_pe: tl.tensor, FULL: tl.constexpr,
    LAT_CHUNKS: tl.constexpr, V_SPLIT: tl.constexpr, SPLIT_SCORES: tl.constexpr,
    BLOCK_N: tl.constexpr,
) -> tl.tensor:  # (m_i, l_i, acc_a, acc_b)
    """The heads as the M of both products: ``S = Q @ K^T`` ``[BLOCK_H, BLOCK_N]``,
    ``acc += P @ K`` ``[BLOCK_H, LC]``."""
    if q_a.dtype == tl.float32:
        s = tl.dot(q_a, tl.trans(k_a), input_precision="ieee")
        if LAT_CHUNKS == 2:
            s = tl.dot(q_b, tl.trans(k_b), s, input_precision="ieee")
        s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision="ieee")
        s = s * qk_scale[:, None]
    elif SPLIT_SCORES:
        # each part scaled, then summed: a dot accumulating into another is "chained"
        # (below), and Triton folds dot + x into the accumulator of the dot
        s = tl.dot(q_a, tl.trans(k_a)) * qk_scale[:, None]
        if LAT_CHUNKS == 2:
            s += tl.dot(q_b, tl.trans(k_b)) * qk_scale[:, None]
        s += tl.dot(q_pe, tl.trans(k_pe)) * qk_scale[:, None]
    else:
        s = tl.dot(q_a, tl.trans(k_a))
        if LAT_CHUNKS == 2:
            s = tl.dot(q_b, tl.trans(k_b), s)
        s = tl.dot(q_pe, tl.trans(k_pe), s)
        s = s * qk_scale[:, None]
    if not FULL:
        s = tl.where((n0 + tl.arange(0, BLOCK_N) < end)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # -inf only for a tile with no valid key (the interpreter's extra tiles)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if q_a.dtype == tl.float32:
        acc_a = tl.dot(p, k_a, acc_a * alpha[:, None], input_precision="ieee")
        if LAT_CHUNKS == 2 and V_SPLIT == 1:
            acc_b = tl.dot(p, k_b, acc_b * alpha[:, None], input_precision="ieee")
    else:
        if SPLIT_SCORES:
            # Triton gives a dot whose results reach another dot all warps along M: with
            # 64 heads and 8 warps both warpgroups would compute every score. P and the
            # rescale are made in a branch the compiler cannot drop (a tile below ``end``
            # is always taken), so the scores reach the value dot only through the
            # branch's yield, where that search stops: the score dots split the keys
            # between the warpgroups, and P reaches both through shared memory. (A tile
            # past ``end`` has p == 0 and alpha == 1, or an accumulator still zero.)
            if n0 < end:
                pd = p.to(q_a.dtype)
                acc_a = acc_a * alpha[:, None]
                if LAT_CHUNKS == 2 and V_SPLIT == 1:
                    acc_b = acc_b * alpha[:, None]
            else:
                pd = p.to(q_a.dtype)
        else:
            pd = p.to(q_a.dtype)
            acc_a = acc_a * alpha[:, None]
            if LAT_CHUNKS == 2 and V_SPLIT == 1:
                acc_b = acc_b * alpha[:, None]
        acc_a = tl.dot(pd, k_a, acc_a)
        if LAT_CHUNKS == 2 and V_SPLIT == 1:
            acc_b = tl.dot(pd, k_b, acc_b)
    return m_new, l_i, acc_a, acc_b




@jit
def _update_heads_n(
    n0: tl.tensor, end: tl.tensor, m_i: tl.tensor, l_i: tl.tensor, acc_a: tl.tensor,
    acc_b: tl.tensor, q_a: tl.tensor, q_b: tl.tensor, q_pe: tl.tensor, qk_scale: tl.tensor,
    k_a: tl.tensor, k_b: tl.tensor, k_pe: tl.tensor, FULL: tl.constexpr,
    LAT_CHUNKS: tl.constexpr, V_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
) -> tl.tensor:  # (m_i, l_i, acc_a, acc_b)
    """The heads as the N of both products, for few heads (a warpgroup MMA's M is 64:
    16 heads as M would be three quarters padding): ``S^T = K @ Q^T`` ``[BLOCK_N,
    BLOCK_H]`` (the keys as M) and ``acc^T += K^T @ P^T`` ``[LC, BLOCK_H]`` (the
    latent columns as M)."""
    if q_a.dtype == tl.float32:
        s = tl.dot(k_a, tl.trans(q_a), input_precision="ieee")
        if LAT_CHUNKS == 2:
            s = tl.dot(k_b, tl.trans(q_b), s, input_precision="ieee")
        s = tl.dot(k_pe, tl.trans(q_pe), s, input_precision="ieee")
    else:
        s = tl.dot(k_a, tl.trans(q_a))
        if LAT_CHUNKS == 2:
            s = tl.dot(k_b, tl.trans(q_b), s)
        s = tl.dot(k_pe, tl.trans(q_pe), s)
    s = s * qk_scale[None, :]
    if not FULL:
        s = tl.where((n0 + tl.arange(0, BLOCK_N) < end)[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    # -inf only for a tile with no valid key (the interpreter's extra tiles)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[None, :])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 0)
    if q_a.dtype == tl.float32:
        acc_a = tl.dot(tl.trans(k_a), p, acc_a * alpha[None, :], input_precision="ieee")
        if LAT_CHUNKS == 2 and V_SPLIT == 1:
            acc_b = tl.dot(tl.trans(k_b), p, acc_b * alpha[None, :], input_precision="ieee")
    else:
        pd = p.to(q_a.dtype)
        acc_a = tl.dot(tl.trans(k_a), pd, acc_a * alpha[None, :])
        if LAT_CHUNKS == 2 and V_SPLIT == 1:
            acc_b = tl.dot(tl.trans(k_b), pd, acc_b * alpha[None, :])
    return m_new, l_i, acc_a, acc_b


@jit
def mla_decode_mma_kernel(
    Q: tl.tensor, Q_PE: tl.tensor, Q16: tl.tensor, LAT_DESC: tl.tensor_descriptor,
    PE_DESC: tl.tensor_descriptor, C: tl.tensor, BT: tl.tensor, TOK_REQ: tl.tensor,
    TOK_POS: tl.tensor, K_SCALE: tl.tensor,
    OUT: tl.tensor, O_PART: tl.tensor, LSE_PART: tl.tensor,
    stride_qt: tl.tensor, stride_qh: tl.tensor, stride_et: tl.tensor, stride_eh: tl.tensor,
    stride_16t: tl.tensor, stride_16h: tl.tensor,
    stride_cb: tl.tensor, stride_cs: tl.tensor,
    stride_bt: tl.tensor, stride_xt: tl.tensor, stride_xh: tl.tensor,
    stride_pt: tl.tensor, stride_ph: tl.tensor, stride_ps: tl.tensor,
    stride_lt: tl.tensor, stride_lh: tl.tensor,
    num_heads: tl.tensor, sm_scale: tl.tensor, num_splits: tl.tensor,
    KV_LORA: tl.constexpr, ROPE: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr,
    HW_FP8: tl.constexpr, FP32_DOT: tl.constexpr, SINGLE: tl.constexpr,
    USE_TMA: tl.constexpr, TILE_IN_PAGE: tl.constexpr, DYNAMIC_LOOP: tl.constexpr,
    MAX_ITERS: tl.constexpr, FP16_DOT: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, LAT_CHUNKS: tl.constexpr, V_SPLIT: tl.constexpr,
    SPLIT_SCORES: tl.constexpr, HEADS_N: tl.constexpr, LC: tl.constexpr,
    BLOCK_R: tl.constexpr,
) -> None:
    """One (head tile and value part, split, token) program of the dense absorbed decode.

    ``Q``: ``[T, N, L]`` (the absorbed ``q_nope @ W_UK``), ``Q_PE``: ``[T, N, R]``, unit
    stride on the last axis; ``C``: the latent cache ``(nb, PAGE, L + R)`` (fp8 read
    as bytes: ``FP8`` 1 E4M3, 2 E5M2), also seen by ``LAT_DESC`` / ``PE_DESC`` as
    ``[nb * PAGE, L + R]`` when ``USE_TMA``; ``BT``: ``[reqs, max_blocks]`` int32;
    ``TOK_REQ`` / ``TOK_POS``: ``[T]`` int32 (token ``t`` sees positions
    ``0 .. TOK_POS[t]``). The latent is ``LAT_CHUNKS`` chunks of ``LC`` columns; with
    ``V_SPLIT == 2`` a program accumulates the values of one chunk only (the scores
    use both). ``FP32_DOT``: IEEE float32 dots; ``FP16_DOT`` (fp8 caches): float16
    dots, the fp8 bytes widened to float16 and the query scaled into it
    (:func:`query_as_fp16`, staged in ``Q16``, ``[T, N, L + R]`` float16); else the
    query's 16-bit dtype.
    ``SINGLE``: one split, the normalised output goes to ``OUT`` ``[T, N, L]``;
    otherwise ``O_PART`` ``[T, N, S, L]`` float32 and ``LSE_PART`` ``[T, N, S]`` (base
    2, ``-inf`` for an empty split) for :func:`mla_decode_combine_kernel`.
    """
    hb = tl.program_id(0) // V_SPLIT  # one token's head tiles run side by side (L2)
    col_a = (tl.program_id(0) % V_SPLIT) * LC
    col_b = LC - col_a
    sp = tl.program_id(1)
    t = tl.program_id(2).to(tl.int64)  # offsets of t can pass 2**31
    req = tl.load(TOK_REQ + t).to(tl.int64)
    n_keys = tl.load(TOK_POS + t) + 1
    start, end = split_range(n_keys, num_splits, sp, BLOCK_N)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_c = tl.arange(0, LC)
    offs_r = tl.arange(0, BLOCK_R)
    mask_a = mask_h[:, None] & (col_a + offs_c < KV_LORA)[None, :]
    mask_b = mask_h[:, None] & (col_b + offs_c < KV_LORA)[None, :]
    q_row = Q + t * stride_qt + offs_h[:, None] * stride_qh
    q_a = tl.load(q_row + col_a + offs_c[None, :], mask=mask_a, other=0.0)
    q_b = q_a
    if LAT_CHUNKS == 2:
        q_b = tl.load(q_row + col_b + offs_c[None, :], mask=mask_b, other=0.0)
    q_pe = tl.load(Q_PE + t * stride_et + offs_h[:, None] * stride_eh + offs_r[None, :],
                   mask=mask_h[:, None] & (offs_r < ROPE)[None, :], other=0.0)
    if FP32_DOT:
        q_a = q_a.to(tl.float32)
        q_b = q_b.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    # an fp8 row is (stored * k_scale): the scale multiplies the scores and the output,
    # so the dots run on the stored values
    k_scale = 1.0
    if FP8 != 0:
        k_scale = tl.load(K_SCALE)
    qk_scale = tl.full([BLOCK_H], sm_scale * k_scale * LOG2E, tl.float32)
    if FP16_DOT:
        q_a, q_b, q_pe, q_exp = query_as_fp16(q_a, q_b, q_pe, LAT_CHUNKS)
        qk_scale = qk_scale * q_exp
    if FP16_DOT and not HEADS_N:
        # through global memory and back: Triton keeps a dot's first operand in shared
        # memory only when it comes from a load (computed, it would stay in registers:
        # 144 a thread, and spill); as the second operand (HEADS_N) it always is
        q16_row = Q16 + t * stride_16t + offs_h[:, None] * stride_16h
        mask_pe = mask_h[:, None] & (offs_r < ROPE)[None, :]
        tl.store(q16_row + col_a + offs_c[None, :], q_a, mask=mask_a)
        if LAT_CHUNKS == 2:
            tl.store(q16_row + col_b + offs_c[None, :], q_b, mask=mask_b)
        tl.store(q16_row + KV_LORA + offs_r[None, :], q_pe, mask=mask_pe)
        tl.debug_barrier()
        q_a = tl.load(q16_row + col_a + offs_c[None, :], mask=mask_a, other=0.0)
        q_b = q_a
        if LAT_CHUNKS == 2:
            q_b = tl.load(q16_row + col_b + offs_c[None, :], mask=mask_b, other=0.0)
        q_pe = tl.load(q16_row + KV_LORA + offs_r[None, :], mask=mask_pe, other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if HEADS_N:
        acc_a = tl.zeros([LC, BLOCK_H], tl.float32)
        acc_b = tl.zeros([LC, BLOCK_H], tl.float32)
    else:
        acc_a = tl.zeros([BLOCK_H, LC], tl.float32)
        acc_b = tl.zeros([BLOCK_H, LC], tl.float32)
    if DYNAMIC_LOOP:
        # whole tiles unmasked (TMA where selected), then the partial last one masked
        n_full = (end - start) // BLOCK_N
        # loop-invariant MMA descriptors of the query and of a widened fp8 tile, hoisted,
        # would hold ~80 registers a thread for the whole loop and spill
        for it in tl.range(0, n_full, disable_licm=True):
            m_i, l_i, acc_a, acc_b = _attend_tile(
                start + it * BLOCK_N, end, m_i, l_i, acc_a, acc_b, q_a, q_b, q_pe, qk_scale,
                LAT_DESC, PE_DESC, C, BT, req, col_a, col_b, stride_cb, stride_cs,
                stride_bt, KV_LORA, ROPE, PAGE, FP8, HW_FP8, True, USE_TMA, TILE_IN_PAGE,
                LAT_CHUNKS, V_SPLIT, SPLIT_SCORES, HEADS_N, LC, BLOCK_N, BLOCK_R)
        tail = start + n_full * BLOCK_N
        if tail < end:
            m_i, l_i, acc_a, acc_b = _attend_tile(
                tail, end, m_i, l_i, acc_a, acc_b, q_a, q_b, q_pe, qk_scale,
                LAT_DESC, PE_DESC, C, BT, req, col_a, col_b, stride_cb, stride_cs,
                stride_bt, KV_LORA, ROPE, PAGE, FP8, HW_FP8, False, USE_TMA, TILE_IN_PAGE,
                LAT_CHUNKS, V_SPLIT, SPLIT_SCORES, HEADS_N, LC, BLOCK_N, BLOCK_R)
    else:
        # the interpreter cannot bound a loop by a tensor: the host's upper bound of
        # iterations; whole tiles take the unmasked path, the rest are masked
        for it in range(0, MAX_ITERS):
            n0 = start + it * BLOCK_N
            if n0 + BLOCK_N <= end:
                m_i, l_i, acc_a, acc_b = _attend_tile(
                    n0, end, m_i, l_i, acc_a, acc_b, q_a, q_b, q_pe, qk_scale,
                    LAT_DESC, PE_DESC, C, BT, req, col_a, col_b, stride_cb, stride_cs,
                    stride_bt, KV_LORA, ROPE, PAGE, FP8, HW_FP8, True, USE_TMA,
                    TILE_IN_PAGE, LAT_CHUNKS, V_SPLIT, SPLIT_SCORES, HEADS_N, LC, BLOCK_N,
                    BLOCK_R)
            else:
                m_i, l_i, acc_a, acc_b = _attend_tile(
                    n0, end, m_i, l_i, acc_a, acc_b, q_a, q_b, q_pe, qk_scale,
                    LAT_DESC, PE_DESC, C, BT, req, col_a, col_b, stride_cb, stride_cs,
                    stride_bt, KV_LORA, ROPE, PAGE, FP8, HW_FP8, False, USE_TMA,
                    TILE_IN_PAGE, LAT_CHUNKS, V_SPLIT, SPLIT_SCORES, HEADS_N, LC, BLOCK_N,
                    BLOCK_R)

    if HEADS_N:  # once, through shared memory
        acc_a = tl.trans(acc_a)
        acc_b = tl.trans(acc_b)
    seen = l_i > 0.0
    norm = (k_scale / tl.where(seen, l_i, 1.0))[:, None]
    both = LAT_CHUNKS == 2 and V_SPLIT == 1
    if SINGLE:
        o_row = OUT + t * stride_xt + offs_h[:, None] * stride_xh + offs_c[None, :]
        tl.store(o_row + col_a, (acc_a * norm).to(OUT.dtype.element_ty), mask=mask_a)
        if both:
            tl.store(o_row + col_b, (acc_b * norm).to(OUT.dtype.element_ty), mask=mask_b)
    else:
        o_row = (O_PART + t * stride_pt + offs_h[:, None] * stride_ph + sp * stride_ps
                 + offs_c[None, :])
        tl.store(o_row + col_a, acc_a * norm, mask=mask_a)
        if both:
            tl.store(o_row + col_b, acc_b * norm, mask=mask_b)
        if col_a == 0:  # one program of a head tile writes the log-sum-exp
            lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)),
                           float("-inf"))
            tl.store(LSE_PART + t * stride_lt + offs_h * stride_lh + sp, lse, mask=mask_h)


@jit
def mla_decode_combine_kernel(
    O_PART: tl.tensor, LSE_PART: tl.tensor, OUT: tl.tensor,
    stride_pt: tl.tensor, stride_ph: tl.tensor, stride_ps: tl.tensor,
    stride_lt: tl.tensor, stride_lh: tl.tensor, stride_xt: tl.tensor, stride_xh: tl.tensor,
    num_splits: tl.tensor,
    KV_LORA: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr,
    PDL: tl.constexpr = False,
) -> None:
    """``OUT[t, h]`` from the splits' normalised outputs, weighted by ``2**lse``
    (a split that saw no key has ``lse = -inf`` and weight 0). ``BLOCK_S``: a power
    of two ``>= num_splits``. ``PDL`` (NVIDIA sm_90+, launched with ``launch_pdl``):
    the grid may start before the decode's has finished, and waits for it before its
    first read."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    h = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < KV_LORA
    lse_row = LSE_PART + t * stride_lt + h * stride_lh
    lse = tl.load(lse_row + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.math.exp2(lse - m), 0)
    # one split's row at a time: a [BLOCK_S, L] tile would not fit in registers
    res = tl.zeros([BLOCK_L], tl.float32)
    o_row = O_PART + t * stride_pt + h * stride_ph + offs_l
    for s in range(0, BLOCK_S):
        live = s < num_splits
        w = tl.math.exp2(tl.load(lse_row + s, mask=live, other=float("-inf")) - m)
        res += w * tl.load(o_row + s * stride_ps, mask=mask_l & live, other=0.0)
    res = res / tl.where(total > 0.0, total, 1.0)
    tl.store(OUT + t * stride_xt + h * stride_xh + offs_l, res.to(OUT.dtype.element_ty),
             mask=mask_l)
