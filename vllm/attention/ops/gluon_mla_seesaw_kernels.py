"""The dense MLA decode for Hopper (sm_90) with the warpgroups in turn (Gluon; 16-bit
caches; imported on first use).

The program of :mod:`vllm.attention.ops.gluon_mla_decode_kernels` runs a tile's score
MMAs, its softmax and its value MMAs one after the other, and the tensor cores idle
through the softmax. Here three partitions run side by side:

* a loader warp copies tiles of ``BLOCK_N`` rows into a ring of ``NBUF`` buffers (TMA);
* two warpgroups each hold half of the output columns (``[BLOCK_H, L / 2]`` float32)
  and take the tiles in turn: warpgroup ``w`` computes the scores of tiles ``k`` with
  ``k % 2 == w`` in full (``S = Q K^T`` over all ``L + R`` columns), their softmax,
  and hands P and the running maximum to the other through shared memory. Each
  warpgroup then applies both its own tile and the other's last one to its half of
  the output (``O_w += P V[:, half w]``).

The running maximum is one chain through the tiles: tile ``k``'s softmax starts from
the maximum after tile ``k - 1``, which the other warpgroup published with its P. While
one warpgroup runs its softmax, the other's MMAs keep the tensor cores busy.

Synchronisation (mbarriers): ``kfull[b]`` (the loader's copy of buffer ``b`` landed),
``kfree[b]`` (both warpgroups' MMAs are done with it: two arrivals), ``pfull[x]`` /
``pfree[x]`` (P and the maximum of tile parity ``x`` published / read). The last tile of
a split may be partial: its owner zeroes the latent rows past the request's last
position in shared memory before any MMA reads them (a slot past it may hold NaN, and a
zero probability times NaN is NaN), and masks their scores.
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
    warpgroup_mma_wait,
)

jit: Callable[[Callable[..., Any]], Any] = gluon.jit
"""``gluon.jit`` with a type, so mypy accepts the decorated kernels (as ``Any``)."""

LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)


@jit
def _loader(LAT_DESC: tma.tensor_descriptor, PE_DESC: tma.tensor_descriptor,
            BT: gl.tensor, req: gl.tensor, start: gl.tensor, n_tiles: gl.tensor,
            stride_bt: gl.tensor, page: gl.tensor, ka_bufs: gl.shared_memory_descriptor,
            kp_bufs: gl.shared_memory_descriptor, kfull: gl.shared_memory_descriptor,
            kfree: gl.shared_memory_descriptor) -> None:
    """The loader warp: tile ``k`` into buffer ``k % NBUF`` once both warpgroups have
    freed it. (A partition's arguments are values, not compile-time constants: the
    sizes come from the buffers' shapes, the page size at run time.)"""
    NBUF: gl.constexpr = ka_bufs.type.shape[0]
    BLOCK_N: gl.constexpr = ka_bufs.type.shape[1]
    KV_LORA: gl.constexpr = ka_bufs.type.shape[2]
    for k in range(n_tiles):
        b = k % NBUF
        mbarrier.wait(kfree.index(b), ((k // NBUF) - 1) & 1, pred=k >= NBUF)
        n0 = start + k * BLOCK_N
        blk = gl.load(BT + req * stride_bt + n0 // page)
        row = blk * page + n0 % page
        bar = kfull.index(b)
        mbarrier.expect(bar, LAT_DESC.block_type.nbytes + PE_DESC.block_type.nbytes)
        tma.async_copy_global_to_shared(LAT_DESC, [row, 0], bar, ka_bufs.index(b))
        tma.async_copy_global_to_shared(PE_DESC, [row, KV_LORA], bar, kp_bufs.index(b))


@jit
def _zero_rows(ka: gl.shared_memory_descriptor, n_valid: gl.tensor, KV_LORA: gl.constexpr,
               BLOCK_N: gl.constexpr, CH: gl.constexpr, LOAD: gl.constexpr) -> None:
    """Latent rows at or past ``n_valid`` of a tile in shared memory set to zero."""
    rows = gl.arange(0, BLOCK_N, gl.SliceLayout(1, LOAD))
    keep = (rows < n_valid)[:, None]
    for c in gl.static_range(KV_LORA // CH):
        part = ka.slice(c * CH, CH, dim=1)
        part.store(gl.where(keep, part.load(LOAD), 0.0))


@jit
def _step(k: gl.tensor, acc: gl.tensor, l_acc: gl.tensor, m_ref: gl.tensor,
          q_s: gl.shared_memory_descriptor, qp_s: gl.shared_memory_descriptor,
          ka_bufs: gl.shared_memory_descriptor, kp_bufs: gl.shared_memory_descriptor,
          p_bufs: gl.shared_memory_descriptor, m_bufs: gl.shared_memory_descriptor,
          ones_s: gl.shared_memory_descriptor, kfull: gl.shared_memory_descriptor,
          kfree: gl.shared_memory_descriptor, pfull: gl.shared_memory_descriptor,
          pfree: gl.shared_memory_descriptor, n_tiles: gl.tensor, n_last: gl.tensor,
          qk: gl.tensor, W: gl.constexpr, HAS_PREV: gl.constexpr, HAS_OWN: gl.constexpr,
          KV_LORA: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
          NBUF: gl.constexpr, CH: gl.constexpr, S_LAYOUT: gl.constexpr,
          O_LAYOUT: gl.constexpr, L_LAYOUT: gl.constexpr, ROW: gl.constexpr,
          LOAD: gl.constexpr) -> gl.tensor:  # (acc, l_acc, m_ref)
    """Warpgroup ``W``'s turn at tile ``k`` (``HAS_OWN``; else only the other's last
    tile ``k - 1``): its scores and softmax, P published, then the other's tile ``k - 1``
    (``HAS_PREV``) and its own applied to this warpgroup's half of the output. ``acc``
    / ``l_acc`` (the row sums of P, as an MMA against ones) are relative to ``m_ref``
    and have no MMA in flight; so on return, relative to the new maximum."""
    HALF: gl.constexpr = KV_LORA // 2
    DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    DOT_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L_LAYOUT, k_width=2)
    dtype: gl.constexpr = q_s.dtype
    if HAS_OWN:
        b = k % NBUF
        mbarrier.wait(kfull.index(b), (k // NBUF) & 1)
        ka = ka_bufs.index(b)
        n_valid = gl.where(k == n_tiles - 1, n_last, BLOCK_N)
        if n_valid < BLOCK_N:
            _zero_rows(ka, n_valid, KV_LORA, BLOCK_N, CH, LOAD)
            fence_async_shared()
            gl.thread_barrier()
        s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_LAYOUT)
        s = warpgroup_mma(q_s, ka.permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma(qp_s, kp_bufs.index(b).permute((1, 0)), s, is_async=True)
    if HAS_PREV:
        x = (k - 1) % 2
        mbarrier.wait(pfull.index(x), ((k - 1) // 2) & 1)
        # (the tile's copy landed before its owner published P; waited for here too, so
        # this warpgroup's MMAs are ordered after the copy by a barrier of its own)
        mbarrier.wait(kfull.index((k - 1) % NBUF), ((k - 1) // NBUF) & 1)
        p_prev = p_bufs.index(x).load(DOT_A)
        m_k = gl.convert_layout(m_bufs.index(x).load(ROW), gl.SliceLayout(1, S_LAYOUT))
        gl.thread_barrier()
        mbarrier.arrive(pfree.index(x))
    else:
        m_k = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, S_LAYOUT))
    if HAS_OWN:
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, q_s, qp_s, ka))[0]
        keys = gl.arange(0, BLOCK_N, gl.SliceLayout(0, S_LAYOUT))
        s = gl.where((keys < n_valid)[None, :], s, float("-inf"))
        # the maximum of the raw scores, scaled once (qk > 0); P in one FMA an element
        m_new = gl.maximum(m_k, gl.max(s, 1) * qk)
        p = gl.exp2(gl.fma(s, qk, -m_new[:, None])).to(dtype)
        y = k % 2
        mbarrier.wait(pfree.index(y), ((k - 2) // 2) & 1, pred=k >= 2)
        p_bufs.index(y).store(p)
        m_bufs.index(y).store(gl.convert_layout(m_new, ROW))
        gl.thread_barrier()
        mbarrier.arrive(pfull.index(y))
    else:
        m_new = m_k
    # every key of a tile with P published has a finite maximum; only before the
    # first is it -inf (m_ref), where alpha is 0 and the accumulators still zero
    alpha = gl.exp2(m_ref - m_new)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
    l_acc = l_acc * gl.convert_layout(alpha, gl.SliceLayout(1, L_LAYOUT))[:, None]
    # the MMAs read their A operands (P) from registers while in flight: the wait keeps
    # them alive
    if HAS_PREV:
        # the other's P was relative to the maximum before this tile
        beta = gl.convert_layout(gl.exp2(m_k - m_new), gl.SliceLayout(1, DOT_A))
        pp = (p_prev.to(gl.float32) * beta[:, None]).to(dtype)
        pp_l = gl.convert_layout(pp, DOT_L)
        v_prev = ka_bufs.index((k - 1) % NBUF).slice(W * HALF, HALF, dim=1)
        acc = warpgroup_mma(pp, v_prev, acc, is_async=True)
        l_acc = warpgroup_mma(pp_l, ones_s, l_acc, is_async=True)
    if HAS_OWN:
        p_a = gl.convert_layout(p, DOT_A)
        p_l = gl.convert_layout(p, DOT_L)
        v_own = ka_bufs.index(k % NBUF).slice(W * HALF, HALF, dim=1)
        acc = warpgroup_mma(p_a, v_own, acc, is_async=True)
        l_acc = warpgroup_mma(p_l, ones_s, l_acc, is_async=True)
    if HAS_PREV and HAS_OWN:
        acc, l_acc, _, _, _, _ = warpgroup_mma_wait(
            num_outstanding=0, deps=(acc, l_acc, pp, pp_l, p_a, p_l))
    elif HAS_PREV:
        acc, l_acc, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, l_acc, pp, pp_l))
    else:
        acc, l_acc, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, l_acc, p_a, p_l))
    gl.thread_barrier()
    if HAS_PREV:
        mbarrier.arrive(kfree.index((k - 1) % NBUF))
    if HAS_OWN:
        mbarrier.arrive(kfree.index(k % NBUF))
    return acc, l_acc, m_new


@jit
def _consumer(q_s: gl.shared_memory_descriptor, qp_s: gl.shared_memory_descriptor,
              ka_bufs: gl.shared_memory_descriptor, kp_bufs: gl.shared_memory_descriptor,
              p_bufs: gl.shared_memory_descriptor, m_bufs: gl.shared_memory_descriptor,
              ones_s: gl.shared_memory_descriptor, kfull: gl.shared_memory_descriptor,
              kfree: gl.shared_memory_descriptor, pfull: gl.shared_memory_descriptor,
              pfree: gl.shared_memory_descriptor, n_tiles: gl.tensor, n_last: gl.tensor,
              qk: gl.tensor, OUT: gl.tensor, O_PART: gl.tensor, LSE_PART: gl.tensor,
              t: gl.tensor, hb: gl.tensor, sp: gl.tensor, num_heads: gl.tensor,
              stride_xt: gl.tensor, stride_xh: gl.tensor, stride_pt: gl.tensor,
              stride_ph: gl.tensor, stride_ps: gl.tensor, stride_lt: gl.tensor,
              stride_lh: gl.tensor, single: gl.tensor, W: gl.constexpr) -> None:
    """Warpgroup ``W``: its tiles in turn with the other's, then its half of the output
    normalised and stored (warpgroup 0 also stores the log-sum-exp of a split)."""
    NBUF: gl.constexpr = ka_bufs.type.shape[0]
    BLOCK_N: gl.constexpr = ka_bufs.type.shape[1]
    KV_LORA: gl.constexpr = ka_bufs.type.shape[2]
    BLOCK_H: gl.constexpr = q_s.type.shape[0]
    HALF: gl.constexpr = KV_LORA // 2
    ONES: gl.constexpr = ones_s.type.shape[1]
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    L_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ONES, 16])
    ROW: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    CH: gl.constexpr = 128 if KV_LORA >= 128 else KV_LORA

    acc = gl.zeros([BLOCK_H, HALF], gl.float32, O_LAYOUT)
    l_acc = gl.zeros([BLOCK_H, ONES], gl.float32, L_LAYOUT)
    m_ref = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, S_LAYOUT))
    n_own = (n_tiles - W + 1) // 2  # tiles k < n_tiles with k % 2 == W
    first = 0
    if W == 0:
        if n_own > 0:  # tile 0 has no tile before it
            acc, l_acc, m_ref = _step(
                0, acc, l_acc, m_ref, q_s, qp_s, ka_bufs, kp_bufs, p_bufs, m_bufs, ones_s,
                kfull, kfree, pfull, pfree, n_tiles, n_last, qk, W, False, True, KV_LORA,
                BLOCK_H, BLOCK_N, NBUF, CH, S_LAYOUT, O_LAYOUT, L_LAYOUT, ROW, LOAD)
        first = 1
    for i in range(first, n_own):
        acc, l_acc, m_ref = _step(
            2 * i + W, acc, l_acc, m_ref, q_s, qp_s, ka_bufs, kp_bufs, p_bufs, m_bufs,
            ones_s, kfull, kfree, pfull, pfree, n_tiles, n_last, qk, W, True, True,
            KV_LORA, BLOCK_H, BLOCK_N, NBUF, CH, S_LAYOUT, O_LAYOUT, L_LAYOUT, ROW, LOAD)
    if n_tiles > 0 and (n_tiles - 1) % 2 != W:  # the other's last tile
        acc, l_acc, m_ref = _step(
            n_tiles, acc, l_acc, m_ref, q_s, qp_s, ka_bufs, kp_bufs, p_bufs, m_bufs,
            ones_s, kfull, kfree, pfull, pfree, n_tiles, n_last, qk, W, True, False,
            KV_LORA, BLOCK_H, BLOCK_N, NBUF, CH, S_LAYOUT, O_LAYOUT, L_LAYOUT, ROW, LOAD)

    # every column of l_acc holds the row's sum
    l_i = gl.convert_layout(gl.max(l_acc, 1), gl.SliceLayout(1, O_LAYOUT))
    seen = l_i > 0.0
    out = acc * (1.0 / gl.where(seen, l_i, 1.0))[:, None]
    oh = hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, O_LAYOUT))
    oc = W * HALF + gl.arange(0, HALF, gl.SliceLayout(0, O_LAYOUT))
    omask = (oh < num_heads)[:, None]
    # one split writes the output, more their parts (masks, not a branch: the flag is a
    # run-time value in a partition)
    gl.store(OUT + t * stride_xt + oh[:, None] * stride_xh + oc[None, :],
             out.to(OUT.dtype.element_ty), mask=omask & single)
    parts = single == 0
    gl.store(O_PART + t * stride_pt + oh[:, None] * stride_ph + sp * stride_ps + oc[None, :],
             out, mask=omask & parts)
    if W == 0:
        m_row = gl.convert_layout(m_ref, gl.SliceLayout(1, O_LAYOUT))
        lse = gl.where(seen, m_row + gl.log2(gl.where(seen, l_i, 1.0)), float("-inf"))
        gl.store(LSE_PART + t * stride_lt + oh * stride_lh + sp, lse,
                 mask=(oh < num_heads) & parts)


