"""The Triton kernels behind :mod:`vllm.attention.ops.triton_mla` (imported on first use).

Kept apart so that importing :mod:`vllm` never imports Triton; the kernels must be
module-level for ``@triton.jit`` to resolve the helper they call.
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

@jit
def mla_key_block(
    n0: tl.tensor, end: tl.tensor, m_i: tl.tensor, l_i: tl.tensor, acc: tl.tensor,
    q_nope: tl.tensor, q_pe: tl.tensor, k_scale: tl.tensor,
    t: tl.tensor, req: tl.tensor, pos_q: tl.tensor,
    C: tl.tensor, C_SCALE: tl.tensor, C_ROPE: tl.tensor, BT: tl.tensor, TOPK: tl.tensor,
    stride_cb: tl.tensor, stride_cs: tl.tensor, stride_bt: tl.tensor, stride_kt: tl.tensor,
    sm_scale: tl.tensor,
    KV_LORA: tl.constexpr, ROPE: tl.constexpr, PAGE: tl.constexpr, TILE: tl.constexpr,
    FORMAT: tl.constexpr, FP8_E5M2: tl.constexpr, HW_FP8: tl.constexpr,
    IS_SPARSE: tl.constexpr,
    HALF_DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
) -> tl.tensor:  # (m_i, l_i, acc)
    """One block of ``BLOCK_N`` keys from ``n0``: online-softmax update."""
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < KV_LORA
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < ROPE
    offs_n = n0 + tl.arange(0, BLOCK_N)
    in_range = offs_n < end
    if IS_SPARSE:
        kpos = tl.load(TOPK + t * stride_kt + offs_n, mask=in_range, other=-1)
        valid = in_range & (kpos >= 0) & (kpos <= pos_q)
    else:
        kpos = offs_n
        valid = in_range
    kpos = tl.where(valid, kpos, 0)
    blk = tl.load(BT + req * stride_bt + kpos // PAGE, mask=valid, other=0).to(tl.int64)
    row = blk * stride_cb + (kpos % PAGE).to(tl.int64) * stride_cs
    lat_mask = valid[:, None] & mask_l[None, :]
    rope_mask = valid[:, None] & mask_r[None, :]
    if FORMAT == 2:
        raw = tl.load(C + row[:, None] + offs_l[None, :], mask=lat_mask, other=0)
        tile_scale = tl.load(
            C_SCALE + row[:, None] // 4 + KV_LORA // 4 + offs_l[None, :] // TILE,
            mask=lat_mask, other=0.0)
        k_lat = widen_fp8(raw, False, HW_FP8).to(tl.float32) * tile_scale
        rope_at = (KV_LORA + 4 * (KV_LORA // TILE)) // 2
        k_pe = tl.load(C_ROPE + row[:, None] // 2 + rope_at + offs_r[None, :],
                       mask=rope_mask, other=0.0).to(tl.float32)
    elif FORMAT == 1:
        raw = tl.load(C + row[:, None] + offs_l[None, :], mask=lat_mask, other=0)
        raw_pe = tl.load(C + row[:, None] + KV_LORA + offs_r[None, :], mask=rope_mask,
                         other=0)
        k_lat = widen_fp8(raw, FP8_E5M2, HW_FP8).to(tl.float32) * k_scale
        k_pe = widen_fp8(raw_pe, FP8_E5M2, HW_FP8).to(tl.float32) * k_scale
    else:
        k_lat = tl.load(C + row[:, None] + offs_l[None, :], mask=lat_mask,
                        other=0.0).to(tl.float32)
        k_pe = tl.load(C + row[:, None] + KV_LORA + offs_r[None, :], mask=rope_mask,
                       other=0.0).to(tl.float32)
    if HALF_DOT:
        k_lat_d = k_lat.to(q_nope.dtype)
        qk = tl.dot(q_nope, tl.trans(k_lat_d))
        qk += tl.dot(q_pe, tl.trans(k_pe.to(q_pe.dtype)))
    else:
        k_lat_d = k_lat
        qk = tl.dot(q_nope, tl.trans(k_lat), input_precision="ieee")
        qk += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
    qk = tl.where(valid[None, :], qk * sm_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(qk - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if HALF_DOT:
        acc = acc * alpha[:, None] + tl.dot(p.to(q_nope.dtype), k_lat_d)
    else:
        acc = acc * alpha[:, None] + tl.dot(p, k_lat_d, input_precision="ieee")
    return m_new, l_i, acc


@jit
def mla_split_kernel(
    Q: tl.tensor, C: tl.tensor, C_SCALE: tl.tensor, C_ROPE: tl.tensor, BT: tl.tensor,
    TOK_REQ: tl.tensor, TOK_POS: tl.tensor, TOPK: tl.tensor, K_SCALE: tl.tensor,
    O_PART: tl.tensor, LSE_PART: tl.tensor,
    stride_qt: tl.tensor, stride_qh: tl.tensor, stride_cb: tl.tensor, stride_cs: tl.tensor,
    stride_bt: tl.tensor, stride_kt: tl.tensor,
    stride_ot: tl.tensor, stride_oh: tl.tensor, stride_os: tl.tensor, stride_lt: tl.tensor,
    stride_lh: tl.tensor,
    num_heads: tl.tensor, n_topk: tl.tensor, sm_scale: tl.tensor, num_splits: tl.tensor,
    KV_LORA: tl.constexpr, ROPE: tl.constexpr, PAGE: tl.constexpr, TILE: tl.constexpr,
    FORMAT: tl.constexpr, FP8_E5M2: tl.constexpr, HW_FP8: tl.constexpr,
    IS_SPARSE: tl.constexpr,
    HALF_DOT: tl.constexpr, DYNAMIC_LOOP: tl.constexpr,
    MAX_ITERS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
) -> None:
    t = tl.program_id(0).to(tl.int64)  # offsets of t can pass 2**31
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    req = tl.load(TOK_REQ + t).to(tl.int64)
    pos_q = tl.load(TOK_POS + t)
    if IS_SPARSE:
        n_keys = n_topk
    else:
        n_keys = pos_q + 1
    per_split = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
    start = sp * per_split
    end = tl.minimum(start + per_split, n_keys)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < KV_LORA
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < ROPE
    q_row = Q + t * stride_qt + offs_h[:, None] * stride_qh
    q_nope = tl.load(q_row + offs_l[None, :], mask=mask_h[:, None] & mask_l[None, :], other=0.0)
    q_pe = tl.load(q_row + KV_LORA + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :],
                   other=0.0)
    if not HALF_DOT:
        q_nope = q_nope.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    k_scale = 1.0
    if FORMAT == 1:
        k_scale = tl.load(K_SCALE)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    if DYNAMIC_LOOP:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = mla_key_block(
                n0, end, m_i, l_i, acc, q_nope, q_pe, k_scale, t, req, pos_q,
                C, C_SCALE, C_ROPE, BT, TOPK, stride_cb, stride_cs, stride_bt, stride_kt,
                sm_scale, KV_LORA, ROPE, PAGE, TILE, FORMAT, FP8_E5M2, HW_FP8,
                IS_SPARSE, HALF_DOT, BLOCK_N, BLOCK_L, BLOCK_R)
    else:
        # the interpreter cannot bound a loop by a tensor: run the host's upper
        # bound of iterations, the keys past ``end`` masked out
        for it in range(0, MAX_ITERS):
            m_i, l_i, acc = mla_key_block(
                start + it * BLOCK_N, end, m_i, l_i, acc, q_nope, q_pe, k_scale, t, req,
                pos_q, C, C_SCALE, C_ROPE, BT, TOPK, stride_cb, stride_cs, stride_bt,
                stride_kt, sm_scale, KV_LORA, ROPE, PAGE, TILE, FORMAT,
                FP8_E5M2, HW_FP8, IS_SPARSE, HALF_DOT, BLOCK_N, BLOCK_L, BLOCK_R)
    seen = l_i > 0.0
    denom = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, m_i + tl.log(denom), float("-inf"))
    tl.store(O_PART + t * stride_ot + offs_h[:, None] * stride_oh + sp * stride_os
             + offs_l[None, :], acc / denom[:, None], mask=mask_h[:, None] & mask_l[None, :])
    tl.store(LSE_PART + t * stride_lt + offs_h * stride_lh + sp, lse, mask=mask_h)

@jit
def mla_combine_kernel(
    O_PART: tl.tensor, LSE_PART: tl.tensor, OUT: tl.tensor,
    stride_ot: tl.tensor, stride_oh: tl.tensor, stride_os: tl.tensor, stride_lt: tl.tensor,
    stride_lh: tl.tensor,
    stride_xt: tl.tensor, stride_xh: tl.tensor, num_splits: tl.tensor,
    KV_LORA: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_L: tl.constexpr,
) -> None:
    t = tl.program_id(0).to(tl.int64)  # offsets of t can pass 2**31
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < num_splits
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < KV_LORA
    lse = tl.load(LSE_PART + t * stride_lt + h * stride_lh + offs_s, mask=mask_s,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)
    total = tl.sum(w, 0)
    o = tl.load(O_PART + t * stride_ot + h * stride_oh + offs_s[:, None] * stride_os
                + offs_l[None, :], mask=mask_s[:, None] & mask_l[None, :], other=0.0)
    res = tl.sum(o * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(OUT + t * stride_xt + h * stride_xh + offs_l, res, mask=mask_l)
