"""The dense MLA decode for Hopper (sm_90) for layers of few heads (at most 32), with the
heads as the N of both MMAs (Gluon; caches in the model's 16-bit dtype or scaled fp8;
imported on first use).

A warpgroup MMA has 64 rows (its M). The lead kernel
(:mod:`vllm.attention.ops.gluon_mla_lead_kernels`) puts a token's heads there, so with
16 heads three quarters of every MMA are padding and a tile costs what it costs with 64
heads. Here the heads are the N (16 or 32 columns, which an MMA takes in steps of 8):

    S^T  = K @ Q^T        K: [64 keys, L + R] (the tile as stored), Q^T: [L + R, heads]
    O^T += K^T @ P^T      K^T: [L, 64 keys] (the same tile read transposed), P^T: [64, heads]

so a tile is 36 ``m64nHk16`` score MMAs and 4 x ``L / 64`` value MMAs of the same shape,
about a quarter of the lead kernel's tensor work at 16 heads, and the softmax runs down
the columns (a head's keys are rows: its maximum and sum cross the four warps, through
shared memory). The value MMAs read their A operand transposed from the tile in shared
memory (a 16-bit operand may be either major order), so no copy of the tile is made.

Partitions: this warpgroup (the scores, the softmax, the values, the output) and the
lead kernel's own producers, unchanged: its loader warp (a 16-bit cache, by TMA) or its
widening warpgroup (an fp8 cache, widened exactly to float16: the dots run in float16 on
the stored values, the query scaled into float16 a head at a time), filling two tile
buffers ahead of this one (``kfull`` / ``kfree``: one arrival, after a tile's value
MMAs). The last tile of a split may be partial: with a 16-bit cache the rows past the
request's last position are zeroed in shared memory after the score MMAs (which see
them masked) and before the value MMAs read them (a slot past the end may hold NaN, and
a zero probability times NaN is NaN); the widening warpgroup writes them as zeros.
"""

from __future__ import annotations

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from vllm.attention.ops.gluon_mla_lead_kernels import (
    _load,
    _query_to_shared,
    _store_half,
    _widener,
    _zero_rows,
    jit,
)
from vllm.attention.ops.triton_mla_decode_kernels import split_range

LOAD_REGS: gl.constexpr = gl.constexpr(24)
"""Registers a thread of the loader warp (a 16-bit cache)."""
WIDEN_REGS: gl.constexpr = gl.constexpr(152)
"""Registers a thread of the widening warpgroup (an fp8 cache): two warpgroups share an
SM's 64 K registers here, and at the lead kernel's 112 the widening spilled 8 bytes."""


