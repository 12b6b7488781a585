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
the columns (a head's maximum crosses the four warps, through shared memory; the row
sums are kept per element and summed across the warps once, after the last tile). The
value MMAs read their A operand transposed from the tile in shared memory (a 16-bit
operand may be either major order), so no copy of the tile is made.

Partitions (mbarriers in brackets):

* the scoring warpgroup (:func:`_scores_n`): tile ``k``'s score MMAs once it has landed
  (``kfull[k % 2]``), the softmax, ``P^T`` and the heads' rescale factors into buffer
  ``k % 2`` (``pfull``, once ``pfree`` says the value MMAs of tile ``k - 2`` are done
  with it); the last tile of a split may be partial: its rows past the request's last
  position are masked in the scores and zeroed in the tile before ``P^T`` is published
  (a slot past the end may hold NaN, and a zero probability times NaN is NaN);
* the values' warpgroup (:func:`_values_n`): both value MMAs of each tile, then the
  output; its arrivals free ``P^T``'s buffer and the tile's (``kfree``);
* the producer: the lead kernel's loader warp (TMA into the two tile buffers of a
  16-bit cache, or into the ring of an fp8 cache).

An fp8 cache (E4M3 or E5M2) is not widened into a copy in shared memory. Its bytes land
by TMA in a ring of 5 stages (4 at 32 heads: the query and ``P^T`` take twice the
shared memory), and both warpgroups read them from there into the A fragments of their
MMAs, which take an operand from registers, widening them exactly to float16 on the way
(:func:`_scores_r`, :func:`_values_r`; a stage is free once both have read it); the
scoring warpgroup takes two tiles a step (one maximum across its warps, one
publication of ``P^T`` for both). The
dots run in float16 on the stored values; the query is scaled into float16 a head at a
time, as in the lead kernel. An MMA fixes which elements of its operand a thread holds,
but not which stored column is which of its K or M:

