"""The dense MLA decode for Hopper (sm_90) with whole tiles a warpgroup (Gluon; caches
in the model's 16-bit dtype; imported on first use).

:mod:`vllm.attention.ops.gluon_mla_decode_kernels` has both warpgroups compute half of
each 64-key tile's scores, so the query (``[64, L + R]`` in shared memory, the A operand
of the score MMAs) is read twice a tile, and the tensor cores idle through each softmax.
Here each warpgroup takes whole tiles in turn (``m64n64`` score MMAs: the query is read
once a tile) and the two hand their probabilities to each other:

* a loader warp copies tile ``k`` into buffer ``k % 2`` in three chunks (the rope
  columns, the latent's first half, its second half), each with its own ``full`` and
  ``free`` barrier, so a chunk is fetched again as soon as both warpgroups are done with
  it rather than when the whole buffer is;
* warpgroup ``w`` owns the tiles ``k`` with ``k % 2 == w`` and the output columns
  ``[w L / 2, (w + 1) L / 2)``. For its tile it computes the scores over all columns,
  the online softmax, and publishes ``P`` (16-bit, shared memory), the row maxima it is
  relative to and its row sums; it applies ``P`` to its own half of the values, and the
  other warpgroup applies it to the other half. While one warpgroup runs its softmax,
  the other's MMAs keep the tensor cores busy.

Each warpgroup keeps its own running maximum (no chain between the two softmaxes): a
received ``P`` is rescaled to the receiver's maximum in registers before its MMA, and
at the end both maxima are the row's maximum over every key (each tile's maximum enters
its owner's, which the other receives). The value MMAs take ``P`` from registers.

Synchronisation (mbarriers): ``kfull[b, c]`` (chunk ``c`` of buffer ``b`` landed),
``kfree[b, c]`` (two arrivals, one a warpgroup, each once a tile: the owner frees the
rope and the other's half once its score MMAs are done, and its own half once its value
MMA is; the other frees the chunks it does not read when it takes ``P``, and its half
once its value MMA is done), ``pfull`` (``P`` of tile ``k`` published). One ``P``
buffer serves both: the owner of tile ``k`` writes it only after it has read ``P`` of
tile ``k - 1``, which the other wrote after reading ``P`` of tile ``k - 2``.

The last tile of a split may be partial: its owner zeroes the latent rows past the
request's last position in shared memory before it publishes ``P`` (a slot past it may
hold NaN, and a zero probability times NaN is NaN) and masks their scores.
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

from vllm.attention.ops.triton_mla_decode_kernels import split_range

jit: Callable[[Callable[..., Any]], Any] = gluon.jit
"""``gluon.jit`` with a type, so mypy accepts the decorated kernels (as ``Any``)."""

LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)
ROPE_CHUNK: gl.constexpr = gl.constexpr(2)
"""The chunk index of the rope columns (0 and 1: the latent's halves)."""


@jit
def _loader(LAT_DESC: tma.tensor_descriptor, PE_DESC: tma.tensor_descriptor,
            BT: gl.tensor, req: gl.tensor, start: gl.tensor, n_tiles: gl.tensor,
            stride_bt: gl.tensor, page: gl.tensor, ka_bufs: gl.shared_memory_descriptor,
            kp_bufs: gl.shared_memory_descriptor, kfull: gl.shared_memory_descriptor,
            kfree: gl.shared_memory_descriptor, C: gl.constexpr) -> None:
    """A loader warp: chunk ``C`` (0, 1: a half of the latent; ``ROPE_CHUNK``) of tile
    ``k`` into buffer ``k % 2``, once both warpgroups have freed it in tile ``k - 2``.
    A warp a chunk, so no chunk waits behind another that is freed later."""
    BLOCK_N: gl.constexpr = ka_bufs.type.shape[1]
    HALF: gl.constexpr = ka_bufs.type.shape[2]
    for k in range(n_tiles):
        b = k % 2
        n0 = start + k * BLOCK_N
        blk = gl.load(BT + req * stride_bt + n0 // page)
        row = blk * page + n0 % page  # (a TMA coordinate: 32 bits)
        bar = kfull.index(b * 3 + C)
        mbarrier.wait(kfree.index(b * 3 + C), ((k // 2) - 1) & 1, pred=k >= 2)
        if C == ROPE_CHUNK:
            mbarrier.expect(bar, PE_DESC.block_type.nbytes)
            tma.async_copy_global_to_shared(PE_DESC, [row, 2 * HALF], bar, kp_bufs.index(b))
        else:
            mbarrier.expect(bar, LAT_DESC.block_type.nbytes)
            tma.async_copy_global_to_shared(LAT_DESC, [row, C * HALF], bar,
                                            ka_bufs.index(b * 2 + C))


@jit
def _load_rope(LAT_DESC: tma.tensor_descriptor, PE_DESC: tma.tensor_descriptor,
               BT: gl.tensor, req: gl.tensor, start: gl.tensor, n_tiles: gl.tensor,
               stride_bt: gl.tensor, page: gl.tensor, ka_bufs: gl.shared_memory_descriptor,
               kp_bufs: gl.shared_memory_descriptor, kfull: gl.shared_memory_descriptor,
               kfree: gl.shared_memory_descriptor) -> None:
    _loader(LAT_DESC, PE_DESC, BT, req, start, n_tiles, stride_bt, page, ka_bufs, kp_bufs,
            kfull, kfree, ROPE_CHUNK)


@jit
def _load_lat0(LAT_DESC: tma.tensor_descriptor, PE_DESC: tma.tensor_descriptor,
               BT: gl.tensor, req: gl.tensor, start: gl.tensor, n_tiles: gl.tensor,
               stride_bt: gl.tensor, page: gl.tensor, ka_bufs: gl.shared_memory_descriptor,
               kp_bufs: gl.shared_memory_descriptor, kfull: gl.shared_memory_descriptor,
               kfree: gl.shared_memory_descriptor) -> None:
    _loader(LAT_DESC, PE_DESC, BT, req, start, n_tiles, stride_bt, page, ka_bufs, kp_bufs,
            kfull, kfree, 0)


@jit
def _load_lat1(LAT_DESC: tma.tensor_descriptor, PE_DESC: tma.tensor_descriptor,
               BT: gl.tensor, req: gl.tensor, start: gl.tensor, n_tiles: gl.tensor,
               stride_bt: gl.tensor, page: gl.tensor, ka_bufs: gl.shared_memory_descriptor,
               kp_bufs: gl.shared_memory_descriptor, kfull: gl.shared_memory_descriptor,
               kfree: gl.shared_memory_descriptor) -> None:
    _loader(LAT_DESC, PE_DESC, BT, req, start, n_tiles, stride_bt, page, ka_bufs, kp_bufs,
            kfull, kfree, 1)


@jit
def _zero_rows(ka: gl.shared_memory_descriptor, n_valid: gl.tensor, LOAD: gl.constexpr
               ) -> None:
    """Rows at or past ``n_valid`` of a latent half-tile in shared memory set to zero,
    128 columns at a time."""
    BLOCK_N: gl.constexpr = ka.type.shape[0]
    HALF: gl.constexpr = ka.type.shape[1]
    CH: gl.constexpr = 128 if HALF >= 128 else HALF
    rows = gl.arange(0, BLOCK_N, gl.SliceLayout(1, LOAD))
    keep = (rows < n_valid)[:, None]
    for c in gl.static_range(HALF // CH):
        part = ka.slice(c * CH, CH, dim=1)
        part.store(gl.where(keep, part.load(LOAD), 0.0))


@jit
def _step(k: gl.tensor, acc: gl.tensor, l_i: gl.tensor, m_i: gl.tensor,
          q_s: gl.shared_memory_descriptor, qp_s: gl.shared_memory_descriptor,
          ka_bufs: gl.shared_memory_descriptor, kp_bufs: gl.shared_memory_descriptor,
          p_s: gl.shared_memory_descriptor, m_s: gl.shared_memory_descriptor,
          l_s: gl.shared_memory_descriptor, kfull: gl.shared_memory_descriptor,
          kfree: gl.shared_memory_descriptor, pfull: gl.shared_memory_descriptor,
          n_tiles: gl.tensor, n_last: gl.tensor, qk: gl.tensor, W: gl.constexpr,
          HAS_PREV: gl.constexpr, HAS_OWN: gl.constexpr, S_LAYOUT: gl.constexpr,
          O_LAYOUT: gl.constexpr, ROW: gl.constexpr, LOAD: gl.constexpr
          ) -> gl.tensor:  # (acc, l_i, m_i)
    """Warpgroup ``W``'s turn: the other's tile ``k - 1`` applied to this warpgroup's
    half of the output (``HAS_PREV``) and its own tile ``k`` (``HAS_OWN``): scores,
    softmax, ``P`` published, its value MMA. ``acc`` (``[64, L / 2]`` float32), ``l_i``
    (the row sums) and ``m_i`` (the base-2 row maximum they are relative to) have no MMA
    in flight, on entry and on return."""
    BLOCK_N: gl.constexpr = ka_bufs.type.shape[1]
    BLOCK_H: gl.constexpr = q_s.type.shape[1]
    DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    O_ROWS: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    dtype: gl.constexpr = q_s.dtype
    b = k % 2
    x = (k + 1) % 2  # the buffer of tile k - 1
    if HAS_PREV:
        # first the other's P of tile k - 1 (relative to its maximum then, with its row
        # sums) on this warpgroup's half of the values: tensor work while tile k's last
        # chunks may still be landing
        mbarrier.wait(pfull.index(0), (k - 1) & 1)
        p_prev = p_s.load(DOT_A)
        m_prev = gl.convert_layout(m_s.load(ROW), O_ROWS)
        l_prev = gl.convert_layout(l_s.load(ROW), O_ROWS)
        # every warp of this warpgroup has read them before any writes P again
        gl.thread_barrier()
        mbarrier.arrive(kfree.index(x * 3 + ROPE_CHUNK))
        mbarrier.arrive(kfree.index(x * 3 + 1 - W))
        # (its copy landed before the owner published P; waited for here too, so this
        # warpgroup's MMA is ordered after the copy by a barrier of its own)
        mbarrier.wait(kfull.index(x * 3 + W), ((k - 1) // 2) & 1)
        m1 = gl.maximum(m_i, m_prev)  # finite: m_prev is
        alpha = gl.exp2(m_i - m1)
        beta = gl.exp2(m_prev - m1)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + l_prev * beta
        m_i = m1
        beta_a = gl.convert_layout(beta, gl.SliceLayout(1, DOT_A))
        pp = (p_prev.to(gl.float32) * beta_a[:, None]).to(dtype)
        acc = warpgroup_mma(pp, ka_bufs.index(x * 2 + W), acc, is_async=True)
    if HAS_OWN:
        # the score MMAs, chunk by chunk as the copies land: the rope, the other's half
        # (freed a step earlier), this warpgroup's half (freed when its last value MMA
        # was done, at the end of its previous step)
        ph = (k // 2) & 1
        mbarrier.wait(kfull.index(b * 3 + ROPE_CHUNK), ph)
        s = warpgroup_mma(qp_s, kp_bufs.index(b).permute((1, 0)),
                          gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_LAYOUT),
                          use_acc=False, is_async=True)
        mbarrier.wait(kfull.index(b * 3 + 1 - W), ph)
        s = warpgroup_mma(q_s.index(1 - W), ka_bufs.index(b * 2 + 1 - W).permute((1, 0)), s,
                          is_async=True)
        mbarrier.wait(kfull.index(b * 3 + W), ph)
        s = warpgroup_mma(q_s.index(W), ka_bufs.index(b * 2 + W).permute((1, 0)), s,
                          is_async=True)
        if HAS_PREV:
            acc, s, pp, _, _ = warpgroup_mma_wait(num_outstanding=0,
                                                  deps=(acc, s, pp, q_s, qp_s))
            mbarrier.arrive(kfree.index(x * 3 + W))
        else:
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, q_s, qp_s))[0]
        # the owner is done with the rope and the other's half (the other still reads
        # its half in its value MMA, and frees it then)
        mbarrier.arrive(kfree.index(b * 3 + ROPE_CHUNK))
        mbarrier.arrive(kfree.index(b * 3 + 1 - W))
        n_valid = gl.where(k == n_tiles - 1, n_last, BLOCK_N)
        if n_valid < BLOCK_N:
            _zero_rows(ka_bufs.index(b * 2), n_valid, LOAD)
            _zero_rows(ka_bufs.index(b * 2 + 1), n_valid, LOAD)
            fence_async_shared()
            gl.thread_barrier()
        keys = gl.arange(0, BLOCK_N, gl.SliceLayout(0, S_LAYOUT))
        s = gl.where((keys < n_valid)[None, :], s, float("-inf"))
        # the maximum of the raw scores, scaled once (qk > 0); P in one FMA an element
        m_own = gl.convert_layout(m_i, gl.SliceLayout(1, S_LAYOUT))
        m_new = gl.maximum(m_own, gl.max(s, 1) * qk)
        p = gl.exp2(gl.fma(s, qk, -m_new[:, None]))
        l_k = gl.sum(p, 1)
        p16 = p.to(dtype)
        p_s.store(p16)
        m_s.store(gl.convert_layout(m_new, ROW))
        l_s.store(gl.convert_layout(l_k, ROW))
        gl.thread_barrier()
        mbarrier.arrive(pfull.index(0))
        m_o = gl.convert_layout(m_new, O_ROWS)
        alpha = gl.exp2(m_i - m_o)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + gl.convert_layout(l_k, O_ROWS)
        m_i = m_o
        p_a = gl.convert_layout(p16, DOT_A)
        acc = warpgroup_mma(p_a, ka_bufs.index(b * 2 + W), acc, is_async=True)
        acc, p_a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_a))
        gl.thread_barrier()
        mbarrier.arrive(kfree.index(b * 3 + W))
    else:
        acc, pp = warpgroup_mma_wait(num_outstanding=0, deps=(acc, pp))
        gl.thread_barrier()
        mbarrier.arrive(kfree.index(x * 3 + W))
    return acc, l_i, m_i


@jit
def _consumer(q_s: gl.shared_memory_descriptor, qp_s: gl.shared_memory_descriptor,
              ka_bufs: gl.shared_memory_descriptor, kp_bufs: gl.shared_memory_descriptor,
              p_s: gl.shared_memory_descriptor, m_s: gl.shared_memory_descriptor,
              l_s: gl.shared_memory_descriptor, kfull: gl.shared_memory_descriptor,
              kfree: gl.shared_memory_descriptor, pfull: gl.shared_memory_descriptor,
              n_tiles: gl.tensor, n_last: gl.tensor, qk: gl.tensor, OUT: gl.tensor,
              O_PART: gl.tensor, LSE_PART: gl.tensor, t: gl.tensor, hb: gl.tensor,
              sp: gl.tensor, num_heads: gl.tensor, stride_xt: gl.tensor,
              stride_xh: gl.tensor, stride_pt: gl.tensor, stride_ph: gl.tensor,
              stride_ps: gl.tensor, stride_lt: gl.tensor, stride_lh: gl.tensor,
              single: gl.tensor, W: gl.constexpr) -> None:
    """Warpgroup ``W``: its tiles in turn with the other's, then its half of the output
    normalised and stored (warpgroup 0 also stores the log-sum-exp of a split)."""
    BLOCK_N: gl.constexpr = ka_bufs.type.shape[1]
    HALF: gl.constexpr = ka_bufs.type.shape[2]
    BLOCK_H: gl.constexpr = q_s.type.shape[1]
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    ROW: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    O_ROWS: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)

    acc = gl.zeros([BLOCK_H, HALF], gl.float32, O_LAYOUT)
    l_i = gl.zeros([BLOCK_H], gl.float32, O_ROWS)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, O_ROWS)
    n_own = (n_tiles - W + 1) // 2  # tiles k < n_tiles with k % 2 == W
    first = 0
    if W == 0:
        if n_own > 0:  # tile 0 has no tile before it
            acc, l_i, m_i = _step(
                0, acc, l_i, m_i, q_s, qp_s, ka_bufs, kp_bufs, p_s, m_s, l_s, kfull, kfree,
                pfull, n_tiles, n_last, qk, W, False, True, S_LAYOUT, O_LAYOUT, ROW, LOAD)
        first = 1
    for i in range(first, n_own):
        acc, l_i, m_i = _step(
            2 * i + W, acc, l_i, m_i, q_s, qp_s, ka_bufs, kp_bufs, p_s, m_s, l_s, kfull,
            kfree, pfull, n_tiles, n_last, qk, W, True, True, S_LAYOUT, O_LAYOUT, ROW, LOAD)
    if n_tiles > 0 and (n_tiles - 1) % 2 != W:  # the other's last tile
        acc, l_i, m_i = _step(
            n_tiles, acc, l_i, m_i, q_s, qp_s, ka_bufs, kp_bufs, p_s, m_s, l_s, kfull,
            kfree, pfull, n_tiles, n_last, qk, W, True, False, S_LAYOUT, O_LAYOUT, ROW,
            LOAD)

    seen = l_i > 0.0
    out = acc * (1.0 / gl.where(seen, l_i, 1.0))[:, None]
    oh = hb * BLOCK_H + gl.arange(0, BLOCK_H, O_ROWS)
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
        lse = gl.where(seen, m_i + gl.log2(gl.where(seen, l_i, 1.0)), float("-inf"))
        gl.store(LSE_PART + t * stride_lt + oh * stride_lh + sp, lse,
                 mask=(oh < num_heads) & parts)


@jit
def _first(q_s: gl.shared_memory_descriptor, qp_s: gl.shared_memory_descriptor,
           ka_bufs: gl.shared_memory_descriptor, kp_bufs: gl.shared_memory_descriptor,
           p_s: gl.shared_memory_descriptor, m_s: gl.shared_memory_descriptor,
           l_s: gl.shared_memory_descriptor, kfull: gl.shared_memory_descriptor,
           kfree: gl.shared_memory_descriptor, pfull: gl.shared_memory_descriptor,
           n_tiles: gl.tensor, n_last: gl.tensor, qk: gl.tensor, OUT: gl.tensor,
           O_PART: gl.tensor, LSE_PART: gl.tensor, t: gl.tensor, hb: gl.tensor,
           sp: gl.tensor, num_heads: gl.tensor, stride_xt: gl.tensor, stride_xh: gl.tensor,
           stride_pt: gl.tensor, stride_ph: gl.tensor, stride_ps: gl.tensor,
           stride_lt: gl.tensor, stride_lh: gl.tensor, single: gl.tensor) -> None:
    """The first warpgroup (tiles 0, 2, ...; columns ``0 .. L / 2``)."""
    _consumer(q_s, qp_s, ka_bufs, kp_bufs, p_s, m_s, l_s, kfull, kfree, pfull, n_tiles,
              n_last, qk, OUT, O_PART, LSE_PART, t, hb, sp, num_heads, stride_xt,
              stride_xh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, single, 0)


@jit
def _second(q_s: gl.shared_memory_descriptor, qp_s: gl.shared_memory_descriptor,
            ka_bufs: gl.shared_memory_descriptor, kp_bufs: gl.shared_memory_descriptor,
            p_s: gl.shared_memory_descriptor, m_s: gl.shared_memory_descriptor,
            l_s: gl.shared_memory_descriptor, kfull: gl.shared_memory_descriptor,
            kfree: gl.shared_memory_descriptor, pfull: gl.shared_memory_descriptor,
            n_tiles: gl.tensor, n_last: gl.tensor, qk: gl.tensor, OUT: gl.tensor,
            O_PART: gl.tensor, LSE_PART: gl.tensor, t: gl.tensor, hb: gl.tensor,
            sp: gl.tensor, num_heads: gl.tensor, stride_xt: gl.tensor, stride_xh: gl.tensor,
            stride_pt: gl.tensor, stride_ph: gl.tensor, stride_ps: gl.tensor,
            stride_lt: gl.tensor, stride_lh: gl.tensor, single: gl.tensor) -> None:
    """The second warpgroup (tiles 1, 3, ...; columns ``L / 2 .. L``)."""
    _consumer(q_s, qp_s, ka_bufs, kp_bufs, p_s, m_s, l_s, kfull, kfree, pfull, n_tiles,
              n_last, qk, OUT, O_PART, LSE_PART, t, hb, sp, num_heads, stride_xt,
              stride_xh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, single, 1)


@jit
def mla_decode_paired_kernel(
    Q: gl.tensor, Q_PE: gl.tensor, LAT_DESC: tma.tensor_descriptor,
    PE_DESC: tma.tensor_descriptor, BT: gl.tensor, TOK_REQ: gl.tensor, TOK_POS: gl.tensor,
    OUT: gl.tensor, O_PART: gl.tensor, LSE_PART: gl.tensor,
    stride_qt: gl.tensor, stride_qh: gl.tensor, stride_et: gl.tensor, stride_eh: gl.tensor,
    stride_bt: gl.tensor, stride_xt: gl.tensor, stride_xh: gl.tensor, stride_pt: gl.tensor,
    stride_ph: gl.tensor, stride_ps: gl.tensor, stride_lt: gl.tensor, stride_lh: gl.tensor,
    num_heads: gl.tensor, sm_scale: gl.tensor, num_splits: gl.tensor,
    KV_LORA: gl.constexpr, ROPE: gl.constexpr, PAGE: gl.constexpr, SINGLE: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, num_warps: gl.constexpr,
) -> None:
    """One (head tile, split, token) program; grid ``(head tiles, splits, tokens)``;
    arguments as for :func:`~vllm.attention.ops.gluon_mla_decode_kernels.mla_decode_gluon_kernel`
    (caches in the model's 16-bit dtype), except that ``LAT_DESC``'s blocks are
    ``[BLOCK_N, L / 2]``, half the latent. ``num_warps`` 4: the first warpgroup; the
    second and the loader warp are the partitions' own."""
    gl.static_assert(num_warps == 4, "the default partition is one warpgroup")
    gl.static_assert(PAGE % BLOCK_N == 0, "a tile inside one page")
    gl.static_assert(BLOCK_H == 64, "the M of a warpgroup MMA")
    dtype: gl.constexpr = Q.dtype.element_ty
    HALF: gl.constexpr = KV_LORA // 2
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    CH: gl.constexpr = 128 if HALF >= 128 else HALF

    hb = gl.program_id(0)
    sp = gl.program_id(1)
    t = gl.program_id(2).to(gl.int64)  # offsets of t can pass 2**31
    req = gl.load(TOK_REQ + t).to(gl.int64)
    n_keys = gl.load(TOK_POS + t) + 1
    start, end = split_range(n_keys, num_splits, sp, BLOCK_N)
    n_tiles = gl.cdiv(end - start, BLOCK_N)
    n_last = end - start - (n_tiles - 1) * BLOCK_N  # rows of the last tile

    # two buffers of a tile each: [buffer * 2 + half] latent halves, [buffer] rope
    ka_bufs = gl.allocate_shared_memory(dtype, [4, BLOCK_N, HALF], LAT_DESC.layout)
    kp_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE], PE_DESC.layout)
    p_s = gl.allocate_shared_memory(
        dtype, [BLOCK_H, BLOCK_N], gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N],
                                                                        dtype))
    m_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    l_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    # [buffer * 3 + chunk]: chunks 0, 1 the latent's halves, 2 the rope
    kfull = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
    kfree = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
    pfull = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(6):
        mbarrier.init(kfull.index(i), count=1)
        mbarrier.init(kfree.index(i), count=2)
    mbarrier.init(pfull.index(0), count=1)

    # the query in halves of the latent (the score MMAs' A operands), and the rope part
    q_s = gl.allocate_shared_memory(
        dtype, [2, BLOCK_H, HALF], gl.NVMMASharedLayout.get_default_for([BLOCK_H, HALF],
                                                                        dtype))
    qp_s = gl.allocate_shared_memory(
        dtype, [BLOCK_H, ROPE], gl.NVMMASharedLayout.get_default_for([BLOCK_H, ROPE], dtype))
    offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, LOAD))
    mask_h = (offs_h < num_heads)[:, None]
    cols = gl.arange(0, CH, gl.SliceLayout(0, LOAD))
    q_row = Q + t * stride_qt + offs_h[:, None] * stride_qh
    for h in gl.static_range(2):
        for c in gl.static_range(HALF // CH):
            q_s.index(h).slice(c * CH, CH, dim=1).store(
                gl.load(q_row + h * HALF + c * CH + cols[None, :], mask=mask_h, other=0.0))
    offs_r = gl.arange(0, ROPE, gl.SliceLayout(0, LOAD))
    qp_s.store(gl.load(Q_PE + t * stride_et + offs_h[:, None] * stride_eh + offs_r[None, :],
                       mask=mask_h, other=0.0))
    fence_async_shared()
    gl.thread_barrier()
    qk = sm_scale * LOG2E
    # a partition's arguments are run-time values: the compile-time flags as scalars
    single = (n_tiles * 0 + SINGLE) != 0

    args = (q_s, qp_s, ka_bufs, kp_bufs, p_s, m_s, l_s, kfull, kfree, pfull, n_tiles, n_last,
            qk, OUT, O_PART, LSE_PART, t, hb, sp, num_heads, stride_xt, stride_xh, stride_pt,
            stride_ph, stride_ps, stride_lt, stride_lh, single)
    page = n_tiles * 0 + PAGE
    largs = (LAT_DESC, PE_DESC, BT, req, start, n_tiles, stride_bt, page, ka_bufs, kp_bufs,
             kfull, kfree)
    gl.warp_specialize([
        (_first, args),
        (_second, args),
        (_load_rope, largs),
        (_load_lat0, largs),
        (_load_lat1, largs),
    ], [4, 1, 1, 1], [240, 24, 24, 24])