@jit
def _heads_n(q_s: gl.shared_memory_descriptor, qp_s: gl.shared_memory_descriptor,
             ka_bufs: gl.shared_memory_descriptor, kp_bufs: gl.shared_memory_descriptor,
             p_s: gl.shared_memory_descriptor, kfull: gl.shared_memory_descriptor,
             kfree: gl.shared_memory_descriptor, n_tiles: gl.tensor, n_last: gl.tensor,
             qk_s: gl.shared_memory_descriptor, oscale: gl.tensor, OUT: gl.tensor,
             O_PART: gl.tensor, LSE_PART: gl.tensor, t: gl.tensor, hb: gl.tensor,
             sp: gl.tensor, num_heads: gl.tensor, stride_xt: gl.tensor,
             stride_xh: gl.tensor, stride_pt: gl.tensor, stride_ph: gl.tensor,
             stride_ps: gl.tensor, stride_lt: gl.tensor, stride_lh: gl.tensor,
             single: gl.tensor, zero: gl.tensor) -> None:
    """The computing warpgroup: every tile's scores ``S^T`` (keys as rows, heads as
    columns), the online softmax down the columns, ``P^T`` through shared memory into
    both halves of the values; then the output and the log-sum-exp of a split.
    ``zero``: rows past the end of a split's last tile are zeroed here (a 16-bit cache,
    copied as it is; a run-time flag, as a partition's arguments are)."""
    BLOCK_N: gl.constexpr = ka_bufs.type.shape[1]
    HALF: gl.constexpr = ka_bufs.type.shape[2]
    BLOCK_H: gl.constexpr = q_s.type.shape[1]
    dtype: gl.constexpr = q_s.dtype
    # the scores [keys, heads] and the value accumulators [L / 2, heads]: one layout
    ACC: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16])
    HEADS: gl.constexpr = gl.SliceLayout(0, ACC)
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    acc0 = gl.zeros([HALF, BLOCK_H], gl.float32, ACC)
    acc1 = gl.zeros([HALF, BLOCK_H], gl.float32, ACC)
    l_i = gl.zeros([BLOCK_H], gl.float32, HEADS)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, HEADS)
    qk = qk_s.load(HEADS)  # what turns a head's raw scores into base-2 logits (> 0)
    for k in range(n_tiles):
        b = k % 2
        mbarrier.wait(kfull.index(b), (k // 2) & 1)
        s = warpgroup_mma(kp_bufs.index(b), qp_s.permute((1, 0)),
                          gl.zeros([BLOCK_N, BLOCK_H], gl.float32, ACC),
                          use_acc=False, is_async=True)
        s = warpgroup_mma(ka_bufs.index(2 * b), q_s.index(0).permute((1, 0)), s,
                          is_async=True)
        s = warpgroup_mma(ka_bufs.index(2 * b + 1), q_s.index(1).permute((1, 0)), s,
                          is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, q_s, qp_s))[0]
        n_valid = gl.where(k == n_tiles - 1, n_last, BLOCK_N)
        if n_valid < BLOCK_N:
            if zero:
                _zero_rows(ka_bufs.index(2 * b), n_valid, LOAD)
                _zero_rows(ka_bufs.index(2 * b + 1), n_valid, LOAD)
            keys = gl.arange(0, BLOCK_N, gl.SliceLayout(1, ACC))
            s = gl.where((keys < n_valid)[:, None], s, float("-inf"))
        # a head's maximum over the tile's keys (down a column: across the warps), the
        # raw scores' scaled once (qk > 0); P in one FMA an element. Every tile has a
        # key, so m_new is finite.
        m_new = gl.maximum(m_i, gl.max(s, 0) * qk)
        p = gl.exp2(gl.fma(s, qk[None, :], -m_new[None, :]))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 0)
        m_i = m_new
        # P^T, the value MMAs' B operand (the last ones to read it were waited for)
        p_s.store(p.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        acc0 = acc0 * alpha[None, :]
        acc1 = acc1 * alpha[None, :]
        acc0 = warpgroup_mma(ka_bufs.index(2 * b).permute((1, 0)), p_s, acc0, is_async=True)
        acc1 = warpgroup_mma(ka_bufs.index(2 * b + 1).permute((1, 0)), p_s, acc1,
                             is_async=True)
        # waited for here, not across the loop's back edge (ptxas serialises every MMA
        # of a kernel that leaves one in flight under others: C7515)
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, p_s))
        mbarrier.arrive(kfree.index(b))

    # the output [heads, L]: the accumulators transposed in registers (which register
    # holds which element changes, not what a register holds)
    _store_half(gl.permute(acc0, (1, 0)), l_i, OUT, O_PART, t, hb, sp, num_heads,
                stride_xt, stride_xh, stride_pt, stride_ph, stride_ps, single, oscale, 0)
    _store_half(gl.permute(acc1, (1, 0)), l_i, OUT, O_PART, t, hb, sp, num_heads,
                stride_xt, stride_xh, stride_pt, stride_ph, stride_ps, single, oscale, 1)
    seen = l_i > 0.0
    lse = gl.where(seen, m_i + gl.log2(gl.where(seen, l_i, 1.0)), float("-inf"))
    lh = hb * BLOCK_H + gl.arange(0, BLOCK_H, HEADS)
    gl.store(LSE_PART + t * stride_lt + lh * stride_lh + sp, lse,
             mask=(lh < num_heads) & (single == 0))


