"""The dense MLA decode for Hopper (sm_90) in Gluon: 16-bit models, caches in the
model's dtype or scaled fp8 (imported on first use).

Same algorithm as :func:`~vllm.attention.ops.triton_mla_decode_kernels.mla_decode_mma_kernel`
(``BLOCK_H`` heads as the M of ``S = Q @ K^T`` and ``O += P @ K[:, :L]``, an online
softmax in base 2 between them, split-KV), written with explicit asynchronous copies
and warpgroup MMAs so the schedule is the kernel's own rather than the compiler's:

* the next tile's TMA copy is issued at the start of an iteration, as soon as the
  previous value MMAs (the last readers of that buffer) have finished, so it overlaps
  the whole iteration: the score MMAs, the softmax and the value MMAs. Triton's
  pipeliner issues it at the end of the iteration, after the score MMAs' wait and the
  softmax, which left most of a tile's load latency exposed; the block-table entry
  of a copy is loaded an iteration before it;
* the value MMAs are left in flight across the loop's back edge and waited for only
  where their accumulators or their operands are needed again;
* the row sums of P are kept a row and score column, each thread adding its own
  elements of P, and reduced once, at the end: no reduction crosses threads a tile
  for them, and nothing queues behind the value MMAs (the row maximum still crosses
  the warpgroups).

The eight warps are two warpgroups laid ``[4, 2]``: each computes half of a tile's
keys in the score MMAs and half of the latent columns in the value MMA (P goes
through shared memory, so both see all of it). The last, partial tile of a split is
read with masked pointer loads (a slot past the request's last position may hold
anything, NaN too, and a zero probability times NaN is NaN). fp8 tiles are copied as
bytes and widened exactly to float16 in shared memory before their MMAs. The launcher
is :mod:`vllm.attention.ops.triton_mla_decode`; ``docs/mla.md`` explains the choices
and what limits them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

# the Triton kernel's helpers on scalars and row tiles (a Gluon kernel calls them as
# they are: their operations keep their operands' layouts)
from vllm.attention.ops.triton_mla_decode_kernels import query_as_fp16, split_range

jit: Callable[[Callable[..., Any]], Any] = gluon.jit
"""``gluon.jit`` with a type, so mypy accepts the decorated kernels (as ``Any``)."""
constexpr_function: Callable[[Callable[..., Any]], Any] = gluon.constexpr_function
"""``gluon.constexpr_function`` (a Python function a kernel calls at compile time on
constants) with a type, as :data:`jit`."""

LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)


@jit
def _block_of(BT: gl.tensor, req: gl.tensor, n0: gl.tensor, stride_bt: gl.tensor,
              pred: gl.tensor, PAGE: gl.constexpr) -> gl.tensor:
    """The cache block holding position ``n0`` of the request (0 when ``pred`` is
    false)."""
    return gl.load(BT + req * stride_bt + n0 // PAGE, mask=pred, other=0)


@jit
def _issue_tile(LAT_DESC: tma.tensor_descriptor, PE_DESC: tma.tensor_descriptor,
                blk: gl.tensor, n0: gl.tensor, bar: gl.shared_memory_descriptor,
                ka: gl.shared_memory_descriptor, kp: gl.shared_memory_descriptor,
                pred: gl.tensor, KV_LORA: gl.constexpr, PAGE: gl.constexpr) -> None:
    """Start the TMA copy of rows ``n0 .. n0 + BLOCK_N`` (inside block ``blk``) into
    ``ka`` (latent) and ``kp`` (rope), completing on ``bar``; nothing when ``pred`` is
    false."""
    row = blk * PAGE + n0 % PAGE
    mbarrier.expect(bar, LAT_DESC.block_type.nbytes + PE_DESC.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(LAT_DESC, [row, 0], bar, ka, pred=pred)
    tma.async_copy_global_to_shared(PE_DESC, [row, KV_LORA], bar, kp, pred=pred)


@jit
def _attend(q_s: gl.shared_memory_descriptor, qp_s: gl.shared_memory_descriptor,
            ka: gl.shared_memory_descriptor, kp: gl.shared_memory_descriptor,
            p_s: gl.shared_memory_descriptor, acc: gl.tensor, l_acc: gl.tensor,
            m_i: gl.tensor, qk_scale: gl.tensor, n_valid: gl.tensor, MASKED: gl.constexpr,
            S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, BLOCK_H: gl.constexpr,
            BLOCK_N: gl.constexpr) -> gl.tensor:  # (acc in flight, l_acc, m_i)
    """One tile: the score MMAs (waited for), the online softmax, and the value MMAs,
    left in flight. ``acc``: the output, no MMA of it in flight; ``l_acc``: the sums of
    P a row and score column, ``[BLOCK_H, BLOCK_N]`` in the scores' layout (each thread
    adds its own elements: no reduction across threads a tile, and nothing behind the
    value MMAs); ``qk_scale``: ``[BLOCK_H]``, what turns a head's scores into base-2
    logits; ``MASKED``: keys at or past ``n_valid`` get probability zero."""
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_LAYOUT)
    s = warpgroup_mma(q_s, ka.permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma(qp_s, kp.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, q_s, qp_s, ka, kp))[0]
    if MASKED:
        keys = gl.arange(0, BLOCK_N, gl.SliceLayout(0, S_LAYOUT))
        s = gl.where((keys < n_valid)[None, :], s, float("-inf"))
    # the maximum of the raw scores, scaled once (qk_scale > 0, a head's); P in one FMA
    # an element
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    # -inf only before the first key (m_i) or for a tile without one (not launched)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(gl.fma(s, qk_scale[:, None], -m_safe[:, None]))
    alpha = gl.exp2(m_i - m_safe)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
    l_acc = gl.fma(l_acc, alpha[:, None], p)
    # every warp's P in shared memory, visible to the MMA (the async proxy), before
    # either warpgroup reads all of it
    p_s.store(p.to(ka.dtype))
    fence_async_shared()
    gl.thread_barrier()
    acc = warpgroup_mma(p_s, ka, acc, is_async=True)
    return acc, l_acc, m_new


@jit
def widen_fp8(raw: gl.tensor, FP8: gl.constexpr) -> gl.tensor:
    """fp8 bytes (``FP8`` 1: E4M3, 2: E5M2) as float16, exactly (the hardware
    conversion, two values an instruction; NaN stays NaN)."""
    if FP8 == 1:
        return raw.to(gl.float8e4nv, bitcast=True).to(gl.float16)
    else:
        return raw.to(gl.float8e5, bitcast=True).to(gl.float16)


@jit
def _widen_tile(ra: gl.shared_memory_descriptor, rp: gl.shared_memory_descriptor,
                wa: gl.shared_memory_descriptor, wp: gl.shared_memory_descriptor,
                FP8: gl.constexpr, KV_LORA: gl.constexpr, CH: gl.constexpr,
                LOAD8: gl.constexpr) -> None:
    """A tile of fp8 bytes (``ra`` latent, ``rp`` rope) into the float16 operands of
    the MMAs (``wa``, ``wp``), ``CH`` columns at a time, visible to the MMAs after."""
    for c in gl.static_range(KV_LORA // CH):
        wa.slice(c * CH, CH, dim=1).store(widen_fp8(ra.slice(c * CH, CH, dim=1).load(LOAD8), FP8))
    wp.store(widen_fp8(rp.load(LOAD8), FP8))
    fence_async_shared()
    gl.thread_barrier()


@jit
def _load_tail(C: gl.tensor, BT: gl.tensor, req: gl.tensor, tail: gl.tensor, end: gl.tensor,
               stride_bt: gl.tensor, stride_cb: gl.tensor, stride_cs: gl.tensor,
               wa: gl.shared_memory_descriptor, wp: gl.shared_memory_descriptor,
               FP8: gl.constexpr, KV_LORA: gl.constexpr, ROPE: gl.constexpr,
               PAGE: gl.constexpr, BLOCK_N: gl.constexpr, CH: gl.constexpr,
               LOAD: gl.constexpr) -> None:
    """Rows ``tail .. tail + BLOCK_N`` of the request (one page's) into the MMA operands
    ``wa`` / ``wp`` (widened from fp8 when ``FP8``), ``CH`` columns at a time; rows at or
    past ``end`` as zeros (their bytes may be anything, NaN too, and a zero probability
    times NaN is NaN). Visible to the MMAs after."""
    rows = gl.arange(0, BLOCK_N, gl.SliceLayout(1, LOAD))
    cols = gl.arange(0, CH, gl.SliceLayout(0, LOAD))
    offs_r = gl.arange(0, ROPE, gl.SliceLayout(0, LOAD))
    valid = (tail + rows < end)[:, None]
    blk = gl.load(BT + req * stride_bt + tail // PAGE).to(gl.int64)
    base = (C + blk * stride_cb + (tail % PAGE).to(gl.int64) * stride_cs
            + rows[:, None] * stride_cs)
    for c in gl.static_range(KV_LORA // CH):
        x = gl.load(base + c * CH + cols[None, :], mask=valid, other=0)
        if FP8 != 0:
            x = widen_fp8(x, FP8)
        wa.slice(c * CH, CH, dim=1).store(x)
    x = gl.load(base + KV_LORA + offs_r[None, :], mask=valid, other=0)
    if FP8 != 0:
        x = widen_fp8(x, FP8)
    wp.store(x)
    fence_async_shared()
    gl.thread_barrier()


@jit
def _program_keys(TOK_REQ: gl.tensor, TOK_POS: gl.tensor, num_splits: gl.tensor,
                  BLOCK_N: gl.constexpr) -> gl.tensor:
    """The program's head tile ``hb``, split ``sp`` and token ``t`` (grid ``(head tiles,
    splits, tokens)``), the token's request, and the keys of its split: ``start ..
    end``, ``n_tiles`` tiles of ``BLOCK_N``, ``n_last`` rows in the last."""
    hb = gl.program_id(0)
    sp = gl.program_id(1)
    t = gl.program_id(2).to(gl.int64)  # offsets of t can pass 2**31
    req = gl.load(TOK_REQ + t).to(gl.int64)
    n_keys = gl.load(TOK_POS + t) + 1
    start, end = split_range(n_keys, num_splits, sp, BLOCK_N)
    n_tiles = gl.cdiv(end - start, BLOCK_N)
    n_last = end - start - (n_tiles - 1) * BLOCK_N  # rows of the last tile
    return hb, sp, t, req, start, end, n_tiles, n_last


@jit
def mla_decode_gluon_kernel(
    Q: gl.tensor, Q_PE: gl.tensor, LAT_DESC: tma.tensor_descriptor,
    PE_DESC: tma.tensor_descriptor, C: gl.tensor, BT: gl.tensor, TOK_REQ: gl.tensor,
    TOK_POS: gl.tensor, K_SCALE: gl.tensor, OUT: gl.tensor, O_PART: gl.tensor,
    LSE_PART: gl.tensor,
    stride_qt: gl.tensor, stride_qh: gl.tensor, stride_et: gl.tensor, stride_eh: gl.tensor,
    stride_cb: gl.tensor, stride_cs: gl.tensor, stride_bt: gl.tensor, stride_xt: gl.tensor,
    stride_xh: gl.tensor, stride_pt: gl.tensor, stride_ph: gl.tensor, stride_ps: gl.tensor,
    stride_lt: gl.tensor, stride_lh: gl.tensor,
    num_heads: gl.tensor, sm_scale: gl.tensor, num_splits: gl.tensor,
    KV_LORA: gl.constexpr, ROPE: gl.constexpr, PAGE: gl.constexpr, FP8: gl.constexpr,
    SINGLE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    num_warps: gl.constexpr,
) -> None:
    """One (head tile, split, token) program; grid ``(head tiles, splits, tokens)``.

    ``Q``: ``[T, N, L]`` and ``Q_PE``: ``[T, N, R]`` in the model's 16-bit dtype, unit
    stride on the last axis; ``C``: the cache ``(nb, PAGE, L + R)``, in the model's dtype
    or (``FP8`` 1: E4M3, 2: E5M2) fp8 read as bytes, each row ``stored * K_SCALE``
    (float32 ``[1]``); ``LAT_DESC`` / ``PE_DESC``: TMA descriptors over it seen as
    ``[nb * PAGE, L + R]`` with blocks ``[BLOCK_N, L]`` and ``[BLOCK_N, R]``; ``BT``:
    ``[reqs, max_blocks]`` int32; ``TOK_REQ`` / ``TOK_POS``: ``[T]`` int32 (token ``t``
    sees positions ``0 .. TOK_POS[t]``). ``SINGLE``: one split, the normalised output to
    ``OUT`` ``[T, N, L]``; else float32 ``O_PART`` ``[T, N, S, L]`` and ``LSE_PART``
    ``[T, N, S]`` (base 2, ``-inf`` for an empty split) for the combine kernel. ``PAGE``
    is a multiple of ``BLOCK_N``: a tile is one page's rows.

    fp8: each tile's bytes are widened exactly to float16 in shared memory, and the dots
    run in float16 on the stored values: the query is scaled into float16 a head at a
    time by the power of two that puts its largest magnitude in ``[2**14, 2**15)``
    (exact: only values below ``2**-28`` of the row's largest lose bits), the power and
    ``K_SCALE`` multiplying the scores, ``K_SCALE`` the output.
    """
    gl.static_assert(num_warps == 8, "two warpgroups")
    gl.static_assert(PAGE % BLOCK_N == 0, "a tile inside one page")
    RAW: gl.constexpr = C.dtype.element_ty
    DOT: gl.constexpr = gl.float16 if FP8 != 0 else RAW
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, KV_LORA // 2, 16])
    # 16-byte vectors along a row: 16-bit values (the query, a partial tile), fp8 bytes
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    LOAD8: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
    # columns a step when tiles are widened or loaded through registers
    CH: gl.constexpr = 128 if KV_LORA >= 128 else KV_LORA
    LAT_DOT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, KV_LORA], DOT)
    PE_DOT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], DOT)
    Q_LAT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, KV_LORA], DOT)
    Q_PE_LAYOUT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, ROPE], DOT)

    # (whole tiles here: the last, partial one goes through pointer loads)
    hb, sp, t, req, start, end, n_tiles, n_last = _program_keys(TOK_REQ, TOK_POS,
                                                                num_splits, BLOCK_N)
    n_full = (end - start) // BLOCK_N

    # the buffers: two key tiles as stored (TMA), with fp8 one widened tile, the query
    # (kept), P
    ka_bufs = gl.allocate_shared_memory(RAW, [2, BLOCK_N, KV_LORA], LAT_DESC.layout)
    kp_bufs = gl.allocate_shared_memory(RAW, [2, BLOCK_N, ROPE], PE_DESC.layout)
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(bars.index(i), count=1)
    # the first tile's copy before the query's loads; the block-table entries one tile
    # ahead of their copies, so no copy waits for one
    blk = _block_of(BT, req, start, stride_bt, n_full > 0, PAGE)
    _issue_tile(LAT_DESC, PE_DESC, blk, start, bars.index(0), ka_bufs.index(0),
                kp_bufs.index(0), n_full > 0, KV_LORA, PAGE)
    blk_next = _block_of(BT, req, start + BLOCK_N, stride_bt, n_full > 1, PAGE)
    if FP8 != 0:
        wa = gl.allocate_shared_memory(DOT, [BLOCK_N, KV_LORA], LAT_DOT)
        wp = gl.allocate_shared_memory(DOT, [BLOCK_N, ROPE], PE_DOT)
    else:
        # the tail's buffer: the one no copy and no MMA uses any more by then
        wa = ka_bufs.index(n_full % 2)
        wp = kp_bufs.index(n_full % 2)

    offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, LOAD))
    mask_h = (offs_h < num_heads)[:, None]
    offs_l = gl.arange(0, KV_LORA, gl.SliceLayout(0, LOAD))
    offs_r = gl.arange(0, ROPE, gl.SliceLayout(0, LOAD))
    q = gl.load(Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_l[None, :],
                mask=mask_h, other=0.0)
    qp = gl.load(Q_PE + t * stride_et + offs_h[:, None] * stride_eh + offs_r[None, :],
                 mask=mask_h, other=0.0)
    qk = sm_scale * LOG2E
    if FP8 != 0:
        qk = qk * gl.load(K_SCALE)
        q, _, qp, up = query_as_fp16(q, q, qp, 1)
        qk_scale = gl.convert_layout(qk * up, gl.SliceLayout(1, S_LAYOUT))
    else:
        qk_scale = gl.full([BLOCK_H], qk, gl.float32, gl.SliceLayout(1, S_LAYOUT))
    q_s = gl.allocate_shared_memory(DOT, [BLOCK_H, KV_LORA], Q_LAT, q)
    qp_s = gl.allocate_shared_memory(DOT, [BLOCK_H, ROPE], Q_PE_LAYOUT, qp)
    p_s = gl.allocate_shared_memory(
        DOT, [BLOCK_H, BLOCK_N], gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N],
                                                                      DOT))
    fence_async_shared()
    gl.thread_barrier()

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, S_LAYOUT))
    # the output with (formally) an MMA in flight, the type the loop carries
    acc = warpgroup_mma_init(gl.zeros([BLOCK_H, KV_LORA], gl.float32, O_LAYOUT))
    l_acc = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_LAYOUT)
    for j in range(n_full):
        buf = j % 2
        # the previous value MMAs, in both warpgroups, are the last readers of the other
        # buffer (and of the widened tile) and of P: then the next tile's copy starts,
        # a whole iteration ahead
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()
        nxt = j + 1
        _issue_tile(LAT_DESC, PE_DESC, blk_next, start + nxt * BLOCK_N, bars.index(nxt % 2),
                    ka_bufs.index(nxt % 2), kp_bufs.index(nxt % 2), nxt < n_full, KV_LORA,
                    PAGE)
        blk_next = _block_of(BT, req, start + (j + 2) * BLOCK_N, stride_bt, j + 2 < n_full,
                             PAGE)
        mbarrier.wait(bars.index(buf), (j // 2) & 1)
        if FP8 != 0:
            _widen_tile(ka_bufs.index(buf), kp_bufs.index(buf), wa, wp, FP8, KV_LORA, CH,
                        LOAD8)
            ka = wa
            kp = wp
        else:
            ka = ka_bufs.index(buf)
            kp = kp_bufs.index(buf)
        acc, l_acc, m_i = _attend(q_s, qp_s, ka, kp, p_s, acc, l_acc, m_i, qk_scale,
                                  BLOCK_N, False, S_LAYOUT, O_LAYOUT, BLOCK_H, BLOCK_N)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    tail = start + n_full * BLOCK_N
    if tail < end:
        gl.thread_barrier()
        _load_tail(C, BT, req, tail, end, stride_bt, stride_cb, stride_cs, wa, wp, FP8,
                   KV_LORA, ROPE, PAGE, BLOCK_N, CH, LOAD8 if FP8 != 0 else LOAD)
        acc, l_acc, m_i = _attend(q_s, qp_s, wa, wp, p_s, acc, l_acc, m_i, qk_scale,
                                  end - tail, True, S_LAYOUT, O_LAYOUT, BLOCK_H, BLOCK_N)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for i in gl.static_range(2):
        mbarrier.invalidate(bars.index(i))

    l_i = gl.sum(l_acc, 1)
    seen = l_i > 0.0
    k_scale = 1.0
    if FP8 != 0:
        k_scale = gl.load(K_SCALE)
    norm = gl.convert_layout(k_scale / gl.where(seen, l_i, 1.0), gl.SliceLayout(1, O_LAYOUT))
    out = acc * norm[:, None]
    oh = hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, O_LAYOUT))
    oc = gl.arange(0, KV_LORA, gl.SliceLayout(0, O_LAYOUT))
    omask = (oh < num_heads)[:, None]
    if SINGLE:
        gl.store(OUT + t * stride_xt + oh[:, None] * stride_xh + oc[None, :],
                 out.to(OUT.dtype.element_ty), mask=omask)
    else:
        gl.store(O_PART + t * stride_pt + oh[:, None] * stride_ph + sp * stride_ps
                 + oc[None, :], out, mask=omask)
        lse = gl.where(seen, m_i + gl.log2(gl.where(seen, l_i, 1.0)), float("-inf"))
        lh = hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, S_LAYOUT))
        gl.store(LSE_PART + t * stride_lt + lh * stride_lh + sp, lse, mask=lh < num_heads)
