"""The dense MLA decode for Hopper (sm_90) on fp8 tensor cores (Gluon): an E4M3 cache,
with the query and the probabilities rounded to E4M3 as well, so that both MMAs of a
tile read the cache's bytes as they are (``MLADecodeConfig.fp8_mma``).

This is the arithmetic of FlashMLA's dense fp8 decode, which takes the query in fp8
with a descale (upstream vLLM's ``vllm/v1/attention/backends/mla/flashmla.py`` at
e75aca0c: ``flash_mla_with_kvcache_fp8(..., descale_q=...)``; the layer quantizes the
query for backends that declare ``supports_quant_query_input``,
``vllm/model_executor/layers/attention/mla_attention.py`` at 0014ca6b), with two
differences that only make it closer to the exact result: the query is scaled a head at
a time by a power of two (its largest magnitude into ``[128, 256)``: no clamping, where a
per-tensor scale of 1.0 clamps every value past 448), and the probabilities are scaled
by ``2**8`` before rounding (E4M3 keeps 3 bits down to ``2**-14`` of a row's largest,
not ``2**-6``); the row sums add the rounded probabilities, so what is divided is what
was multiplied.

The schedule is :mod:`vllm.attention.ops.gluon_mla_lead_kernels`': the lead warpgroup
computes each 64-key tile's scores and softmax and applies ``P`` to the first half of
the values, the follower applies it to the second half. What differs is what they read:

* the transposing warpgroup (:func:`_transpose`) copies each tile by TMA into a ring of
  three stages, where the score MMAs read the keys as they are (``[64 keys, L + R]``:
  their B operand is K-major, as the cache is), and writes the tile's latent transposed
  into one of two value buffers (``[L, 64 keys]``: an fp8 MMA takes its B operand
  K-major only, and the K of the value MMA is the keys). The widening kernel stores 72
  KiB of float16 a tile; this stores 32 KiB of bytes beside the 36 KiB the copy
  writes, and the MMAs read half as many bytes as from float16 operands in half the
  time.
* in the transposed copy the value columns are permuted within each 128-column chunk
  (column ``16 a + j`` of the chunk is row ``16 (j // 2) + 2 a + j % 2``), so that the
  eight lanes of a store write eight rows two apart (two-way bank conflicts at most)
  while each lane read 16 consecutive bytes of a row, and the two adjacent columns an
  MMA accumulator holds in a thread are two adjacent output columns (one 32-bit store);
  the output stores undo it (:func:`_natural`). (A permutation to eight consecutive rows, free of
  conflicts, scattered the output into 16-bit stores, each waiting for the one before
  to read its register: a quarter of the lead's time.)
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

from vllm.attention.ops.gluon_mla_decode_kernels import _program_keys, jit
from vllm.attention.ops.gluon_mla_lead_kernels import (
    _follow_values,
    _query_buffers,
    _query_to_shared,
    _store_half,
    _store_lse,
)

P_BIAS: gl.constexpr = gl.constexpr(8.0)
"""``log2`` of the factor the probabilities carry into E4M3 (``[0, 256]``)."""
CH: gl.constexpr = gl.constexpr(128)
"""Columns of a chunk of the transposed tile (the span of the value permutation)."""
FOLLOW_REGS: gl.constexpr = gl.constexpr(168)
"""Registers a thread of the follower (its ``[64, L / 2]`` float32 accumulator takes 128)."""
TRANSPOSE_REGS: gl.constexpr = gl.constexpr(112)
"""Registers a thread of the transposing warpgroup."""
STAGES: gl.constexpr = gl.constexpr(3)
"""Tiles in the ring of copies (the keys; 36 KiB each)."""


@jit
def _transposed(x: gl.tensor) -> gl.tensor:
    """A ``[keys, 128]`` chunk as ``[128, keys]``, its column ``16 a + j`` as row
    ``16 (j // 2) + 2 a + j % 2`` (in registers: the layout gives a thread 16 consecutive
    columns of 4 consecutive keys, so a row's 4 keys are one 32-bit store)."""
    BLOCK_N: gl.constexpr = x.type.shape[0]
    y = gl.reshape(x, [BLOCK_N, 8, 8, 2])
    y = gl.permute(y, [2, 1, 3, 0])
    return gl.reshape(y, [128, BLOCK_N])


@jit
def _natural(acc: gl.tensor) -> gl.tensor:
    """A value accumulator ``[heads, L / 2]`` in the columns' own order: the inverse of
    :func:`_transposed`'s permutation, in registers (which register holds which column
    changes, not what a register holds)."""
    BLOCK_H: gl.constexpr = acc.type.shape[0]
    HALF: gl.constexpr = acc.type.shape[1]
    y = gl.reshape(acc, [BLOCK_H, HALF // CH, 8, 8, 2])  # column 128 c + 16 (j // 2) + 2 a + j % 2
    y = gl.permute(y, [0, 1, 3, 2, 4])
    return gl.reshape(y, [BLOCK_H, HALF])  # column 128 c + 16 a + j


@jit
def _transpose(LAT_DESC: tma.tensor_descriptor, PE_DESC: tma.tensor_descriptor,
               BT: gl.tensor, req: gl.tensor, start: gl.tensor, n_tiles: gl.tensor,
               n_last: gl.tensor, stride_bt: gl.tensor, page: gl.tensor,
               ka_bufs: gl.shared_memory_descriptor, kp_bufs: gl.shared_memory_descriptor,
               vt_bufs: gl.shared_memory_descriptor, rfull: gl.shared_memory_descriptor,
               rfree: gl.shared_memory_descriptor, vfull: gl.shared_memory_descriptor,
               vfree: gl.shared_memory_descriptor) -> None:
    """The transposing warpgroup: copies tile ``k + S - 1`` into stage ``(k + S - 1) % S``
    of the ring (``S`` stages: ``ka_bufs[2 s + h]`` latent half ``h``, ``kp_bufs[s]``
    the rope; the keys as the score MMAs read them) once its stage is free, then, once
    tile ``k`` has landed and both warpgroups are done with the values of tile ``k - 2``,
    stores tile ``k``'s latent permuted and transposed into ``vt_bufs[2 (k % 2) + h]``
    (rows past the request's last position as zeros: their bytes may be anything, NaN
    too, and a zero probability times NaN is NaN)."""
    BLOCK_N: gl.constexpr = ka_bufs.type.shape[1]
    HALF: gl.constexpr = ka_bufs.type.shape[2]
    S: gl.constexpr = kp_bufs.type.shape[0]
    gl.static_assert(HALF == 2 * CH, "two 128-column chunks a latent half")
    # a thread: 4 consecutive keys x 16 consecutive bytes; a warp: 16 keys x 128 bytes
    BYTES: gl.constexpr = gl.BlockedLayout([4, 16], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, BLOCK_N, gl.SliceLayout(1, BYTES))
    nbytes: gl.constexpr = 2 * LAT_DESC.block_type.nbytes + PE_DESC.block_type.nbytes
    bt_row = BT + req * stride_bt
    for i in gl.static_range(S - 1):  # the first tiles, into free stages
        if i < n_tiles:
            n0 = start + i * BLOCK_N
            row = gl.load(bt_row + n0 // page) * page + n0 % page
            bar = rfull.index(i)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(LAT_DESC, [row, 0], bar, ka_bufs.index(2 * i))
            tma.async_copy_global_to_shared(LAT_DESC, [row, HALF], bar,
                                            ka_bufs.index(2 * i + 1))
            tma.async_copy_global_to_shared(PE_DESC, [row, 2 * HALF], bar, kp_bufs.index(i))
    # the block-table entry of the next copy, read an iteration ahead
    last = gl.maximum(n_tiles - 1, 0)
    blk_next = gl.load(bt_row + (start + gl.minimum(S - 1, last) * BLOCK_N) // page,
                       mask=n_tiles > 0, other=0)
    for k in range(n_tiles):
        j = k + S - 1
        blk = blk_next
        blk_next = gl.load(bt_row + (start + gl.minimum(j + 1, last) * BLOCK_N) // page)
        if j < n_tiles:
            s2 = j % S
            n0 = start + j * BLOCK_N
            row = blk * page + n0 % page  # (a TMA coordinate: 32 bits)
            bar = rfull.index(s2)
            mbarrier.wait(rfree.index(s2), ((j // S) - 1) & 1, pred=j >= S)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(LAT_DESC, [row, 0], bar, ka_bufs.index(2 * s2))
            tma.async_copy_global_to_shared(LAT_DESC, [row, HALF], bar,
                                            ka_bufs.index(2 * s2 + 1))
            tma.async_copy_global_to_shared(PE_DESC, [row, 2 * HALF], bar, kp_bufs.index(s2))
        s = k % S
        b = k % 2
        n_valid = gl.where(k == n_tiles - 1, n_last, BLOCK_N)
        valid = (rows < n_valid)[:, None]
        mbarrier.wait(rfull.index(s), (k // S) & 1)
        if n_valid < BLOCK_N:
            # the last tile of a split: its rows past the end zeroed in the ring first (the
            # lead's scores of those rows are masked whatever they read); a branch of its
            # own, so that full tiles pay nothing for it
            for h in gl.static_range(2):
                raw = ka_bufs.index(2 * s + h)._reinterpret(
                    gl.uint8, [BLOCK_N, HALF], ka_bufs.type.layout)
                for c in gl.static_range(2):
                    part = raw.slice(c * CH, CH, dim=1)
                    x = part.load(BYTES)
                    part.store(gl.where(valid, x, gl.zeros_like(x)))
            gl.thread_barrier()
        mbarrier.wait(vfree.index(b), ((k // 2) - 1) & 1, pred=k >= 2)
        for c in gl.static_range(4):
            x = ka_bufs.index(2 * s + c // 2).slice((c % 2) * CH, CH, dim=1).load(BYTES)
            vt_bufs.index(2 * b + c // 2).slice((c % 2) * CH, CH, dim=0).store(_transposed(x))
        # visible to the MMAs (the async proxy), every warp's, before the arrivals (the
        # stage read by every warp)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(rfree.index(s))
        mbarrier.arrive(vfull.index(b))


@jit
def _lead8(q_s: gl.shared_memory_descriptor, qp_s: gl.shared_memory_descriptor,
           ka_bufs: gl.shared_memory_descriptor, kp_bufs: gl.shared_memory_descriptor,
           vt_bufs: gl.shared_memory_descriptor, p_s: gl.shared_memory_descriptor,
           a_s: gl.shared_memory_descriptor, l_s: gl.shared_memory_descriptor,
           rfull: gl.shared_memory_descriptor, rfree: gl.shared_memory_descriptor,
           vfull: gl.shared_memory_descriptor, vfree: gl.shared_memory_descriptor,
           pfull: gl.shared_memory_descriptor, pfree: gl.shared_memory_descriptor,
           lfull: gl.shared_memory_descriptor, n_tiles: gl.tensor, n_last: gl.tensor,
           qk_s: gl.shared_memory_descriptor, oscale: gl.tensor, OUT: gl.tensor,
           O_PART: gl.tensor, LSE_PART: gl.tensor, t: gl.tensor, hb: gl.tensor,
           sp: gl.tensor, num_heads: gl.tensor, stride_xt: gl.tensor, stride_xh: gl.tensor,
           stride_pt: gl.tensor, stride_ph: gl.tensor, stride_ps: gl.tensor,
           stride_lt: gl.tensor, stride_lh: gl.tensor, single: gl.tensor) -> None:
    """The lead warpgroup: every tile's scores (fp8 MMAs) and softmax, ``P`` rounded
    to E4M3 and published, its half of the values (an fp8 MMA on ``P`` in shared
    memory); then its half of the output, the row sums for the follower, and the
    log-sum-exp of a split."""
    BLOCK_N: gl.constexpr = ka_bufs.type.shape[1]
    HALF: gl.constexpr = ka_bufs.type.shape[2]
    BLOCK_H: gl.constexpr = q_s.type.shape[1]
    S: gl.constexpr = kp_bufs.type.shape[0]
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 32])
    S_ROWS: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    O_ROWS: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)

    acc = gl.zeros([BLOCK_H, HALF], gl.float32, O_LAYOUT)
    l_i = gl.zeros([BLOCK_H], gl.float32, S_ROWS)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, S_ROWS)
    qk = qk_s.load(S_ROWS)  # what turns a head's raw scores into base-2 logits (> 0)
    for k in range(n_tiles):
        st = k % S
        b = k % 2
        mbarrier.wait(rfull.index(st), (k // S) & 1)
        s = warpgroup_mma(qp_s, kp_bufs.index(st).permute((1, 0)),
                          gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_LAYOUT),
                          use_acc=False, is_async=True)
        s = warpgroup_mma(q_s.index(0), ka_bufs.index(2 * st).permute((1, 0)), s,
                          is_async=True)
        s = warpgroup_mma(q_s.index(1), ka_bufs.index(2 * st + 1).permute((1, 0)), s,
                          is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, q_s, qp_s))[0]
        mbarrier.arrive(rfree.index(st))  # the score MMAs are done with the stage
        n_valid = gl.where(k == n_tiles - 1, n_last, BLOCK_N)
        if n_valid < BLOCK_N:
            keys = gl.arange(0, BLOCK_N, gl.SliceLayout(0, S_LAYOUT))
            s = gl.where((keys < n_valid)[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk)
        # P times 2**8, in [0, 256], rounded to E4M3; the row sums add what was rounded
        p8 = gl.exp2(gl.fma(s, qk[:, None], P_BIAS - m_new[:, None])).to(gl.float8e4nv)
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p8.to(gl.float32), 1)
        m_i = m_new
        # the follower's value MMA of tile k - 1 is done with P and its factors
        mbarrier.wait(pfree.index(0), (k - 1) & 1, pred=k > 0)
        p_s.store(p8)
        a_s.store(alpha)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(pfull.index(0))
        acc = acc * gl.convert_layout(alpha, O_ROWS)[:, None]
        mbarrier.wait(vfull.index(b), (k // 2) & 1)
        acc = warpgroup_mma(p_s, vt_bufs.index(2 * b).permute((1, 0)), acc, is_async=True)
        # waited for here, not across the loop's back edge (ptxas serialises every MMA
        # of the kernel otherwise: C7515)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_s))[0]
        mbarrier.arrive(vfree.index(b))

    l_s.store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(lfull.index(0))
    _store_half(_natural(acc), l_i, OUT, O_PART, t, hb, sp, num_heads, stride_xt, stride_xh,
                stride_pt, stride_ph, stride_ps, single, oscale, 0)
    _store_lse(m_i, l_i, P_BIAS, LSE_PART, t, hb, sp, num_heads, stride_lt, stride_lh,
               single)


@jit
def _follow8(vt_bufs: gl.shared_memory_descriptor, p_s: gl.shared_memory_descriptor,
             a_s: gl.shared_memory_descriptor, l_s: gl.shared_memory_descriptor,
             vfull: gl.shared_memory_descriptor, vfree: gl.shared_memory_descriptor,
             pfull: gl.shared_memory_descriptor, pfree: gl.shared_memory_descriptor,
             lfull: gl.shared_memory_descriptor, n_tiles: gl.tensor, oscale: gl.tensor,
             OUT: gl.tensor, O_PART: gl.tensor, t: gl.tensor, hb: gl.tensor, sp: gl.tensor,
             num_heads: gl.tensor, stride_xt: gl.tensor, stride_xh: gl.tensor,
             stride_pt: gl.tensor, stride_ph: gl.tensor, stride_ps: gl.tensor,
             single: gl.tensor) -> None:
    """The follower warpgroup: each tile's ``P`` (from the lead) on the second half of
    the values (:func:`~vllm.attention.ops.gluon_mla_lead_kernels._follow_values` on the
    transposed copies), then that half of the output."""
    acc = _follow_values(vt_bufs, p_s, a_s, vfull, vfree, pfull, pfree, n_tiles, True)
    mbarrier.wait(lfull.index(0), 0)
    l_i = l_s.load(gl.SliceLayout(1, acc.type.layout))
    _store_half(_natural(acc), l_i, OUT, O_PART, t, hb, sp, num_heads, stride_xt, stride_xh,
                stride_pt, stride_ph, stride_ps, single, oscale, 1)


@jit
def mla_decode_fp8_mma_kernel(
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
    (``LAT_DESC`` / ``PE_DESC``: the E4M3 cache's ``[64, L / 2]`` and ``[64, R]`` blocks;
    ``C`` unused), ``FP8`` 1 (E4M3), ``KV_LORA`` 512, ``ROPE`` 64. ``num_warps`` 4: the
    lead warpgroup; the follower and the transposing warpgroup are the partitions'
    own.

    The query is rounded to E4M3 a head at a time after a power of two puts its largest
    magnitude in ``[128, 256)``; that power, ``sm_scale`` and ``K_SCALE`` multiply the
    scores, ``K_SCALE`` the output."""
    gl.static_assert(num_warps == 4, "the default partition is one warpgroup")
    gl.static_assert(PAGE % BLOCK_N == 0, "a tile inside one page")
    gl.static_assert(BLOCK_H == 64, "the M of a warpgroup MMA")
    gl.static_assert(FP8 == 1, "an E4M3 cache")
    gl.static_assert(KV_LORA == 4 * CH, "a latent of 512 columns")
    f8: gl.constexpr = gl.float8e4nv
    HALF: gl.constexpr = KV_LORA // 2
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    F32_ROW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    hb, sp, t, req, start, end, n_tiles, n_last = _program_keys(TOK_REQ, TOK_POS,
                                                                num_splits, BLOCK_N)

    # the ring of copied tiles, the keys: [stage * 2 + half] latent halves, [stage] rope;
    # two buffers of transposed values: [buffer * 2 + half]
    ka_bufs = gl.allocate_shared_memory(f8, [2 * STAGES, BLOCK_N, HALF], LAT_DESC.layout)
    kp_bufs = gl.allocate_shared_memory(f8, [STAGES, BLOCK_N, ROPE], PE_DESC.layout)
    vt_bufs = gl.allocate_shared_memory(
        f8, [4, HALF, BLOCK_N], gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_N], f8))
    p_s = gl.allocate_shared_memory(
        f8, [BLOCK_H, BLOCK_N], gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], f8))
    a_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], F32_ROW)
    l_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], F32_ROW)
    qk_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], F32_ROW)
    rfull = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    rfree = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    vfull = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    vfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pfull = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    pfree = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    lfull = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(rfull.index(i), count=1)
        mbarrier.init(rfree.index(i), count=2)  # the lead's scores and the transposition
    for i in gl.static_range(2):
        mbarrier.init(vfull.index(i), count=1)
        mbarrier.init(vfree.index(i), count=2)  # both value MMAs
    mbarrier.init(pfull.index(0), count=1)
    mbarrier.init(pfree.index(0), count=1)
    mbarrier.init(lfull.index(0), count=1)

    # the query in E4M3: halves of the latent (the score MMAs' A operands), the rope
    q_s, qp_s = _query_buffers(f8, BLOCK_H, HALF, ROPE)
    # each head scaled into E4M3's top binades ([2**7, 2**8): its largest finite value is
    # 448) and rounded
    oscale = _query_to_shared(Q, Q_PE, t, hb, num_heads, stride_qt, stride_qh, stride_et,
                              stride_eh, sm_scale, K_SCALE, q_s, qp_s, qk_s, 7, LOAD)
    # a partition's arguments are run-time values: the compile-time flag as a scalar
    single = (n_tiles * 0 + SINGLE) != 0

    args = (q_s, qp_s, ka_bufs, kp_bufs, vt_bufs, p_s, a_s, l_s, rfull, rfree, vfull, vfree,
            pfull, pfree, lfull, n_tiles, n_last, qk_s, oscale, OUT, O_PART, LSE_PART, t, hb, sp,
            num_heads, stride_xt, stride_xh, stride_pt, stride_ph, stride_ps, stride_lt,
            stride_lh, single)
    fargs = (vt_bufs, p_s, a_s, l_s, vfull, vfree, pfull, pfree, lfull, n_tiles, oscale, OUT,
             O_PART, t, hb, sp, num_heads, stride_xt, stride_xh, stride_pt, stride_ph,
             stride_ps, single)
    page = n_tiles * 0 + PAGE
    targs = (LAT_DESC, PE_DESC, BT, req, start, n_tiles, n_last, stride_bt, page, ka_bufs,
             kp_bufs, vt_bufs, rfull, rfree, vfull, vfree)
    gl.warp_specialize([
        (_lead8, args),
        (_follow8, fargs),
        (_transpose, targs),
    ], [4, 4], [FOLLOW_REGS, TRANSPOSE_REGS])