@jit
def mla_decode_few_heads_kernel(
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
    """One (head tile, split, token) program; grid ``(head tiles, splits, tokens)``;
    the arguments of :func:`~vllm.attention.ops.gluon_mla_lead_kernels.mla_decode_lead_kernel`
    (``LAT_DESC``: ``[64, L / 2]`` blocks, used for 16-bit caches only), with
    ``BLOCK_H`` 16 or 32 heads a program. ``num_warps`` 4: the computing warpgroup; the
    loader warp or the widening warpgroup (``FP8`` 1: E4M3, 2: E5M2) are partitions of
    their own."""
    gl.static_assert(num_warps == 4, "the default partition is one warpgroup")
    gl.static_assert(PAGE % BLOCK_N == 0, "a tile inside one page")
    gl.static_assert(BLOCK_N == 64, "the keys are the M of a warpgroup MMA")
    gl.static_assert(BLOCK_H == 16 or BLOCK_H == 32, "16 or 32 heads, the MMAs' N")
    gl.static_assert(KV_LORA % 128 == 0, "each latent half a multiple of the MMA's M")
    dtype: gl.constexpr = gl.float16 if FP8 != 0 else Q.dtype.element_ty
    HALF: gl.constexpr = KV_LORA // 2
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    F32_ROW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    hb = gl.program_id(0)
    sp = gl.program_id(1)
    t = gl.program_id(2).to(gl.int64)  # offsets of t can pass 2**31
    req = gl.load(TOK_REQ + t).to(gl.int64)
    n_keys = gl.load(TOK_POS + t) + 1
    start, end = split_range(n_keys, num_splits, sp, BLOCK_N)
    n_tiles = gl.cdiv(end - start, BLOCK_N)
    n_last = end - start - (n_tiles - 1) * BLOCK_N  # rows of the last tile

    # two buffers of a tile each: [buffer * 2 + half] latent halves, [buffer] rope
    if FP8 != 0:
        ka_bufs = gl.allocate_shared_memory(
            dtype, [4, BLOCK_N, HALF], gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF],
                                                                            dtype))
        kp_bufs = gl.allocate_shared_memory(
            dtype, [2, BLOCK_N, ROPE], gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE],
                                                                            dtype))
    else:
        ka_bufs = gl.allocate_shared_memory(dtype, [4, BLOCK_N, HALF], LAT_DESC.layout)
        kp_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE], PE_DESC.layout)
    p_s = gl.allocate_shared_memory(
        dtype, [BLOCK_N, BLOCK_H], gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H],
                                                                        dtype))
    qk_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], F32_ROW)
    kfull = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kfull.index(i), count=1)
        mbarrier.init(kfree.index(i), count=1)

    # the query in halves of the latent and the rope part: the score MMAs' B operands
    # (K-major, as stored)
    q_s = gl.allocate_shared_memory(
        dtype, [2, BLOCK_H, HALF], gl.NVMMASharedLayout.get_default_for([BLOCK_H, HALF],
                                                                        dtype))
    qp_s = gl.allocate_shared_memory(
        dtype, [BLOCK_H, ROPE], gl.NVMMASharedLayout.get_default_for([BLOCK_H, ROPE], dtype))
    # an fp8 cache: the query scaled into float16's top binades
    oscale = _query_to_shared(Q, Q_PE, t, hb, num_heads, stride_qt, stride_qh, stride_et,
                              stride_eh, sm_scale, K_SCALE, q_s, qp_s, qk_s,
                              14 if FP8 != 0 else 0, LOAD)
    # a partition's arguments are run-time values: the compile-time flag as a scalar
    single = (n_tiles * 0 + SINGLE) != 0
    zero = (n_tiles * 0 + (1 if FP8 == 0 else 0)) != 0

    args = (q_s, qp_s, ka_bufs, kp_bufs, p_s, kfull, kfree, n_tiles, n_last, qk_s, oscale,
            OUT, O_PART, LSE_PART, t, hb, sp, num_heads, stride_xt, stride_xh, stride_pt,
            stride_ph, stride_ps, stride_lt, stride_lh, single, zero)
    page = n_tiles * 0 + PAGE
    if FP8 == 0:
        largs = (LAT_DESC, PE_DESC, BT, req, start, n_tiles, stride_bt, page, ka_bufs,
                 kp_bufs, kfull, kfree)
        gl.warp_specialize([
            (_heads_n, args),
            (_load, largs),
        ], [1], [LOAD_REGS])
    else:
        wargs = (C, BT, req, start, end, n_tiles, stride_bt, stride_cb, stride_cs, page,
                 ka_bufs, kp_bufs, kfull, kfree)
        gl.warp_specialize([
            (_heads_n, args),
            (_widener, wargs),
        ], [4], [WIDEN_REGS])