* a score operand's K is the latent (and rope) column: a thread reads 16 consecutive
  bytes of each of its two rows (one 16-byte load each, conflict-free under the
  copies' 128-byte swizzle) and the query's columns are stored in the same order
  (:func:`~vllm.attention.ops.gluon_mla_lead_kernels.score_order`);
* a value operand's M is the latent column: a thread reads the 8 consecutive bytes of
  each of its keys that are its 8 rows of the accumulators (:func:`value_layout`), and
  the accumulators' rows are put back in the latent's order before the output is
  stored (:func:`value_order`); a register's two keys are paired by byte permutes.

Both reorderings are reshapes and permutes of tensors in registers: which register
holds which element changes, nothing moves. Against the widening warpgroup this kernel
had before (a float16 copy of every tile, its fence and its barriers), the E4M3 decode
at 16 heads, batch 64 and 4096 keys went from 73.4 to 62.8-64.9 us on an H200, and
with two tiles a step to 58.6 us.

With a bfloat16 query, an E4M3 cache's scores skip the registers (:func:`_tile_scores_f8`,
:func:`fp8_score_mmas`): fp8 MMAs (``m64nXk32``, E4M3 x E4M3) of the stored bytes as
they landed by the query in two E4M3 parts a head at a time (a power of two puts the
head's largest magnitude in ``[128, 256)``; the high part is the query rounded, the
middle one the remainder times 16, rounded), both parts in one MMA (``N`` twice the
heads) and added in registers. The two parts hold a bfloat16 query exactly down to
``2**-6`` (``2**-13`` of the head's largest magnitude). They would hold a float16 one
to 8 of its 11 significant bits, so a float16 query keeps the bytes widened in
registers, as an E5M2 cache does. The values keep the widening into registers (an fp8
MMA takes its operands K-major only, and the stored tile is the values' M-major).
"""

from __future__ import annotations

from typing import Any

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from vllm.attention.ops.gluon_mla_decode_kernels import (
    LOG2E,
    _program_keys,
    constexpr_function,
    jit,
    widen_fp8,
)
from vllm.attention.ops.gluon_mla_lead_kernels import (
    _load,
    _query_buffers,
    _query_pointers,
    _query_to_shared,
    _store_half,
    _store_lse,
    _tile_buffers,
    _zero_rows,
    dims_order,
    log2_int,
    reorder,
    row_softmax,
    to_score_order,
)
from vllm.attention.ops.triton_mla_decode_kernels import row_powers

LOAD_REGS: gl.constexpr = gl.constexpr(24)
"""Registers a thread of the loader warp (a 16-bit cache)."""
VALUE_REGS: gl.constexpr = gl.constexpr(152)
"""Registers a thread of the values' warpgroup at 16 heads (its two ``[L / 2, heads]``
float32 accumulators take 64)."""
VALUE_REGS_32: gl.constexpr = gl.constexpr(192)
"""The same at 32 heads (the accumulators take 128)."""
TILES_A_STEP: gl.constexpr = gl.constexpr(2)
"""Tiles the scoring warpgroup takes a step with an fp8 cache (one maximum across its
warps and one publication of ``P^T`` a step): 2 measured 58.6 us against 63.5 for 1 (16
heads, E4M3, ``benchmarks/results/h200/2026-12-02-5948e90``); more is not measured."""
MID_SCALE: gl.constexpr = gl.constexpr(16.0)
"""What the middle part of an fp8 query is scaled by (its range: the remainder of the
high part is at most 8 of a ``[128, 256)`` magnitude)."""
VALUE_REGS_FP8: gl.constexpr = gl.constexpr(240)
"""Registers a thread of the values' warpgroup with an fp8 cache (its accumulators, and
two A operands of ``TK`` keys each in registers: one in flight, one read)."""
VALUE_REGS_64: gl.constexpr = gl.constexpr(176)
"""Registers a thread of each of the two values' warpgroups at 64 heads (an fp8 cache):
its ``[L / 2, 64]`` float32 accumulator takes 128."""


@constexpr_function
def tiles_a_step(BLOCK_H: Any) -> int:
    """Tiles the scoring warpgroup of an fp8 cache takes a step: :data:`TILES_A_STEP`
    up to 32 heads, one at 64 (a tile's scores take twice the registers)."""
    return TILES_A_STEP if BLOCK_H <= 32 else 1


@constexpr_function
def value_groups(BLOCK_H: Any) -> int:
    """The values' warpgroups: one up to 32 heads (both halves of the latent), two at 64
    (a half each: a ``[L / 2, 64]`` float32 accumulator is 128 registers a thread)."""
    return 1 if BLOCK_H <= 32 else 2


@constexpr_function
def fp8_score_mmas(cache_ty: Any, q_ty: Any) -> bool:
    """Whether the scoring warpgroup takes the scores as fp8 MMAs of the stored bytes
    (:func:`_tile_scores_f8`): an E4M3 cache and a bfloat16 query, whose two E4M3 parts
    hold its 8 significant bits. A float16 query has 11, which two parts do not hold,
    so it keeps the bytes widened in registers and float16 dots, as an E5M2 cache
    does: at 16 heads, batch 64 and 4096 keys the output's error against float64 was
    6.9e-4 with the two parts and 2.4e-4 widened, for 49.3 against
    51.9 us (``benchmarks/results/h200/2026-12-03-f9010d3``)."""
    return bool(cache_ty == gl.float8e4nv and q_ty == gl.bfloat16)


@constexpr_function
def score_layout(W: Any) -> gl.DistributedLinearLayout:
    """How the scoring warpgroup reads ``[64, W]`` stored bytes (keys, columns): a
    thread 16 consecutive bytes (or ``W / 4``) of two rows, the keys of its A fragments
    (``W / 4 * 2`` bytes a thread); :func:`to_score_order` then puts the columns in the
    MMA's order."""
    regs = [[0, 1], [0, 2], *[[0, 4 << i] for i in range(log2_int(W) - 4)], [8, 0]]
    lanes = [[0, W // 4], [0, W // 2], [1, 0], [2, 0], [4, 0]]
    return gl.DistributedLinearLayout(regs, lanes, [[16, 0], [32, 0]], [], [64, W])


@constexpr_function
def _value_bits(HALF: int) -> tuple[list[str], list[str]]:
    # a stored column's bits and the value operand's row's (its M): the rows a thread
    # holds (m3 and the blocks of 64) are consecutive bytes
    a = log2_int(HALF)
    blocks = [f"m{6 + i}" for i in range(a - 6)]
    return ["m3", *blocks, "m0", "m1", "m2", "m4", "m5"], [f"m{i}" for i in range(a)]


@constexpr_function
def value_layout(TK: Any, HALF: Any) -> gl.DistributedLinearLayout:
    """How the values' warpgroup reads ``[TK, HALF]`` stored bytes (keys, latent
    columns): a thread ``HALF / 32`` consecutive bytes of each of its keys, the rows of
    its A fragments (the latent's columns are the value MMAs' M)."""
    nb = log2_int(HALF) - 6
    regs = [[0, 1 << i] for i in range(1 + nb)]
    regs += [[1, 0], [8, 0], *[[16 << i, 0] for i in range(log2_int(TK) - 4)]]
    lanes = [[2, 0], [4, 0], *[[0, 1 << (1 + nb + i)] for i in range(3)]]
    warps = [[0, 1 << (4 + nb)], [0, 1 << (5 + nb)]]
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [TK, HALF])


@constexpr_function
def value_order(HALF: Any, N: Any, back: Any) -> tuple[list[int], list[int]]:
    """The shape and dims' order that turn ``[HALF, N]`` (stored columns as rows) into
    the value operand's order of rows, or (``back``) its rows into stored columns."""
    stored, operand = _value_bits(HALF)
    src, dst = (operand, stored) if back else (stored, operand)
    return [2] * len(stored) + [N], [*dims_order(src, dst), len(stored)]


@jit
def _after_the_grid_before() -> None:
    """Programmatic dependent launch (the launcher sets ``launch_pdl``): wait until the
    grids this one depends on have completed and their writes are visible (no read of
    this kernel comes before; the partitions start after it), then let the next grid,
    the splits' combine (which waits likewise), launch while this one runs. Both
    instructions do nothing in a grid launched without it (Triton's own
    ``griddepcontrol`` wrappers)."""
    gdc_wait()
    gdc_launch_dependents()


@jit
def _score_operand(raw: gl.shared_memory_descriptor, FP8: gl.constexpr,
                   DOT: gl.constexpr) -> gl.tensor:
    """A score MMA's A operand from a tile's stored bytes ``raw`` (``[64, W]``): read 16
    bytes a thread, put in the operand's order of columns and widened exactly to
    float16 in registers."""
    x = to_score_order(raw.load(score_layout(raw.type.shape[1])))
    return widen_fp8(gl.convert_layout(x, DOT), FP8)


@jit
def _value_operand(raw: gl.shared_memory_descriptor, n_valid: gl.tensor, k0: gl.tensor,
                   FP8: gl.constexpr, DOT: gl.constexpr) -> gl.tensor:
    """A value MMA's A operand (``[HALF, TK]``: the tile's latent transposed) from the
    stored bytes ``raw`` (``[TK, HALF]``, keys ``k0 ..`` of the tile) in the operand's
    order of rows, widened exactly to float16 in registers; keys at or past ``n_valid``
    as zeros (their bytes may be anything, NaN too, and a zero probability times NaN
    is NaN)."""
    TK: gl.constexpr = raw.type.shape[0]
    HALF: gl.constexpr = raw.type.shape[1]
    LAYOUT: gl.constexpr = value_layout(TK, HALF)
    x = raw.load(LAYOUT)
    if n_valid < k0 + TK:
        keys = k0 + gl.arange(0, TK, gl.SliceLayout(1, LAYOUT))
        x = gl.where((keys < n_valid)[:, None], x, gl.zeros_like(x))
    SHAPE: gl.constexpr = value_order(HALF, TK, False)[0]
    ORDER: gl.constexpr = value_order(HALF, TK, False)[1]
    x = reorder(gl.permute(x, (1, 0)), SHAPE, ORDER)
    return widen_fp8(gl.convert_layout(x, DOT), FP8)


@jit
def _append(items: gl.tensor, x: gl.tensor) -> gl.tensor:
    """``items + (x,)`` (a tuple grown in a compile-time loop)."""
    return items + (x,)


@jit
def _softmax_step(s: gl.tensor, m_i: gl.tensor, l_part: gl.tensor, qk: gl.tensor,
                  p_bufs: gl.shared_memory_descriptor, a_bufs: gl.shared_memory_descriptor,
                  pfree: gl.shared_memory_descriptor, pfull: gl.shared_memory_descriptor,
                  j: gl.tensor) -> gl.tensor:
    """Step ``j`` of the online softmax down the columns over the scores of its ``T``
    tiles (the tuple ``s``): a head's maximum over the step's keys (across the warps,
    once), the raw scores scaled once (``qk`` > 0), ``P`` in one FMA an element; ``P^T``
    into buffers ``T b .. T b + T - 1`` and the heads' rescale factors into
    ``a_bufs[b]`` (``b = j % 2``) once the value MMAs of step ``j - 2`` are done with
    them, visible to the value MMAs (every warp's) before ``pfull[b]``. Returns the
    running maxima and the per-element row sums."""
    T: gl.constexpr = len(s)
    b = j % 2
    s_max = s[0]
    for i in gl.static_range(1, T):
        s_max = gl.maximum(s_max, s[i])
    m_new = gl.maximum(m_i, gl.max(s_max, 0) * qk)
    p = ()
    for i in gl.static_range(T):
        p = _append(p, gl.exp2(gl.fma(s[i], qk[None, :], -m_new[None, :])))
    alpha = gl.exp2(m_i - m_new)
    l_part = l_part * alpha[None, :]
    for i in gl.static_range(T):
        l_part = l_part + p[i]
    mbarrier.wait(pfree.index(b), ((j // 2) - 1) & 1, pred=j >= 2)
    for i in gl.static_range(T):
        p_bufs.index(T * b + i).store(p[i].to(p_bufs.dtype))
    a_bufs.index(b).store(alpha)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(pfull.index(b))
    return m_new, l_part


@jit
def _finish_scores(m_i: gl.tensor, l_part: gl.tensor, l_s: gl.shared_memory_descriptor,
                   lfull: gl.shared_memory_descriptor, LSE_PART: gl.tensor, t: gl.tensor,
                   hb: gl.tensor, sp: gl.tensor, num_heads: gl.tensor, stride_lt: gl.tensor,
                   stride_lh: gl.tensor, single: gl.tensor) -> None:
    """After the last tile: the row sums kept per element reduced across the warps (once)
    and handed to the values' warpgroup (``lfull``), and the split's log-sum-exp out."""
    l_i = gl.sum(l_part, 0)
    l_s.store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(lfull.index(0))
    _store_lse(m_i, l_i, 0.0, LSE_PART, t, hb, sp, num_heads, stride_lt, stride_lh, single)


@jit
def _tile_scores(st_a: gl.shared_memory_descriptor, st_p: gl.shared_memory_descriptor,
                 kfull: gl.shared_memory_descriptor, kfree: gl.shared_memory_descriptor,
                 q_s: gl.shared_memory_descriptor, qp_s: gl.shared_memory_descriptor,
                 k: gl.tensor, n_tiles: gl.tensor, n_last: gl.tensor, FP8: gl.constexpr,
                 DOT: gl.constexpr) -> gl.tensor:
    """Tile ``k``'s scores ``S^T`` once its stage has landed, each part's bytes read
    into the A fragments just before its MMA and widened there, the stage released
    after (the values' warpgroup releases it too); the rows past a split's end masked."""
    S: gl.constexpr = kfull.type.shape[0]
    BLOCK_N: gl.constexpr = st_a.type.shape[1]
    HALF: gl.constexpr = st_a.type.shape[2]
    BLOCK_H: gl.constexpr = q_s.type.shape[1]
    Q4: gl.constexpr = 128  # the latent's columns an MMA
    ACC: gl.constexpr = DOT.parent
    st = k % S
    mbarrier.wait(kfull.index(st), (k // S) & 1)
    # an operand's registers stay untouched until its MMA is done: one in flight while
    # the next is read
    prev = _score_operand(st_p.index(st), FP8, DOT)
    s = warpgroup_mma(prev, qp_s.permute((1, 0)), gl.zeros([BLOCK_N, BLOCK_H], gl.float32, ACC),
                      use_acc=False, is_async=True)
    for part in gl.static_range(2 * HALF // Q4):
        a = _score_operand(st_a.index(2 * st + part * Q4 // HALF)
                           .slice(part * Q4 % HALF, Q4, dim=1), FP8, DOT)
        s = warpgroup_mma(a, q_s.index(part * Q4 // HALF)
                          .slice(part * Q4 % HALF, Q4, dim=1).permute((1, 0)), s,
                          is_async=True)
        warpgroup_mma_wait(num_outstanding=1, deps=(prev,))
        prev = a
    # every warp has read the stage
    gl.thread_barrier()
    mbarrier.arrive(kfree.index(st))
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, prev, q_s, qp_s))[0]
    n_valid = gl.where(k == n_tiles - 1, n_last, BLOCK_N)
    if n_valid < BLOCK_N:
        keys = gl.arange(0, BLOCK_N, gl.SliceLayout(1, ACC))
        s = gl.where((keys < n_valid)[:, None], s, float("-inf"))
    return s


@jit
def _value_block(st_a: gl.shared_memory_descriptor, st: gl.tensor, i: gl.constexpr,
                 W: gl.constexpr) -> gl.shared_memory_descriptor:
    """Block ``i`` (0 or 1) of a stage's latent that a values' warpgroup takes: the
    latent's half ``i`` (``W`` 2: the only values' warpgroup) or the quarter ``i`` of
    half ``W``."""
    HALF: gl.constexpr = st_a.type.shape[2]
    if W == 2:
        blk = st_a.index(2 * st + i)
    else:
        blk = st_a.index(2 * st + W).slice(i * (HALF // 2), HALF // 2, dim=1)
    return blk


@jit
def _tile_values(st_a: gl.shared_memory_descriptor, pt: gl.shared_memory_descriptor,
                 kfull: gl.shared_memory_descriptor, kfree: gl.shared_memory_descriptor,
                 k: gl.tensor, n_tiles: gl.tensor, n_last: gl.tensor, acc0: gl.tensor,
                 acc1: gl.tensor, W: gl.constexpr, FP8: gl.constexpr,
                 DOT: gl.constexpr) -> gl.tensor:
    """Tile ``k``'s ``P^T`` (``pt``) applied to the two blocks of the latent a values'
    warpgroup takes (:func:`_value_block`; ``acc0``, ``acc1``): ``TK`` keys an MMA (32
    at 16 heads, 16 from 32: the accumulators take twice the registers), its A operand
    (the block transposed) read from the stage into registers just before and widened
    there; the stage released after."""
    S: gl.constexpr = kfull.type.shape[0]
    BLOCK_N: gl.constexpr = st_a.type.shape[1]
    BLOCK_H: gl.constexpr = pt.type.shape[1]
    TK: gl.constexpr = 32 if BLOCK_H == 16 else 16
    NP: gl.constexpr = BLOCK_N // TK
    st = k % S
    mbarrier.wait(kfull.index(st), (k // S) & 1)
    n_valid = gl.where(k == n_tiles - 1, n_last, BLOCK_N)
    prev = _value_operand(_value_block(st_a, st, 0, W).slice(0, TK, dim=0), n_valid, 0, FP8,
                          DOT)
    acc0 = warpgroup_mma(prev, pt.slice(0, TK, dim=0), acc0, is_async=True)
    for part in gl.static_range(1, 2 * NP):
        a = _value_operand(_value_block(st_a, st, part // NP, W)
                           .slice((part % NP) * TK, TK, dim=0),
                           n_valid, (part % NP) * TK, FP8, DOT)
        p_part = pt.slice((part % NP) * TK, TK, dim=0)
        if part // NP == 0:
            acc0 = warpgroup_mma(a, p_part, acc0, is_async=True)
        else:
            acc1 = warpgroup_mma(a, p_part, acc1, is_async=True)
        warpgroup_mma_wait(num_outstanding=1, deps=(prev,))
        prev = a
    # every warp has read the stage (the scoring warpgroup releases it too)
    gl.thread_barrier()
    mbarrier.arrive(kfree.index(st))
    acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, prev, pt))[:2]
    return acc0, acc1


@jit
def _scores_r(q_s: gl.shared_memory_descriptor, qp_s: gl.shared_memory_descriptor,
              st_a: gl.shared_memory_descriptor, st_p: gl.shared_memory_descriptor,
              p_bufs: gl.shared_memory_descriptor, a_bufs: gl.shared_memory_descriptor,
              l_s: gl.shared_memory_descriptor, kfull: gl.shared_memory_descriptor,
              kfree: gl.shared_memory_descriptor, pfull: gl.shared_memory_descriptor,
              pfree: gl.shared_memory_descriptor, lfull: gl.shared_memory_descriptor,
              n_tiles: gl.tensor, n_last: gl.tensor, qk_s: gl.shared_memory_descriptor,
              LSE_PART: gl.tensor, t: gl.tensor, hb: gl.tensor, sp: gl.tensor,
              num_heads: gl.tensor, stride_lt: gl.tensor, stride_lh: gl.tensor,
              single: gl.tensor, C: gl.tensor, Q: gl.tensor, Q_PE: gl.tensor,
              stride_qt: gl.tensor, stride_qh: gl.tensor, stride_et: gl.tensor,
              stride_eh: gl.tensor, sm_scale: gl.tensor, K_SCALE: gl.tensor) -> None:
    """The scoring warpgroup of an fp8 cache. The query into shared memory first (the
    loader's first copies are in flight meanwhile): in two E4M3 parts for an E4M3 cache
    (:func:`_query_f8_to_shared`), else scaled into float16's top binades with its
    columns in the order in which :func:`_tile_scores` reads the stored bytes. Then two
    tiles a step (:func:`_fp8_tile_scores`) and the softmax of :func:`_scores_n` over
    both: one maximum across the warps and one publication a step (step ``j``'s ``P^T``
    in buffers ``2 b`` and ``2 b + 1``, ``b = j % 2``, its heads' rescale factors in
    ``a_bufs[b]``; at 16 heads this took the E4M3 decode from 63.5 to 58.6 us). ``C``:
    the cache (its element type, E4M3 or E5M2)."""
    FP8: gl.constexpr = 1 if C.dtype.element_ty == gl.float8e4nv else 2
    BLOCK_N: gl.constexpr = st_a.type.shape[1]
    BLOCK_H: gl.constexpr = p_bufs.type.shape[2]
    ACC: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16])
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    HEADS: gl.constexpr = gl.SliceLayout(0, ACC)
    LOADQ: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    if q_s.dtype == gl.float8e4nv:  # (fp8_score_mmas chose the buffers)
        _query_f8_to_shared(Q, Q_PE, t, hb, num_heads, stride_qt, stride_qh, stride_et,
                            stride_eh, sm_scale, K_SCALE, q_s, qp_s, qk_s, LOADQ)
    else:
        _query_to_shared(Q, Q_PE, t, hb, num_heads, stride_qt, stride_qh, stride_et,
                         stride_eh, sm_scale, K_SCALE, q_s, qp_s, qk_s, 14, LOADQ, True)

    l_part = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, ACC)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, HEADS)
    qk = qk_s.load(HEADS)  # what turns a head's raw scores into base-2 logits (> 0)
    # T tiles a step: one maximum across the warps and one publication for all
    T: gl.constexpr = tiles_a_step(BLOCK_H)
    for j in range(gl.cdiv(n_tiles, T)):
        s = (_fp8_tile_scores(st_a, st_p, kfull, kfree, q_s, qp_s, T * j, n_tiles, n_last,
                              FP8, DOT),)
        for i in gl.static_range(1, T):
            s_i = gl.full([BLOCK_N, BLOCK_H], float("-inf"), gl.float32, ACC)
            if T * j + i < n_tiles:
                s_i = _fp8_tile_scores(st_a, st_p, kfull, kfree, q_s, qp_s, T * j + i,
                                       n_tiles, n_last, FP8, DOT)
            s = _append(s, s_i)
        # (the first tile has a key: m_new is finite; a missing later one's P is 0)
        m_i, l_part = _softmax_step(s, m_i, l_part, qk, p_bufs, a_bufs, pfree, pfull, j)

    _finish_scores(m_i, l_part, l_s, lfull, LSE_PART, t, hb, sp, num_heads, stride_lt,
                   stride_lh, single)


@jit
def _tile_scores_rows(st_a: gl.shared_memory_descriptor, st_p: gl.shared_memory_descriptor,
                      kfull: gl.shared_memory_descriptor, kfree: gl.shared_memory_descriptor,
                      qa_s: gl.shared_memory_descriptor, qpe_s: gl.shared_memory_descriptor,
                      k: gl.tensor, n_tiles: gl.tensor, n_last: gl.tensor,
                      ACC: gl.constexpr) -> gl.tensor:
    """Tile ``k``'s scores ``S`` (heads as rows, keys as columns) on an E4M3 cache: fp8
    MMAs of each part of the query (``m64n64k32``, the A operand) by the stored bytes
    as they landed (the B operand, K-major as stored), one accumulator a part, then
    ``hi + mid / 16`` in registers; the stage released once the MMAs are done (the
    values' warpgroups release it too); the keys past a split's end masked."""
    S: gl.constexpr = kfull.type.shape[0]
    BLOCK_N: gl.constexpr = st_a.type.shape[1]
    HALF: gl.constexpr = st_a.type.shape[2]
    ROPE: gl.constexpr = st_p.type.shape[2]
    BLOCK_H: gl.constexpr = qa_s.type.shape[1] // 2
    f8: gl.constexpr = gl.float8e4nv
    st = k % S
    mbarrier.wait(kfull.index(st), (k // S) & 1)
    kp = st_p.index(st)._reinterpret(f8, [BLOCK_N, ROPE], st_p.type.layout).permute((1, 0))
    zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, ACC)
    hi = warpgroup_mma(qpe_s.slice(0, BLOCK_H, dim=0), kp, zero, use_acc=False,
                       is_async=True)
    mid = warpgroup_mma(qpe_s.slice(BLOCK_H, BLOCK_H, dim=0), kp, zero, use_acc=False,
                        is_async=True)
    for h in gl.static_range(2):
        ka = st_a.index(2 * st + h)._reinterpret(f8, [BLOCK_N, HALF],
                                                 st_a.type.layout).permute((1, 0))
        hi = warpgroup_mma(qa_s.index(h).slice(0, BLOCK_H, dim=0), ka, hi, is_async=True)
        mid = warpgroup_mma(qa_s.index(h).slice(BLOCK_H, BLOCK_H, dim=0), ka, mid,
                            is_async=True)
    hi, mid = warpgroup_mma_wait(num_outstanding=0, deps=(hi, mid, qa_s, qpe_s))[:2]
    # every warp's MMAs have read the stage
    gl.thread_barrier()
    mbarrier.arrive(kfree.index(st))
    s = gl.fma(mid, 1.0 / MID_SCALE, hi)
    n_valid = gl.where(k == n_tiles - 1, n_last, BLOCK_N)
    if n_valid < BLOCK_N:
        keys = gl.arange(0, BLOCK_N, gl.SliceLayout(0, ACC))
        s = gl.where((keys < n_valid)[None, :], s, float("-inf"))
    return s


@jit
def _scores_rows(q_s: gl.shared_memory_descriptor, qp_s: gl.shared_memory_descriptor,
                 st_a: gl.shared_memory_descriptor, st_p: gl.shared_memory_descriptor,
                 p_bufs: gl.shared_memory_descriptor, a_bufs: gl.shared_memory_descriptor,
                 l_s: gl.shared_memory_descriptor, kfull: gl.shared_memory_descriptor,
                 kfree: gl.shared_memory_descriptor, pfull: gl.shared_memory_descriptor,
                 pfree: gl.shared_memory_descriptor, lfull: gl.shared_memory_descriptor,
                 n_tiles: gl.tensor, n_last: gl.tensor, qk_s: gl.shared_memory_descriptor,
                 LSE_PART: gl.tensor, t: gl.tensor, hb: gl.tensor, sp: gl.tensor,
                 num_heads: gl.tensor, stride_lt: gl.tensor, stride_lh: gl.tensor,
                 single: gl.tensor, C: gl.tensor, Q: gl.tensor, Q_PE: gl.tensor,
                 stride_qt: gl.tensor, stride_qh: gl.tensor, stride_et: gl.tensor,
                 stride_eh: gl.tensor, sm_scale: gl.tensor, K_SCALE: gl.tensor) -> None:
    """The scoring warpgroup at 64 heads (an E4M3 cache, a bfloat16 query): the query
    in two E4M3 parts (:func:`_query_f8_to_shared`), then each tile's scores with the
    heads as rows (:func:`_tile_scores_rows`), so that a head's softmax stays inside a
    warp (its row is 4 lanes' registers), as in the lead kernel; ``P^T`` (the values'
    B operand) and the heads' rescale factors published into buffer ``k % 2``. After
    the last tile the row sums go to the values' warpgroups, and the log-sum-exp of a
    split out. ``C``: the cache (its element type)."""
    BLOCK_N: gl.constexpr = st_a.type.shape[1]
    BLOCK_H: gl.constexpr = p_bufs.type.shape[2]
    ACC: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32])
    ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
    LOADQ: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    gl.static_assert(C.dtype.element_ty == gl.float8e4nv, "an E4M3 cache")
    _query_f8_to_shared(Q, Q_PE, t, hb, num_heads, stride_qt, stride_qh, stride_et,
                        stride_eh, sm_scale, K_SCALE, q_s, qp_s, qk_s, LOADQ)

    l_i = gl.zeros([BLOCK_H], gl.float32, ROWS)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROWS)
    qk = qk_s.load(ROWS)  # what turns a head's raw scores into base-2 logits (> 0)
    for k in range(n_tiles):
        s = _tile_scores_rows(st_a, st_p, kfull, kfree, q_s, qp_s, k, n_tiles, n_last, ACC)
        b = k % 2
        m_i, l_i, p, alpha = row_softmax(s, m_i, l_i, qk)
        pt = gl.permute(p.to(p_bufs.dtype), (1, 0))
        # the value MMAs of tile k - 2 are done with buffer b
        mbarrier.wait(pfree.index(b), ((k // 2) - 1) & 1, pred=k >= 2)
        p_bufs.index(b).store(pt)
        a_bufs.index(b).store(alpha)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(pfull.index(b))

    l_s.store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(lfull.index(0))
    _store_lse(m_i, l_i, 0.0, LSE_PART, t, hb, sp, num_heads, stride_lt, stride_lh, single)


@jit
def _fp8_tile_scores(st_a: gl.shared_memory_descriptor, st_p: gl.shared_memory_descriptor,
                     kfull: gl.shared_memory_descriptor, kfree: gl.shared_memory_descriptor,
                     q_s: gl.shared_memory_descriptor, qp_s: gl.shared_memory_descriptor,
                     k: gl.tensor, n_tiles: gl.tensor, n_last: gl.tensor, FP8: gl.constexpr,
                     DOT: gl.constexpr) -> gl.tensor:
    """Tile ``k``'s scores ``S^T`` (in ``DOT``'s parent layout): fp8 MMAs of the stored
    bytes where the query is in E4M3 parts (:func:`fp8_score_mmas`:
    :func:`_tile_scores_f8`), else the bytes (``FP8`` 1: E4M3, 2: E5M2) widened in
    registers (:func:`_tile_scores`)."""
    ACC: gl.constexpr = DOT.parent
    if q_s.dtype == gl.float8e4nv:
        s = _tile_scores_f8(st_a, st_p, kfull, kfree, q_s, qp_s, k, n_tiles, n_last, ACC)
    else:
        s = _tile_scores(st_a, st_p, kfull, kfree, q_s, qp_s, k, n_tiles, n_last, FP8, DOT)
    return s


@jit
def _values_r(st_a: gl.shared_memory_descriptor, p_bufs: gl.shared_memory_descriptor,
              a_bufs: gl.shared_memory_descriptor, l_s: gl.shared_memory_descriptor,
              kfull: gl.shared_memory_descriptor, kfree: gl.shared_memory_descriptor,
              pfull: gl.shared_memory_descriptor, pfree: gl.shared_memory_descriptor,
              lfull: gl.shared_memory_descriptor, n_tiles: gl.tensor, n_last: gl.tensor,
              K_SCALE: gl.tensor, OUT: gl.tensor, O_PART: gl.tensor, t: gl.tensor,
              hb: gl.tensor, sp: gl.tensor, num_heads: gl.tensor, stride_xt: gl.tensor,
              stride_xh: gl.tensor, stride_pt: gl.tensor, stride_ph: gl.tensor,
              stride_ps: gl.tensor, single: gl.tensor, C: gl.tensor) -> None:
    """The values' warpgroup of an fp8 cache up to 32 heads: both halves of the latent
    (:func:`_values_w`)."""
    _values_w(st_a, p_bufs, a_bufs, l_s, kfull, kfree, pfull, pfree, lfull, n_tiles, n_last,
              K_SCALE, OUT, O_PART, t, hb, sp, num_heads, stride_xt, stride_xh, stride_pt,
              stride_ph, stride_ps, single, C, 2)


@jit
def _values_r0(st_a: gl.shared_memory_descriptor, p_bufs: gl.shared_memory_descriptor,
              a_bufs: gl.shared_memory_descriptor, l_s: gl.shared_memory_descriptor,
              kfull: gl.shared_memory_descriptor, kfree: gl.shared_memory_descriptor,
              pfull: gl.shared_memory_descriptor, pfree: gl.shared_memory_descriptor,
              lfull: gl.shared_memory_descriptor, n_tiles: gl.tensor, n_last: gl.tensor,
              K_SCALE: gl.tensor, OUT: gl.tensor, O_PART: gl.tensor, t: gl.tensor,
              hb: gl.tensor, sp: gl.tensor, num_heads: gl.tensor, stride_xt: gl.tensor,
              stride_xh: gl.tensor, stride_pt: gl.tensor, stride_ph: gl.tensor,
              stride_ps: gl.tensor, single: gl.tensor, C: gl.tensor) -> None:
    """The first of the two values' warpgroups at 64 heads: the latent's first half."""
    _values_w(st_a, p_bufs, a_bufs, l_s, kfull, kfree, pfull, pfree, lfull, n_tiles, n_last,
              K_SCALE, OUT, O_PART, t, hb, sp, num_heads, stride_xt, stride_xh, stride_pt,
              stride_ph, stride_ps, single, C, 0)


@jit
def _values_r1(st_a: gl.shared_memory_descriptor, p_bufs: gl.shared_memory_descriptor,
              a_bufs: gl.shared_memory_descriptor, l_s: gl.shared_memory_descriptor,
              kfull: gl.shared_memory_descriptor, kfree: gl.shared_memory_descriptor,
              pfull: gl.shared_memory_descriptor, pfree: gl.shared_memory_descriptor,
              lfull: gl.shared_memory_descriptor, n_tiles: gl.tensor, n_last: gl.tensor,
              K_SCALE: gl.tensor, OUT: gl.tensor, O_PART: gl.tensor, t: gl.tensor,
              hb: gl.tensor, sp: gl.tensor, num_heads: gl.tensor, stride_xt: gl.tensor,
              stride_xh: gl.tensor, stride_pt: gl.tensor, stride_ph: gl.tensor,
              stride_ps: gl.tensor, single: gl.tensor, C: gl.tensor) -> None:
    """The second of the two values' warpgroups at 64 heads: the latent's second half."""
    _values_w(st_a, p_bufs, a_bufs, l_s, kfull, kfree, pfull, pfree, lfull, n_tiles, n_last,
              K_SCALE, OUT, O_PART, t, hb, sp, num_heads, stride_xt, stride_xh, stride_pt,
              stride_ph, stride_ps, single, C, 1)


@jit
def _values_w(st_a: gl.shared_memory_descriptor, p_bufs: gl.shared_memory_descriptor,
              a_bufs: gl.shared_memory_descriptor, l_s: gl.shared_memory_descriptor,
              kfull: gl.shared_memory_descriptor, kfree: gl.shared_memory_descriptor,
              pfull: gl.shared_memory_descriptor, pfree: gl.shared_memory_descriptor,
              lfull: gl.shared_memory_descriptor, n_tiles: gl.tensor, n_last: gl.tensor,
              K_SCALE: gl.tensor, OUT: gl.tensor, O_PART: gl.tensor, t: gl.tensor,
              hb: gl.tensor, sp: gl.tensor, num_heads: gl.tensor, stride_xt: gl.tensor,
              stride_xh: gl.tensor, stride_pt: gl.tensor, stride_ph: gl.tensor,
              stride_ps: gl.tensor, single: gl.tensor, C: gl.tensor,
              W: gl.constexpr) -> None:
    """A values' warpgroup of an fp8 cache: each tile's ``P^T`` applied to both
    halves of the latent (``W`` 2) or to both quarters of half ``W`` (0, 1), one
    accumulator each (:func:`_tile_values`), rescaled once a step of the scoring
    warpgroup; then the output, its rows put back in the latent's order, times the
    cache's scale (``K_SCALE``, read there). ``C``: the cache (its element type, E4M3 or
    E5M2)."""
    FP8: gl.constexpr = 1 if C.dtype.element_ty == gl.float8e4nv else 2
    HALF: gl.constexpr = st_a.type.shape[2]
    BLOCK_H: gl.constexpr = p_bufs.type.shape[2]
    ACC: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16])
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    HEADS: gl.constexpr = gl.SliceLayout(0, ACC)

    QW: gl.constexpr = HALF if W == 2 else HALF // 2  # an accumulator's latent columns
    acc0 = gl.zeros([QW, BLOCK_H], gl.float32, ACC)
    acc1 = gl.zeros([QW, BLOCK_H], gl.float32, ACC)
    T: gl.constexpr = tiles_a_step(BLOCK_H)
    for k in range(n_tiles):
        # the scoring warpgroup's step j: tiles T j .. T j + T - 1, P^T in buffers T b ..
        # T b + T - 1, one rescale factor (applied before the first)
        j = k // T
        b = j % 2
        if k % T == 0:
            mbarrier.wait(pfull.index(b), (j // 2) & 1)
        alpha = gl.where(k % T == 0, a_bufs.index(b).load(HEADS), 1.0)
        acc0 = acc0 * alpha[None, :]
        acc1 = acc1 * alpha[None, :]
        acc0, acc1 = _tile_values(st_a, p_bufs.index(T * b + k % T), kfull, kfree, k,
                                  n_tiles, n_last, acc0, acc1, W, FP8, DOT)
        if k % T == T - 1 or k == n_tiles - 1:
            # every warp of the warpgroup is done with the step's P and factors
            gl.thread_barrier()
            mbarrier.arrive(pfree.index(b))

    mbarrier.wait(lfull.index(0), 0)
    l_i = l_s.load(HEADS)
    oscale = gl.load(K_SCALE)
    SHAPE: gl.constexpr = value_order(QW, BLOCK_H, True)[0]
    ORDER: gl.constexpr = value_order(QW, BLOCK_H, True)[1]
    B0: gl.constexpr = 0 if W == 2 else 2 * W  # the first block's index in QW columns
    # the accumulators' rows back in the latent's order, transposed: [heads, QW]
    o0 = reorder(acc0, SHAPE, ORDER)
    o1 = reorder(acc1, SHAPE, ORDER)
    _store_rows(gl.permute(o0, (1, 0)), l_i, OUT, O_PART, t, hb, sp, num_heads,
                stride_xt, stride_xh, stride_pt, stride_ph, stride_ps, single, oscale, B0)
    _store_rows(gl.permute(o1, (1, 0)), l_i, OUT, O_PART, t, hb, sp, num_heads,
                stride_xt, stride_xh, stride_pt, stride_ph, stride_ps, single, oscale,
                B0 + 1)


@jit
def _store_rows(o: gl.tensor, l_i: gl.tensor, OUT: gl.tensor, O_PART: gl.tensor,
                t: gl.tensor, hb: gl.tensor, sp: gl.tensor, num_heads: gl.tensor,
                stride_xt: gl.tensor, stride_xh: gl.tensor, stride_pt: gl.tensor,
                stride_ph: gl.tensor, stride_ps: gl.tensor, single: gl.tensor,
                oscale: gl.tensor, W: gl.constexpr) -> None:
    """Half ``W`` of the output (``o``: ``[heads, L / 2]``) stored by :func:`_store_half`
    from a layout in which a thread holds 4 consecutive columns of a head and a warp 128
    (16-byte stores of the float32 partials, each warp's contiguous; through shared
    memory). From the accumulators' layouts a thread's stores were 4 bytes each,
    scattered: about 7 us of a 16-head E4M3 decode of two splits went to them
    (``benchmarks/results/h200/2026-12-02-f7a6500``, ``timestamps.txt``)."""
    STORE: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
    _store_half(gl.convert_layout(o, STORE), l_i, OUT, O_PART, t, hb, sp, num_heads,
                stride_xt, stride_xh, stride_pt, stride_ph, stride_ps, single, oscale, W)


@jit
def _query_parts(x: gl.tensor, hi_s: gl.shared_memory_descriptor,
                 mid_s: gl.shared_memory_descriptor) -> None:
    """``x`` (float32, scaled) as two E4M3 parts: ``hi`` (``x`` rounded) into ``hi_s``,
    ``mid`` (the remainder times 16, rounded) into ``mid_s``; ``hi + mid / 16`` is ``x``
    to its 8th significant bit (exactly, for a bfloat16 value, down to ``2**-6``)."""
    hi = x.to(gl.float8e4nv)
    hi_s.store(hi)
    mid_s.store(((x - hi.to(gl.float32)) * MID_SCALE).to(gl.float8e4nv))


@jit
def _query_f8_to_shared(Q: gl.tensor, Q_PE: gl.tensor, t: gl.tensor, hb: gl.tensor,
                        num_heads: gl.tensor, stride_qt: gl.tensor, stride_qh: gl.tensor,
                        stride_et: gl.tensor, stride_eh: gl.tensor, sm_scale: gl.tensor,
                        K_SCALE: gl.tensor, qa_s: gl.shared_memory_descriptor,
                        qpe_s: gl.shared_memory_descriptor,
                        qk_s: gl.shared_memory_descriptor, LOAD: gl.constexpr) -> None:
    """Token ``t``'s query of head tile ``hb`` into shared memory as the B operands of
    fp8 score MMAs on an E4M3 cache's bytes: each head scaled by the power of two that
    puts its largest magnitude in ``[128, 256)`` and split into two E4M3 parts
    (:func:`_query_parts`), rows ``0 .. BLOCK_H`` the high parts, rows ``BLOCK_H ..
    2 BLOCK_H`` the middle ones (``qa_s``: ``[2, 2 BLOCK_H, L / 2]``, the latent in
    halves; ``qpe_s``: ``[2 BLOCK_H, R]``); in ``qk_s`` what turns a head's raw scores
    into base-2 logits (``K_SCALE`` one of its factors). One read of the query (held in
    registers for the scaling); visible to the MMAs after. Run by the scoring warpgroup
    while the loader's first copies are in flight."""
    BLOCK_H: gl.constexpr = qa_s.type.shape[1] // 2
    HALF: gl.constexpr = qa_s.type.shape[2]
    ROPE: gl.constexpr = qpe_s.type.shape[1]
    # (64 columns a read at 64 heads: the query's chunks take half the registers)
    CH: gl.constexpr = (128 if BLOCK_H <= 32 else 64) if HALF >= 128 else HALF
    q_row, cols, qp_ptr, mask_h = _query_pointers(Q, Q_PE, t, hb, num_heads, stride_qt,
                                                  stride_qh, stride_et, stride_eh, BLOCK_H,
                                                  CH, ROPE, LOAD)
    xp = gl.load(qp_ptr, mask=mask_h, other=0.0).to(gl.float32)
    amax = gl.max(gl.abs(xp), 1)
    # up to 32 heads the query stays in registers between its maximum and its parts; at
    # 64 (144 registers a thread) it is read twice
    KEEP: gl.constexpr = BLOCK_H <= 32
    if KEEP:
        xs = ()
        for c in gl.static_range(2 * HALF // CH):
            x = gl.load(q_row + c * CH + cols[None, :], mask=mask_h, other=0.0).to(gl.float32)
            amax = gl.maximum(amax, gl.max(gl.abs(x), 1))
            xs = _append(xs, x)
        ksc = gl.load(K_SCALE)
        down, up = row_powers(amax, 7)
        for c in gl.static_range(2 * HALF // CH):
            dst = qa_s.index(c * CH // HALF).slice(c * CH % HALF, CH, dim=1)
            _query_parts(xs[c] * down[:, None], dst.slice(0, BLOCK_H, dim=0),
                         dst.slice(BLOCK_H, BLOCK_H, dim=0))
    else:
        # run-time loops (the chunks of a latent half written out): written out whole,
        # this prologue was 3300 instructions run once a program, and inside a layer
        # (other kernels between two decodes) the kernel took 160 us against 143 alone;
        # with the loops 153.5 in the layer (128 heads, batch 64, 4096 keys, H200; code
        # fetched cold is the suspected cause; docs/mla.md)
        for ch in range(2 * HALF // CH):
            x = gl.load(q_row + ch * CH + cols[None, :], mask=mask_h, other=0.0).to(gl.float32)
            amax = gl.maximum(amax, gl.max(gl.abs(x), 1))
        down, up = row_powers(amax, 7)
        for h in range(2):
            dst_h = qa_s.index(h)
            for j in gl.static_range(HALF // CH):
                dst = dst_h.slice(j * CH, CH, dim=1)
                x = gl.load(q_row + h * HALF + j * CH + cols[None, :], mask=mask_h,
                            other=0.0).to(gl.float32)
                _query_parts(x * down[:, None], dst.slice(0, BLOCK_H, dim=0),
                             dst.slice(BLOCK_H, BLOCK_H, dim=0))
        ksc = gl.load(K_SCALE)
    _query_parts(xp * down[:, None], qpe_s.slice(0, BLOCK_H, dim=0),
                 qpe_s.slice(BLOCK_H, BLOCK_H, dim=0))
    qk_s.store(sm_scale * LOG2E * ksc * up)
    fence_async_shared()
    gl.thread_barrier()


@jit
def _tile_scores_f8(st_a: gl.shared_memory_descriptor, st_p: gl.shared_memory_descriptor,
                    kfull: gl.shared_memory_descriptor, kfree: gl.shared_memory_descriptor,
                    qa_s: gl.shared_memory_descriptor, qpe_s: gl.shared_memory_descriptor,
                    k: gl.tensor, n_tiles: gl.tensor, n_last: gl.tensor,
                    ACC: gl.constexpr) -> gl.tensor:
    """Tile ``k``'s scores ``S^T`` on an E4M3 cache: fp8 MMAs of the stored bytes (keys
    as M) by both parts of the query at once (``N = 2 BLOCK_H``), then ``hi + mid / 16``
    per head in registers; the stage released once the MMAs are done (the values'
    warpgroup releases it too); the rows past a split's end masked."""
    S: gl.constexpr = kfull.type.shape[0]
    BLOCK_N: gl.constexpr = st_a.type.shape[1]
    HALF: gl.constexpr = st_a.type.shape[2]
    ROPE: gl.constexpr = st_p.type.shape[2]
    H2: gl.constexpr = qa_s.type.shape[1]
    ACC2: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, H2, 32])
    f8: gl.constexpr = gl.float8e4nv
    st = k % S
    mbarrier.wait(kfull.index(st), (k // S) & 1)
    s2 = warpgroup_mma(st_p.index(st)._reinterpret(f8, [BLOCK_N, ROPE], st_p.type.layout),
                       qpe_s.permute((1, 0)), gl.zeros([BLOCK_N, H2], gl.float32, ACC2),
                       use_acc=False, is_async=True)
    for h in gl.static_range(2):
        s2 = warpgroup_mma(
            st_a.index(2 * st + h)._reinterpret(f8, [BLOCK_N, HALF], st_a.type.layout),
            qa_s.index(h).permute((1, 0)), s2, is_async=True)
    s2 = warpgroup_mma_wait(num_outstanding=0, deps=(s2, qa_s, qpe_s))[0]
    # every warp's MMAs have read the stage
    gl.thread_barrier()
    mbarrier.arrive(kfree.index(st))
    # the columns [hi heads | mid heads] -> hi + mid / 16, in registers
    hi, mid = gl.split(gl.permute(gl.reshape(s2, [BLOCK_N, 2, H2 // 2]), (0, 2, 1)))
    s = gl.convert_layout(gl.fma(mid, 1.0 / MID_SCALE, hi), ACC)
    n_valid = gl.where(k == n_tiles - 1, n_last, BLOCK_N)
    if n_valid < BLOCK_N:
        keys = gl.arange(0, BLOCK_N, gl.SliceLayout(1, ACC))
        s = gl.where((keys < n_valid)[:, None], s, float("-inf"))
    return s


@jit
def _scores_n(q_s: gl.shared_memory_descriptor, qp_s: gl.shared_memory_descriptor,
              ka_bufs: gl.shared_memory_descriptor, kp_bufs: gl.shared_memory_descriptor,
              p_bufs: gl.shared_memory_descriptor, a_bufs: gl.shared_memory_descriptor,
              l_s: gl.shared_memory_descriptor, kfull: gl.shared_memory_descriptor,
              pfull: gl.shared_memory_descriptor, pfree: gl.shared_memory_descriptor,
              lfull: gl.shared_memory_descriptor, n_tiles: gl.tensor, n_last: gl.tensor,
              qk_s: gl.shared_memory_descriptor, LSE_PART: gl.tensor, t: gl.tensor,
              hb: gl.tensor, sp: gl.tensor, num_heads: gl.tensor, stride_lt: gl.tensor,
              stride_lh: gl.tensor, single: gl.tensor) -> None:
    """The scoring warpgroup: every tile's scores ``S^T`` (keys as rows, heads as
    columns), the online softmax down the columns, ``P^T`` and the heads' rescale
    factors published into buffer ``k % 2`` for the values; the rows past a split's end
    zeroed in the tile first (a slot past the end may hold NaN, and a zero probability
    times NaN is NaN). The row sums stay per element until the end (one reduction
    across the warps, not one a tile); then they go to the values' warpgroup, and the
    log-sum-exp of a split out."""
    BLOCK_N: gl.constexpr = ka_bufs.type.shape[1]
    BLOCK_H: gl.constexpr = q_s.type.shape[1]
    ACC: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16])
    HEADS: gl.constexpr = gl.SliceLayout(0, ACC)
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    l_part = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, ACC)
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
            _zero_rows(ka_bufs.index(2 * b), n_valid, LOAD)
            _zero_rows(ka_bufs.index(2 * b + 1), n_valid, LOAD)
            keys = gl.arange(0, BLOCK_N, gl.SliceLayout(1, ACC))
            s = gl.where((keys < n_valid)[:, None], s, float("-inf"))
        # (every tile has a key, so m_new is finite; the zeroed rows are published
        # with P^T)
        m_i, l_part = _softmax_step((s,), m_i, l_part, qk, p_bufs, a_bufs, pfree, pfull, k)

    _finish_scores(m_i, l_part, l_s, lfull, LSE_PART, t, hb, sp, num_heads, stride_lt,
                   stride_lh, single)


@jit
def _values_n(ka_bufs: gl.shared_memory_descriptor, p_bufs: gl.shared_memory_descriptor,
              a_bufs: gl.shared_memory_descriptor, l_s: gl.shared_memory_descriptor,
              kfull: gl.shared_memory_descriptor, kfree: gl.shared_memory_descriptor,
              pfull: gl.shared_memory_descriptor, pfree: gl.shared_memory_descriptor,
              lfull: gl.shared_memory_descriptor, n_tiles: gl.tensor, oscale: gl.tensor,
              OUT: gl.tensor, O_PART: gl.tensor, t: gl.tensor, hb: gl.tensor,
              sp: gl.tensor, num_heads: gl.tensor, stride_xt: gl.tensor,
              stride_xh: gl.tensor, stride_pt: gl.tensor, stride_ph: gl.tensor,
              stride_ps: gl.tensor, single: gl.tensor) -> None:
    """The values' warpgroup: each tile's ``P^T`` (from the scoring warpgroup) applied
    to both halves of the latent, read transposed from the tile (``O^T += K^T P^T``),
    the accumulators rescaled by the heads' factors first; then the output."""
    HALF: gl.constexpr = ka_bufs.type.shape[2]
    BLOCK_H: gl.constexpr = p_bufs.type.shape[2]
    ACC: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16])
    HEADS: gl.constexpr = gl.SliceLayout(0, ACC)

    acc0 = gl.zeros([HALF, BLOCK_H], gl.float32, ACC)
    acc1 = gl.zeros([HALF, BLOCK_H], gl.float32, ACC)
    for k in range(n_tiles):
        b = k % 2
        mbarrier.wait(pfull.index(b), (k // 2) & 1)
        # (landed before P was published; waited for here too, so these MMAs are
        # ordered after the tile's writes by a barrier of their own)
        mbarrier.wait(kfull.index(b), (k // 2) & 1)
        alpha = a_bufs.index(b).load(HEADS)
        acc0 = acc0 * alpha[None, :]
        acc1 = acc1 * alpha[None, :]
        acc0 = warpgroup_mma(ka_bufs.index(2 * b).permute((1, 0)), p_bufs.index(b), acc0,
                             is_async=True)
        acc1 = warpgroup_mma(ka_bufs.index(2 * b + 1).permute((1, 0)), p_bufs.index(b), acc1,
                             is_async=True)
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, p_bufs))
        # every warp of the warpgroup is done with P, its factors and the tile
        gl.thread_barrier()
        mbarrier.arrive(pfree.index(b))
        mbarrier.arrive(kfree.index(b))

    mbarrier.wait(lfull.index(0), 0)
    l_i = l_s.load(HEADS)
    # the output [heads, L]: the accumulators transposed in registers (which register
    # holds which element changes, not what a register holds)
    _store_rows(gl.permute(acc0, (1, 0)), l_i, OUT, O_PART, t, hb, sp, num_heads,
                stride_xt, stride_xh, stride_pt, stride_ph, stride_ps, single, oscale, 0)
    _store_rows(gl.permute(acc1, (1, 0)), l_i, OUT, O_PART, t, hb, sp, num_heads,
                stride_xt, stride_xh, stride_pt, stride_ph, stride_ps, single, oscale, 1)


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
    the arguments of :func:`~vllm.attention.ops.gluon_mla_lead_kernels.mla_decode_lead_kernel`,
    with ``BLOCK_H`` 16 or 32 heads a program. ``LAT_DESC`` / ``PE_DESC``: ``[64, L /
    2]`` and ``[64, R]`` blocks of a 16-bit cache, or of an fp8 cache's bytes (``FP8``
    1: E4M3, 2: E5M2). ``num_warps`` 4: the scoring warpgroup; the values' warpgroup and
    the loader warp are partitions of their own."""
    gl.static_assert(num_warps == 4, "the default partition is one warpgroup")
    gl.static_assert(PAGE % BLOCK_N == 0, "a tile inside one page")
    gl.static_assert(BLOCK_N == 64, "the keys are the M of a warpgroup MMA")
    gl.static_assert(BLOCK_H == 16 or BLOCK_H == 32
                     or (BLOCK_H == 64 and fp8_score_mmas(C.dtype.element_ty,
                                                          Q.dtype.element_ty)),
                     "16 or 32 heads, the MMAs' N (64 with an E4M3 cache, bfloat16 query)")
    gl.static_assert(KV_LORA % 128 == 0, "each latent half a multiple of the MMA's M")
    dtype: gl.constexpr = gl.float16 if FP8 != 0 else Q.dtype.element_ty
    HALF: gl.constexpr = KV_LORA // 2
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    F32_ROW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    if BLOCK_H <= 32:  # (launched as a programmatic dependent launch up to 32 heads)
        _after_the_grid_before()
    hb, sp, t, req, start, end, n_tiles, n_last = _program_keys(TOK_REQ, TOK_POS,
                                                                num_splits, BLOCK_N)

    # two buffers of P^T and of the heads' rescale factors
    T: gl.constexpr = tiles_a_step(BLOCK_H)
    VW: gl.constexpr = value_groups(BLOCK_H)
    NPB: gl.constexpr = 2 if FP8 == 0 else 2 * T  # (fp8: two steps' tiles)
    p_bufs = gl.allocate_shared_memory(
        dtype, [NPB, BLOCK_N, BLOCK_H],
        gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], dtype))
    a_bufs = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], F32_ROW)
    l_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], F32_ROW)
    qk_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], F32_ROW)
    # a 16-bit cache: two tile buffers; an fp8 cache: a ring of S stages of its bytes
    # (five at 16 heads, four at 32: the query and P take twice the shared memory)
    S: gl.constexpr = 2 if FP8 == 0 else (5 if BLOCK_H == 16 else 4 if BLOCK_H == 32 else 3)
    kfull = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    kfree = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    pfull = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    lfull = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(S):
        mbarrier.init(kfull.index(i), count=1)
        # the value MMAs are a tile buffer's last readers; both warpgroups read a stage
        mbarrier.init(kfree.index(i), count=1 if FP8 == 0 else 1 + VW)
    for i in gl.static_range(2):
        mbarrier.init(pfull.index(i), count=1)
        mbarrier.init(pfree.index(i), count=VW)
    mbarrier.init(lfull.index(0), count=1)

    # the query in halves of the latent and the rope part: the score MMAs' B operands
    # (K-major, as stored)
    if fp8_score_mmas(C.dtype.element_ty, Q.dtype.element_ty):
        # an E4M3 cache and a bfloat16 query: the query in two E4M3 parts, the B
        # operands of fp8 score MMAs
        f8: gl.constexpr = gl.float8e4nv
        q_s = gl.allocate_shared_memory(
            f8, [2, 2 * BLOCK_H, HALF],
            gl.NVMMASharedLayout.get_default_for([2 * BLOCK_H, HALF], f8))
        qp_s = gl.allocate_shared_memory(
            f8, [2 * BLOCK_H, ROPE], gl.NVMMASharedLayout.get_default_for([2 * BLOCK_H, ROPE],
                                                                          f8))
    else:
        q_s, qp_s = _query_buffers(dtype, BLOCK_H, HALF, ROPE)
    # a partition's arguments are run-time values: the compile-time flag as a scalar
    single = (n_tiles * 0 + SINGLE) != 0
    page = n_tiles * 0 + PAGE

    if FP8 == 0:
        oscale = _query_to_shared(Q, Q_PE, t, hb, num_heads, stride_qt, stride_qh,
                                  stride_et, stride_eh, sm_scale, K_SCALE, q_s, qp_s, qk_s,
                                  0, LOAD)
        # two buffers of a tile each: [buffer * 2 + half] latent halves, [buffer] rope
        ka_bufs, kp_bufs = _tile_buffers(LAT_DESC, PE_DESC, dtype, BLOCK_N, HALF, ROPE, FP8)
        sargs = (q_s, qp_s, ka_bufs, kp_bufs, p_bufs, a_bufs, l_s, kfull, pfull, pfree,
                 lfull, n_tiles, n_last, qk_s, LSE_PART, t, hb, sp, num_heads, stride_lt,
                 stride_lh, single)
        vargs = (ka_bufs, p_bufs, a_bufs, l_s, kfull, kfree, pfull, pfree, lfull, n_tiles,
                 oscale, OUT, O_PART, t, hb, sp, num_heads, stride_xt, stride_xh,
                 stride_pt, stride_ph, stride_ps, single)
        largs = (LAT_DESC, PE_DESC, BT, req, start, n_tiles, stride_bt, page, ka_bufs,
                 kp_bufs, kfull, kfree)
        gl.warp_specialize([
            (_scores_n, sargs),
            (_values_n, vargs),
            (_load, largs),
        ], [4, 1], [VALUE_REGS if BLOCK_H == 16 else VALUE_REGS_32, LOAD_REGS])
    else:
        # the ring: [stage * 2 + half] latent halves, [stage] rope, as the copies land;
        # a step's stages are freed only after the step (the values' warpgroup reads
        # them after its P^T), so they must all fit in the ring at once
        gl.static_assert(T <= S, "a scoring step's tiles in the ring at once")
        st_a = gl.allocate_shared_memory(LAT_DESC.block_type.element_ty, [2 * S, BLOCK_N, HALF],
                                         LAT_DESC.layout)
        st_p = gl.allocate_shared_memory(PE_DESC.block_type.element_ty, [S, BLOCK_N, ROPE],
                                         PE_DESC.layout)
        rsargs = (q_s, qp_s, st_a, st_p, p_bufs, a_bufs, l_s, kfull, kfree, pfull, pfree,
                  lfull, n_tiles, n_last, qk_s, LSE_PART, t, hb, sp, num_heads,
                  stride_lt, stride_lh, single, C, Q, Q_PE, stride_qt, stride_qh,
                  stride_et, stride_eh, sm_scale, K_SCALE)
        # (the scoring warpgroup writes the query: :func:`_scores_r`)
        rvargs = (st_a, p_bufs, a_bufs, l_s, kfull, kfree, pfull, pfree, lfull, n_tiles,
                  n_last, K_SCALE, OUT, O_PART, t, hb, sp, num_heads, stride_xt, stride_xh,
                  stride_pt, stride_ph, stride_ps, single, C)
        rlargs = (LAT_DESC, PE_DESC, BT, req, start, n_tiles, stride_bt, page, st_a, st_p,
                  kfull, kfree)
        if VW == 1:
            gl.warp_specialize([
                (_scores_r, rsargs),
                (_values_r, rvargs),
                (_load, rlargs),
            ], [4, 1], [VALUE_REGS_FP8, LOAD_REGS])
        else:
            gl.warp_specialize([
                (_scores_rows, rsargs),
                (_values_r0, rvargs),
                (_values_r1, rvargs),
                (_load, rlargs),
            ], [4, 4, 1], [VALUE_REGS_64, VALUE_REGS_64, LOAD_REGS])