@jit
def _first(q_s: gl.shared_memory_descriptor, qp_s: gl.shared_memory_descriptor,
           ka_bufs: gl.shared_memory_descriptor, kp_bufs: gl.shared_memory_descriptor,
           p_bufs: gl.shared_memory_descriptor, m_bufs: gl.shared_memory_descriptor,
           ones_s: gl.shared_memory_descriptor, kfull: gl.shared_memory_descriptor,
           kfree: gl.shared_memory_descriptor, pfull: gl.shared_memory_descriptor,
           pfree: gl.shared_memory_descriptor, n_tiles: gl.tensor, n_last: gl.tensor,
           qk: gl.tensor, OUT: gl.tensor, O_PART: gl.tensor, LSE_PART: gl.tensor,
           t: gl.tensor, hb: gl.tensor, sp: gl.tensor, num_heads: gl.tensor,
           stride_xt: gl.tensor, stride_xh: gl.tensor, stride_pt: gl.tensor,
           stride_ph: gl.tensor, stride_ps: gl.tensor, stride_lt: gl.tensor,
           stride_lh: gl.tensor, single: gl.tensor) -> None:
    """The first warpgroup (tiles 0, 2, ...; columns ``0 .. L / 2``)."""
    _consumer(q_s, qp_s, ka_bufs, kp_bufs, p_bufs, m_bufs, ones_s, kfull, kfree, pfull,
              pfree, n_tiles, n_last, qk, OUT, O_PART, LSE_PART, t, hb, sp, num_heads,
              stride_xt, stride_xh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
              single, 0)


@jit
def _second(q_s: gl.shared_memory_descriptor, qp_s: gl.shared_memory_descriptor,
            ka_bufs: gl.shared_memory_descriptor, kp_bufs: gl.shared_memory_descriptor,
            p_bufs: gl.shared_memory_descriptor, m_bufs: gl.shared_memory_descriptor,
            ones_s: gl.shared_memory_descriptor, kfull: gl.shared_memory_descriptor,
            kfree: gl.shared_memory_descriptor, pfull: gl.shared_memory_descriptor,
            pfree: gl.shared_memory_descriptor, n_tiles: gl.tensor, n_last: gl.tensor,
            qk: gl.tensor, OUT: gl.tensor, O_PART: gl.tensor, LSE_PART: gl.tensor,
            t: gl.tensor, hb: gl.tensor, sp: gl.tensor, num_heads: gl.tensor,
            stride_xt: gl.tensor, stride_xh: gl.tensor, stride_pt: gl.tensor,
            stride_ph: gl.tensor, stride_ps: gl.tensor, stride_lt: gl.tensor,
            stride_lh: gl.tensor, single: gl.tensor) -> None:
    """The second warpgroup (tiles 1, 3, ...; columns ``L / 2 .. L``)."""
    _consumer(q_s, qp_s, ka_bufs, kp_bufs, p_bufs, m_bufs, ones_s, kfull, kfree, pfull,
              pfree, n_tiles, n_last, qk, OUT, O_PART, LSE_PART, t, hb, sp, num_heads,
              stride_xt, stride_xh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
              single, 1)


@jit
def mla_decode_seesaw_kernel(
    Q: gl.tensor, Q_PE: gl.tensor, LAT_DESC: tma.tensor_descriptor,
    PE_DESC: tma.tensor_descriptor, BT: gl.tensor, TOK_REQ: gl.tensor, TOK_POS: gl.tensor,
    OUT: gl.tensor, O_PART: gl.tensor, LSE_PART: gl.tensor,
    stride_qt: gl.tensor, stride_qh: gl.tensor, stride_et: gl.tensor, stride_eh: gl.tensor,
    stride_bt: gl.tensor, stride_xt: gl.tensor, stride_xh: gl.tensor, stride_pt: gl.tensor,
    stride_ph: gl.tensor, stride_ps: gl.tensor, stride_lt: gl.tensor, stride_lh: gl.tensor,
    num_heads: gl.tensor, sm_scale: gl.tensor, num_splits: gl.tensor,
    KV_LORA: gl.constexpr, ROPE: gl.constexpr, PAGE: gl.constexpr, SINGLE: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr,
    num_warps: gl.constexpr,
) -> None:
    """One (head tile, split, token) program; grid ``(head tiles, splits, tokens)``;
    arguments as for :func:`~vllm.attention.ops.gluon_mla_decode_kernels.mla_decode_gluon_kernel`
    (16-bit caches in the model's dtype). ``num_warps`` 4: the first warpgroup; the
    second and the loader warp are the partitions' own."""
    gl.static_assert(num_warps == 4, "the default partition is one warpgroup")
    gl.static_assert(PAGE % BLOCK_N == 0, "a tile inside one page")
    dtype: gl.constexpr = Q.dtype.element_ty
    ONES: gl.constexpr = 16
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    CH: gl.constexpr = 128 if KV_LORA >= 128 else KV_LORA

    hb = gl.program_id(0)
    sp = gl.program_id(1)
    t = gl.program_id(2).to(gl.int64)
    req = gl.load(TOK_REQ + t).to(gl.int64)
    n_keys = gl.load(TOK_POS + t) + 1
    per_split = gl.cdiv(gl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
    start = sp * per_split
    end = gl.maximum(gl.minimum(start + per_split, n_keys), start)
    n_tiles = gl.cdiv(end - start, BLOCK_N)
    n_last = end - start - (n_tiles - 1) * BLOCK_N  # rows of the last tile

    ka_bufs = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_N, KV_LORA], LAT_DESC.layout)
    kp_bufs = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_N, ROPE], PE_DESC.layout)
    p_bufs = gl.allocate_shared_memory(
        dtype, [2, BLOCK_H, BLOCK_N], gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N],
                                                                           dtype))
    m_bufs = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H],
                                       gl.SwizzledSharedLayout(1, 1, 1, [0]))
    kfull = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    kfree = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    pfull = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF):
        mbarrier.init(kfull.index(i), count=1)
        mbarrier.init(kfree.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(pfull.index(i), count=1)
        mbarrier.init(pfree.index(i), count=1)

    q_s = gl.allocate_shared_memory(
        dtype, [BLOCK_H, KV_LORA], gl.NVMMASharedLayout.get_default_for([BLOCK_H, KV_LORA],
                                                                        dtype))
    qp_s = gl.allocate_shared_memory(
        dtype, [BLOCK_H, ROPE], gl.NVMMASharedLayout.get_default_for([BLOCK_H, ROPE], dtype))
    offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, LOAD))
    mask_h = (offs_h < num_heads)[:, None]
    cols = gl.arange(0, CH, gl.SliceLayout(0, LOAD))
    q_row = Q + t * stride_qt + offs_h[:, None] * stride_qh
    for c in gl.static_range(KV_LORA // CH):
        q_s.slice(c * CH, CH, dim=1).store(
            gl.load(q_row + c * CH + cols[None, :], mask=mask_h, other=0.0))
    offs_r = gl.arange(0, ROPE, gl.SliceLayout(0, LOAD))
    qp_s.store(gl.load(Q_PE + t * stride_et + offs_h[:, None] * stride_eh + offs_r[None, :],
                       mask=mask_h, other=0.0))
    ones_s = gl.allocate_shared_memory(
        dtype, [BLOCK_N, ONES], gl.NVMMASharedLayout.get_default_for([BLOCK_N, ONES], dtype),
        gl.full([BLOCK_N, ONES], 1.0, dtype, LOAD))
    fence_async_shared()
    gl.thread_barrier()
    qk = sm_scale * LOG2E
    # a partition's arguments are run-time values: the compile-time flags as scalars
    single = (n_tiles * 0 + SINGLE) != 0

    args = (q_s, qp_s, ka_bufs, kp_bufs, p_bufs, m_bufs, ones_s, kfull, kfree, pfull, pfree,
            n_tiles, n_last, qk, OUT, O_PART, LSE_PART, t, hb, sp, num_heads, stride_xt,
            stride_xh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, single)
    page = n_tiles * 0 + PAGE
    gl.warp_specialize([
        (_first, args),
        (_second, args),
        (_loader, (LAT_DESC, PE_DESC, BT, req, start, n_tiles, stride_bt, page, ka_bufs,
                   kp_bufs, kfull, kfree)),
    ], [4, 1], [240, 24])
