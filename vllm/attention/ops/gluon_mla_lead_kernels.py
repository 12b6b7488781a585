"""The dense MLA decode for Hopper (sm_90) with one warpgroup on the scores (Gluon;
caches in the model's 16-bit dtype or scaled fp8; imported on first use).

:mod:`vllm.attention.ops.gluon_mla_decode_kernels` has both warpgroups compute half of
each 64-key tile's scores (``m64n32`` MMAs): the query, the A operand in shared memory,
is read by both, 3 KiB of shared memory a k-step for 32 K multiply-adds, more than the
128 bytes a clock an SM's shared memory gives the tensor cores. Here one warpgroup, the
lead, computes every score of a tile (``m64n64``: 4 KiB a k-step for 64 K), as
FlashMLA's first Hopper kernel does, and the other only applies the probabilities:

* a loader warp copies tile ``k`` into buffer ``k % 2`` (the latent in two halves, the
  rope), once both warpgroups are done with tile ``k - 2``; with an fp8 cache a widening
  warpgroup takes its place (:func:`_widener`);
* the lead (the first warpgroup, the output columns ``[0, L / 2)``) runs the score MMAs
  of tile ``k``, the online softmax on whole rows (no reduction crosses a warpgroup),
  publishes ``P`` and the rescale factor of its rows in shared memory, and applies
  ``P`` from registers to its half of the values, waiting for that MMA before the next
  tile's scores;
* the follower (the second warpgroup, the columns ``[L / 2, L)``) waits for ``P``,
  rescales its accumulator and applies ``P`` from shared memory to its half, while the
  lead goes on to the next tile's scores.

No MMA is left in flight while non-MMA code runs around others: when one was (the lead's
value MMA across the loop's back edge, under the next score MMAs), ptxas serialised
every MMA of the kernel (its C7515: a wait after each), and this kernel ran at 208.7 us
where this schedule was meant to beat the split-scores kernel's 164.5 us
(``benchmarks/results/h200/2026-12-02-8bb1e4e``). ``tests/mla/test_triton_compile.py``
fails on such a serialisation.

Both tiles' buffers stay one tile ahead: a tile is in use from the lead's score MMAs
to the last value MMA, and the next one is copied meanwhile.

Synchronisation (mbarriers): ``kfull[b]`` (buffer ``b`` landed: the copy's bytes),
``kfree[b]`` (two arrivals: the lead once its value MMA of the tile is done, the
follower once its own is), ``pfull`` (``P`` and the factors of a tile published),
``pfree`` (the follower's value MMA, the last reader of ``P``, done), ``lfull`` (the
row sums, after the last tile). The last tile of a split may be partial: the lead
zeroes the latent rows past the request's last position in shared memory (a slot past
it may hold NaN, and a zero probability times NaN is NaN) after its score MMAs, which
see them masked, and before it publishes ``P``.
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

from vllm.attention.ops.gluon_mla_decode_kernels import (
    LOG2E,
    _program_keys,
    constexpr_function,
    jit,
)
from vllm.attention.ops.triton_mla_decode_kernels import row_powers

FOLLOW_REGS: gl.constexpr = gl.constexpr(192)
"""Registers a thread of the follower (its ``[64, L / 2]`` float32 accumulator takes 128)."""
FOLLOW_REGS_FP8: gl.constexpr = gl.constexpr(160)
"""The follower's registers beside the widening warpgroup of an fp8 cache."""
WIDEN_REGS: gl.constexpr = gl.constexpr(120)
"""Registers a thread of the widening warpgroup: a tile's bytes in flight (72) and one
widened chunk."""


@jit
def _load(LAT_DESC: tma.tensor_descriptor, PE_DESC: tma.tensor_descriptor, BT: gl.tensor,
          req: gl.tensor, start: gl.tensor, n_tiles: gl.tensor, stride_bt: gl.tensor,
          page: gl.tensor, ka_bufs: gl.shared_memory_descriptor,
          kp_bufs: gl.shared_memory_descriptor, kfull: gl.shared_memory_descriptor,
          kfree: gl.shared_memory_descriptor) -> None:
    """The loader warp: tile ``k`` into buffer ``b = k % S`` of ``S`` (``kfull``'s
    length; latent halves ``ka_bufs[2 b]``, ``ka_bufs[2 b + 1]``, rope ``kp_bufs[b]``)
    once tile ``k - S`` is done with; the block-table entry read before the wait."""
    BLOCK_N: gl.constexpr = ka_bufs.type.shape[1]
    HALF: gl.constexpr = ka_bufs.type.shape[2]
    S: gl.constexpr = kfull.type.shape[0]
    for k in range(n_tiles):
        b = k % S
        n0 = start + k * BLOCK_N
        blk = gl.load(BT + req * stride_bt + n0 // page)
        row = blk * page + n0 % page  # (a TMA coordinate: 32 bits)
        bar = kfull.index(b)
        mbarrier.wait(kfree.index(b), ((k // S) - 1) & 1, pred=k >= S)
        mbarrier.expect(bar, 2 * LAT_DESC.block_type.nbytes + PE_DESC.block_type.nbytes)
        tma.async_copy_global_to_shared(LAT_DESC, [row, 0], bar, ka_bufs.index(2 * b))
        tma.async_copy_global_to_shared(LAT_DESC, [row, HALF], bar, ka_bufs.index(2 * b + 1))
        tma.async_copy_global_to_shared(PE_DESC, [row, 2 * HALF], bar, kp_bufs.index(b))


@jit
def _prefetch_l2(ptrs: gl.tensor) -> None:
    """Each address's cache line fetched into L2 (``prefetch.global.L2``: nothing waits
    for it)."""
    gl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=gl.int32, is_pure=False, pack=1)


@constexpr_function
def _widen_pair_asm(fp8: int) -> str:
    """PTX widening a word's four fp8 bytes (``fp8`` 1: E4M3, 2: E5M2) into two words of
    two float16 each."""
    kind = "e4m3x2" if fp8 == 1 else "e5m2x2"
    return ("{\n\t.reg .b16 a, b;\n\tmov.b32 {a, b}, $2;\n\t"
            f"cvt.rn.f16x2.{kind} $0, a;\n\tcvt.rn.f16x2.{kind} $1, b;\n\t}}")


@jit
def _widen_words(w: gl.tensor, FP8: gl.constexpr) -> gl.tensor:
    """``[R, C]`` int32 words of four fp8 bytes each (``FP8`` 1: E4M3, 2: E5M2) as
    ``[R, 2 C]`` int32 words of two float16 each, in the bytes' order, exactly (the
    hardware conversion, as ``gluon_mla_decode_kernels.widen_fp8``; NaN stays NaN)."""
    lo, hi = gl.inline_asm_elementwise(_widen_pair_asm(FP8), "=r,=r,r", [w],
                                       dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    return gl.reshape(gl.join(lo, hi), [w.type.shape[0], 2 * w.type.shape[1]])


@jit
def _words_view(buf: gl.shared_memory_descriptor) -> gl.shared_memory_descriptor:
    """A ``[R, C]`` float16 buffer in its MMA layout as ``[R, C / 2]`` int32 words (the
    same bytes: the swizzle is of 16-byte chunks inside 128-byte rows either way)."""
    R: gl.constexpr = buf.type.shape[0]
    C: gl.constexpr = buf.type.shape[1]
    LAY: gl.constexpr = gl.NVMMASharedLayout(buf.type.layout.swizzle_byte_width, 32, 2)
    return buf._reinterpret(gl.int32, [R, C // 2], LAY)


@jit
def _widener(C: gl.tensor, BT: gl.tensor, req: gl.tensor, start: gl.tensor, end: gl.tensor,
             n_tiles: gl.tensor, stride_bt: gl.tensor, stride_cb: gl.tensor,
             stride_cs: gl.tensor, page: gl.tensor, ka_bufs: gl.shared_memory_descriptor,
             kp_bufs: gl.shared_memory_descriptor, kfull: gl.shared_memory_descriptor,
             kfree: gl.shared_memory_descriptor) -> None:
    """The widening warpgroup of an fp8 cache (E4M3 or E5M2, ``C``'s element type): tile
    ``k``'s bytes in registers (loaded during tile ``k - 1``, a part once the same part
    of tile ``k - 1`` is widened), then, once both warpgroups are done with tile
    ``k - 2``, widened exactly to float16 into buffer ``k % 2`` (the layout of the
    loader's copies); rows at or past ``end`` as zeros (their bytes may be anything, NaN
    too). The bytes travel as 32-bit words (a thread's 16 bytes of a row, four words):
    carried from one iteration to the next as bytes, they took twice the registers and
    spilled. The tiles ahead are prefetched into L2 (after tile ``k``, tile ``k + 3``):
    loaded from memory when the widening needed them, their latency held the decode at
    175.7 against 154.6 us (128 heads, E4M3, one H200)."""
    BLOCK_N: gl.constexpr = ka_bufs.type.shape[1]
    HALF: gl.constexpr = ka_bufs.type.shape[2]
    ROPE: gl.constexpr = kp_bufs.type.shape[2]
    FP8: gl.constexpr = 1 if C.dtype.element_ty == gl.float8e4nv else 2
    CH: gl.constexpr = 128 if HALF >= 128 else HALF
    NCH: gl.constexpr = HALF // CH
    # a thread's 16 consecutive bytes of a row, as four words
    WORDS: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    rows = gl.arange(0, BLOCK_N, gl.SliceLayout(1, WORDS))
    cols = gl.arange(0, CH // 4, gl.SliceLayout(0, WORDS))
    cols_r = gl.arange(0, ROPE // 4, gl.SliceLayout(0, WORDS))
    C32 = C.to(gl.pointer_type(gl.int32), bitcast=True)
    # a tile's rows, a page's, are contiguous: its 128-byte lines (offsets clamped into
    # the tile), for the L2 prefetch of the tiles ahead, 1 and 2 before the loop and
    # k + 3 after tile k (the last tile again where there is none: every address is in a
    # block of the split)
    lines = gl.arange(0, 256, gl.BlockedLayout([2], [32], [4], [0])) * 128
    span = BLOCK_N * stride_cs - 1
    bt_row = BT + req * stride_bt
    last = gl.maximum(n_tiles - 1, 0)
    if n_tiles > 0:
        for k0 in range(1, 3):
            n2 = start + gl.minimum(k0, last) * BLOCK_N
            blk2 = gl.load(bt_row + n2 // page).to(gl.int64)
            tile = C + blk2 * stride_cb + (n2 % page).to(gl.int64) * stride_cs
            _prefetch_l2(tile + gl.minimum(lines, span))
            _prefetch_l2(tile + gl.minimum(lines + 256 * 128, span))
    # block-table entries are loaded an iteration before their use: read where a tile's
    # addresses needed them, each was a round trip to memory in the warpgroup's chain
    # (tile k + 1's entry before its loads, tile k + 3's before its prefetch)
    wcb = stride_cb // 4
    wcs = stride_cs // 4
    blk = gl.load(bt_row + start // page, mask=n_tiles > 0, other=0).to(gl.int64)
    base = C32 + blk * wcb + ((start % page) + rows)[:, None].to(gl.int64) * wcs
    valid = (start + rows < end)[:, None]
    x0 = gl.load(base + cols[None, :], mask=valid, other=0)
    x1 = gl.load(base + CH // 4 + cols[None, :], mask=valid, other=0)
    if NCH == 2:
        x2 = gl.load(base + 2 * CH // 4 + cols[None, :], mask=valid, other=0)
        x3 = gl.load(base + 3 * CH // 4 + cols[None, :], mask=valid, other=0)
    xr = gl.load(base + 2 * HALF // 4 + cols_r[None, :], mask=valid, other=0)
    blk_next = gl.load(bt_row + (start + gl.minimum(1, last) * BLOCK_N) // page,
                       mask=n_tiles > 0, other=0)
    for k in range(n_tiles):
        b = k % 2
        # tile k + 1's rows (after the last tile: none valid, in the last tile's block)
        n1 = start + (k + 1) * BLOCK_N
        # (the row offsets from the tile's position, not hoisted out of the loop: kept
        # from the kernel's entry they spilled)
        base = (C32 + blk_next.to(gl.int64) * wcb
                + ((n1 % page) + rows)[:, None].to(gl.int64) * wcs)
        valid = (n1 + rows < end)[:, None]
        blk_next = gl.load(bt_row + (start + gl.minimum(k + 2, last) * BLOCK_N) // page)
        mbarrier.wait(kfree.index(b), ((k // 2) - 1) & 1, pred=k >= 2)
        wa0 = _words_view(ka_bufs.index(2 * b))
        wa1 = _words_view(ka_bufs.index(2 * b + 1))
        if NCH == 2:
            wa0.slice(0, CH // 2, dim=1).store(_widen_words(x0, FP8))
            x0 = gl.load(base + cols[None, :], mask=valid, other=0)
            wa0.slice(CH // 2, CH // 2, dim=1).store(_widen_words(x1, FP8))
            x1 = gl.load(base + CH // 4 + cols[None, :], mask=valid, other=0)
            wa1.slice(0, CH // 2, dim=1).store(_widen_words(x2, FP8))
            x2 = gl.load(base + 2 * CH // 4 + cols[None, :], mask=valid, other=0)
            wa1.slice(CH // 2, CH // 2, dim=1).store(_widen_words(x3, FP8))
            x3 = gl.load(base + 3 * CH // 4 + cols[None, :], mask=valid, other=0)
        else:
            wa0.store(_widen_words(x0, FP8))
            x0 = gl.load(base + cols[None, :], mask=valid, other=0)
            wa1.store(_widen_words(x1, FP8))
            x1 = gl.load(base + CH // 4 + cols[None, :], mask=valid, other=0)
        _words_view(kp_bufs.index(b)).store(_widen_words(xr, FP8))
        xr = gl.load(base + 2 * HALF // 4 + cols_r[None, :], mask=valid, other=0)
        # visible to the MMAs (the async proxy), every warp's, before the arrival
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(kfull.index(b))
        n2 = start + gl.minimum(k + 3, last) * BLOCK_N
        blk_pf = gl.load(bt_row + n2 // page)
        tile = C + blk_pf.to(gl.int64) * stride_cb + (n2 % page).to(gl.int64) * stride_cs
        _prefetch_l2(tile + gl.minimum(lines, span))
        _prefetch_l2(tile + gl.minimum(lines + 256 * 128, span))


@jit
def _query_buffers(dtype: gl.constexpr, BLOCK_H: gl.constexpr, HALF: gl.constexpr,
                   ROPE: gl.constexpr) -> gl.tensor:
    """Shared memory for a head tile's query in the MMAs' ``dtype``, in their default
    layouts: ``[2, BLOCK_H, HALF]`` the latent in halves, ``[BLOCK_H, ROPE]`` the rope
    (filled by :func:`_query_to_shared`)."""
    q_s = gl.allocate_shared_memory(
        dtype, [2, BLOCK_H, HALF], gl.NVMMASharedLayout.get_default_for([BLOCK_H, HALF],
                                                                        dtype))
    qp_s = gl.allocate_shared_memory(
        dtype, [BLOCK_H, ROPE], gl.NVMMASharedLayout.get_default_for([BLOCK_H, ROPE], dtype))
    return q_s, qp_s


@jit
def _query_pointers(Q: gl.tensor, Q_PE: gl.tensor, t: gl.tensor, hb: gl.tensor,
                    num_heads: gl.tensor, stride_qt: gl.tensor, stride_qh: gl.tensor,
                    stride_et: gl.tensor, stride_eh: gl.tensor, BLOCK_H: gl.constexpr,
                    CH: gl.constexpr, ROPE: gl.constexpr, LOAD: gl.constexpr) -> gl.tensor:
    """Where token ``t``'s query of head tile ``hb`` is, in ``LOAD``: the heads' rows of
    the latent part (add ``c * CH + cols[None, :]`` for its ``c``-th ``CH`` columns),
    ``cols``, the rope part's ``[BLOCK_H, ROPE]`` pointers, and the mask of the heads
    there are. Returns ``(q_row, cols, qp_ptr, mask_h)``."""
    offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, LOAD))
    mask_h = (offs_h < num_heads)[:, None]
    cols = gl.arange(0, CH, gl.SliceLayout(0, LOAD))
    q_row = Q + t * stride_qt + offs_h[:, None] * stride_qh
    offs_r = gl.arange(0, ROPE, gl.SliceLayout(0, LOAD))
    qp_ptr = Q_PE + t * stride_et + offs_h[:, None] * stride_eh + offs_r[None, :]
    return q_row, cols, qp_ptr, mask_h


@jit
def _query_to_shared(Q: gl.tensor, Q_PE: gl.tensor, t: gl.tensor, hb: gl.tensor,
                     num_heads: gl.tensor, stride_qt: gl.tensor, stride_qh: gl.tensor,
                     stride_et: gl.tensor, stride_eh: gl.tensor, sm_scale: gl.tensor,
                     K_SCALE: gl.tensor, q_s: gl.shared_memory_descriptor,
                     qp_s: gl.shared_memory_descriptor, qk_s: gl.shared_memory_descriptor,
                     TOP: gl.constexpr, LOAD: gl.constexpr,
                     PERMUTE: gl.constexpr = False) -> gl.tensor:
    """Token ``t``'s query of head tile ``hb`` into shared memory, the score MMAs' A
    operands (``q_s``: the latent in halves, ``qp_s``: the rope, in their dtype), and in
    ``qk_s`` what turns a head's raw scores into base-2 logits; visible to the MMAs
    after. ``TOP`` 0: the query as it is (a cache in the model's dtype). Else (a scaled
    fp8 cache) each head scaled by the power of two that puts its largest magnitude in
    ``[2**TOP, 2**(TOP + 1))`` (:func:`row_powers`; a pass over the query first) and
    converted, that power and ``K_SCALE`` multiplying the scores. ``PERMUTE``: the
    columns of each 128 of the latent and of the rope put in the order of
    :func:`score_order` (the few-heads kernel reads an fp8 cache's bytes that way).
    Returns what multiplies the output: ``K_SCALE``'s value, or 1."""
    BLOCK_H: gl.constexpr = q_s.type.shape[1]
    HALF: gl.constexpr = q_s.type.shape[2]
    ROPE: gl.constexpr = qp_s.type.shape[1]
    dtype: gl.constexpr = q_s.dtype
    CH: gl.constexpr = 128 if HALF >= 128 else HALF
    q_row, cols, qp_ptr, mask_h = _query_pointers(Q, Q_PE, t, hb, num_heads, stride_qt,
                                                  stride_qh, stride_et, stride_eh, BLOCK_H,
                                                  CH, ROPE, LOAD)
    qk = gl.full([BLOCK_H], sm_scale * LOG2E, gl.float32, gl.SliceLayout(1, LOAD))
    oscale = sm_scale * 0.0 + 1.0
    if TOP != 0:
        amax = gl.max(gl.abs(gl.load(qp_ptr, mask=mask_h, other=0.0).to(gl.float32)), 1)
        for c in gl.static_range(2 * HALF // CH):
            x = gl.load(q_row + c * CH + cols[None, :], mask=mask_h, other=0.0)
            amax = gl.maximum(amax, gl.max(gl.abs(x.to(gl.float32)), 1))
        down, up = row_powers(amax, TOP)
        oscale = gl.load(K_SCALE)
        qk = qk * oscale * up
    for c in gl.static_range(2 * HALF // CH):
        x = gl.load(q_row + c * CH + cols[None, :], mask=mask_h, other=0.0)
        if TOP != 0:
            x = (x.to(gl.float32) * down[:, None]).to(dtype)
        if PERMUTE:
            x = to_score_order(x)
        q_s.index(c * CH // HALF).slice(c * CH % HALF, CH, dim=1).store(x)
    x = gl.load(qp_ptr, mask=mask_h, other=0.0)
    if TOP != 0:
        x = (x.to(gl.float32) * down[:, None]).to(dtype)
    if PERMUTE:
        x = to_score_order(x)
    qp_s.store(x)
    qk_s.store(qk)
    fence_async_shared()
    gl.thread_barrier()
    return oscale


@constexpr_function
def log2_int(n: int) -> int:
    return int(n).bit_length() - 1


@constexpr_function
def dims_order(src: list[str], dst: list[str]) -> list[int]:
    """The dims' order that turns a tensor whose dims are ``src``'s bits (named, low to
    high; one dim of 2 each, the highest first) into one whose dims are ``dst``'s."""
    return [src[::-1].index(name) for name in dst[::-1]]


@constexpr_function
def score_order(ROWS: int, W: int) -> tuple[list[int], list[int]]:
    """The shape and dims' order that turn ``[ROWS, W]`` (``W`` stored columns, a power
    of two, at least 16) into the order in which the columns are a score MMA's K when a
    thread reads 16 (or ``W / 4``) consecutive bytes of a row into its A fragments
    (:func:`to_score_order`). Of the column's bits in the MMA (low to high) a thread's
    fragment holds ``e`` (the pair in a register), the thread of its quad ``c`` (2
    bits), ``h`` (the second register pair), and the steps ``j``; stored: ``e``, ``h``,
    ``j``, then ``c``."""
    j = [f"j{i}" for i in range(log2_int(W) - 4)]
    stored, operand = ["e", "h", *j, "c0", "c1"], ["e", "c0", "c1", "h", *j]
    return [ROWS] + [2] * len(stored), [0] + [1 + i for i in dims_order(stored, operand)]


@jit
def reorder(x: gl.tensor, SHAPE: gl.constexpr, ORDER: gl.constexpr) -> gl.tensor:
    """``x`` seen as ``SHAPE`` (its indices' bits as dims of 2), those dims put in
    ``ORDER``, and seen as ``x``'s shape again: the elements renumbered in registers
    (which register holds which element changes, not what it holds)."""
    return gl.reshape(gl.permute(gl.reshape(x, SHAPE), ORDER.value), x.type.shape)


@jit
def to_score_order(x: gl.tensor) -> gl.tensor:
    """``x`` (``[rows, W]``) with its columns in the order of :func:`score_order`."""
    ROWS: gl.constexpr = x.type.shape[0]
    W: gl.constexpr = x.type.shape[1]
    SHAPE: gl.constexpr = score_order(ROWS, W)[0]
    ORDER: gl.constexpr = score_order(ROWS, W)[1]
    return reorder(x, SHAPE, ORDER)


@jit
def _zero_rows(ka: gl.shared_memory_descriptor, n_valid: gl.tensor, LOAD: gl.constexpr
               ) -> None:
    """Rows at or past ``n_valid`` of a latent half-tile in shared memory set to zero,
    64 columns at a time."""
    BLOCK_N: gl.constexpr = ka.type.shape[0]
    HALF: gl.constexpr = ka.type.shape[1]
    CH: gl.constexpr = 64 if HALF >= 64 else HALF
    rows = gl.arange(0, BLOCK_N, gl.SliceLayout(1, LOAD))
    keep = (rows < n_valid)[:, None]
    for c in gl.static_range(HALF // CH):
        part = ka.slice(c * CH, CH, dim=1)
        part.store(gl.where(keep, part.load(LOAD), 0.0))


@jit
def _store_half(acc: gl.tensor, l_i: gl.tensor, OUT: gl.tensor, O_PART: gl.tensor,
                t: gl.tensor, hb: gl.tensor, sp: gl.tensor, num_heads: gl.tensor,
                stride_xt: gl.tensor, stride_xh: gl.tensor, stride_pt: gl.tensor,
                stride_ph: gl.tensor, stride_ps: gl.tensor, single: gl.tensor,
                oscale: gl.tensor, W: gl.constexpr) -> None:
    """Warpgroup ``W``'s half of the output, normalised by the row sums ``l_i``: the
    output of one split, or the part of a split (masks, not a branch: ``single`` is a
    run-time value in a partition); ``oscale`` multiplies it (an fp8 cache's scale).
    The stores take the accumulator's layout, whatever it is."""
    BLOCK_H: gl.constexpr = acc.type.shape[0]
    HALF: gl.constexpr = acc.type.shape[1]
    O_LAYOUT: gl.constexpr = acc.type.layout
    O_ROWS: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    l_i = gl.convert_layout(l_i, O_ROWS)
    out = acc * (oscale / gl.where(l_i > 0.0, l_i, 1.0))[:, None]
    oh = hb * BLOCK_H + gl.arange(0, BLOCK_H, O_ROWS)
    oc = W * HALF + gl.arange(0, HALF, gl.SliceLayout(0, O_LAYOUT))
    omask = (oh < num_heads)[:, None]
    gl.store(OUT + t * stride_xt + oh[:, None] * stride_xh + oc[None, :],
             out.to(OUT.dtype.element_ty), mask=omask & single)
    gl.store(O_PART + t * stride_pt + oh[:, None] * stride_ph + sp * stride_ps + oc[None, :],
             out, mask=omask & (single == 0))


@jit
def _lead(q_s: gl.shared_memory_descriptor, qp_s: gl.shared_memory_descriptor,
          ka_bufs: gl.shared_memory_descriptor, kp_bufs: gl.shared_memory_descriptor,
          p_s: gl.shared_memory_descriptor, a_s: gl.shared_memory_descriptor,
          l_s: gl.shared_memory_descriptor, kfull: gl.shared_memory_descriptor,
          kfree: gl.shared_memory_descriptor, pfull: gl.shared_memory_descriptor,
          pfree: gl.shared_memory_descriptor, lfull: gl.shared_memory_descriptor,
          n_tiles: gl.tensor, n_last: gl.tensor, qk_s: gl.shared_memory_descriptor,
          oscale: gl.tensor, OUT: gl.tensor, O_PART: gl.tensor, LSE_PART: gl.tensor,
          t: gl.tensor, hb: gl.tensor, sp: gl.tensor, num_heads: gl.tensor,
          stride_xt: gl.tensor, stride_xh: gl.tensor, stride_pt: gl.tensor,
          stride_ph: gl.tensor, stride_ps: gl.tensor, stride_lt: gl.tensor,
          stride_lh: gl.tensor, single: gl.tensor) -> None:
    """The lead warpgroup: every tile's scores and softmax, ``P`` published, its half of
    the values; then its half of the output, the row sums for the follower, and the
    log-sum-exp of a split."""
    BLOCK_N: gl.constexpr = ka_bufs.type.shape[1]
    HALF: gl.constexpr = ka_bufs.type.shape[2]
    BLOCK_H: gl.constexpr = q_s.type.shape[1]
    dtype: gl.constexpr = q_s.dtype
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    S_ROWS: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    O_ROWS: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)

    acc = gl.zeros([BLOCK_H, HALF], gl.float32, O_LAYOUT)
    l_i = gl.zeros([BLOCK_H], gl.float32, S_ROWS)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, S_ROWS)
    qk = qk_s.load(S_ROWS)  # what turns a head's raw scores into base-2 logits (> 0)
    for k in range(n_tiles):
        b = k % 2
        mbarrier.wait(kfull.index(b), (k // 2) & 1)
        s = warpgroup_mma(qp_s, kp_bufs.index(b).permute((1, 0)),
                          gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_LAYOUT),
                          use_acc=False, is_async=True)
        s = warpgroup_mma(q_s.index(0), ka_bufs.index(2 * b).permute((1, 0)), s,
                          is_async=True)
        s = warpgroup_mma(q_s.index(1), ka_bufs.index(2 * b + 1).permute((1, 0)), s,
                          is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, q_s, qp_s))[0]
        n_valid = gl.where(k == n_tiles - 1, n_last, BLOCK_N)
        if n_valid < BLOCK_N:
            _zero_rows(ka_bufs.index(2 * b), n_valid, LOAD)
            _zero_rows(ka_bufs.index(2 * b + 1), n_valid, LOAD)
            keys = gl.arange(0, BLOCK_N, gl.SliceLayout(0, S_LAYOUT))
            s = gl.where((keys < n_valid)[None, :], s, float("-inf"))
        m_i, l_i, p, alpha = row_softmax(s, m_i, l_i, qk)
        p16 = p.to(dtype)
        # the follower's value MMA of tile k - 1 is done with P and its factors
        mbarrier.wait(pfree.index(0), (k - 1) & 1, pred=k > 0)
        p_s.store(p16)
        a_s.store(alpha)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(pfull.index(0))
        acc = acc * gl.convert_layout(alpha, O_ROWS)[:, None]
        p_a = gl.convert_layout(p16, DOT_A)
        acc = warpgroup_mma(p_a, ka_bufs.index(2 * b), acc, is_async=True)
        # waited for here, not across the loop's back edge: with an MMA in flight while
        # the next score MMAs are issued, ptxas serialises every MMA of the kernel
        # (C7515, a wait after each)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_a))[0]
        mbarrier.arrive(kfree.index(b))

    l_s.store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(lfull.index(0))
    _store_half(acc, l_i, OUT, O_PART, t, hb, sp, num_heads,
                stride_xt, stride_xh, stride_pt, stride_ph, stride_ps, single, oscale, 0)
    _store_lse(m_i, l_i, 0.0, LSE_PART, t, hb, sp, num_heads, stride_lt, stride_lh, single)


@jit
def row_softmax(s: gl.tensor, m_i: gl.tensor, l_i: gl.tensor, qk: gl.tensor) -> gl.tensor:
    """One tile of the online softmax along the rows of the raw scores ``s`` (heads as
    rows; ``qk`` > 0 turns a head's raw scores into base-2 logits): the maximum taken
    on the raw scores and scaled once, ``P`` in one FMA an element. Returns the new
    running maxima, the row sums, ``P`` (float32) and the rows' rescale factors. Every
    tile has a key, so the new maxima are finite."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk)
    p = gl.exp2(gl.fma(s, qk[:, None], -m_new[:, None]))
    alpha = gl.exp2(m_i - m_new)
    return m_new, l_i * alpha + gl.sum(p, 1), p, alpha


@jit
def _store_lse(m_i: gl.tensor, l_i: gl.tensor, BIAS: gl.constexpr, LSE_PART: gl.tensor,
               t: gl.tensor, hb: gl.tensor, sp: gl.tensor, num_heads: gl.tensor,
               stride_lt: gl.tensor, stride_lh: gl.tensor, single: gl.tensor) -> None:
    """A split's base-2 log-sum-exp of head tile ``hb`` from its running maxima ``m_i``
    and sums ``l_i`` (``-inf`` for a split that saw no key), less ``BIAS`` (the ``log2``
    of a factor the probabilities carried); nothing when the program's split is the
    only one (``single``)."""
    BLOCK_H: gl.constexpr = m_i.type.shape[0]
    seen = l_i > 0.0
    lse = m_i + gl.log2(gl.where(seen, l_i, 1.0))
    if BIAS != 0.0:
        lse = lse - BIAS
    lse = gl.where(seen, lse, float("-inf"))
    lh = hb * BLOCK_H + gl.arange(0, BLOCK_H, m_i.type.layout)
    gl.store(LSE_PART + t * stride_lt + lh * stride_lh + sp, lse,
             mask=(lh < num_heads) & (single == 0))


@jit
def _follow_values(vbufs: gl.shared_memory_descriptor, p_s: gl.shared_memory_descriptor,
                   a_s: gl.shared_memory_descriptor, vfull: gl.shared_memory_descriptor,
                   vfree: gl.shared_memory_descriptor, pfull: gl.shared_memory_descriptor,
                   pfree: gl.shared_memory_descriptor, n_tiles: gl.tensor,
                   TRANSPOSED: gl.constexpr) -> gl.tensor:
    """The follower warpgroup's loop: each tile's ``P`` (from the lead) applied to the
    second half of the values, ``vbufs[2 (k % 2) + 1]`` (``vfull`` / ``vfree`` its
    barriers), the accumulator rescaled by the lead's factors first; returns the
    accumulator. ``TRANSPOSED``: the values are the fp8-MMA kernel's ``[L / 2, keys]``
    E4M3 copies (an fp8 MMA, K 32), else ``[keys, L / 2]`` 16-bit tiles (K 16)."""
    BLOCK_H: gl.constexpr = p_s.type.shape[0]
    HALF: gl.constexpr = vbufs.type.shape[1] if TRANSPOSED else vbufs.type.shape[2]
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1],
        instr_shape=[16, HALF, 32 if TRANSPOSED else 16])
    O_ROWS: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)

    acc = gl.zeros([BLOCK_H, HALF], gl.float32, O_LAYOUT)
    for k in range(n_tiles):
        b = k % 2
        mbarrier.wait(pfull.index(0), k & 1)
        # (landed before the lead published P; waited for here too, so this MMA is
        # ordered after the copy by a barrier of its own)
        mbarrier.wait(vfull.index(b), (k // 2) & 1)
        alpha = a_s.load(O_ROWS)
        acc = acc * alpha[:, None]
        if TRANSPOSED:
            acc = warpgroup_mma(p_s, vbufs.index(2 * b + 1).permute((1, 0)), acc,
                                is_async=True)
        else:
            acc = warpgroup_mma(p_s, vbufs.index(2 * b + 1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_s))[0]
        # every warp of the warpgroup is done with P, its factors and the buffer
        gl.thread_barrier()
        mbarrier.arrive(pfree.index(0))
        mbarrier.arrive(vfree.index(b))
    return acc


@jit
def _follow(ka_bufs: gl.shared_memory_descriptor, p_s: gl.shared_memory_descriptor,
            a_s: gl.shared_memory_descriptor, l_s: gl.shared_memory_descriptor,
            kfull: gl.shared_memory_descriptor, kfree: gl.shared_memory_descriptor,
            pfull: gl.shared_memory_descriptor, pfree: gl.shared_memory_descriptor,
            lfull: gl.shared_memory_descriptor, n_tiles: gl.tensor, oscale: gl.tensor,
            OUT: gl.tensor, O_PART: gl.tensor, t: gl.tensor, hb: gl.tensor, sp: gl.tensor,
            num_heads: gl.tensor, stride_xt: gl.tensor, stride_xh: gl.tensor,
            stride_pt: gl.tensor, stride_ph: gl.tensor, stride_ps: gl.tensor,
            single: gl.tensor) -> None:
    """The follower warpgroup: each tile's ``P`` (from the lead) on the second half of
    the values (:func:`_follow_values`), then that half of the output."""
    acc = _follow_values(ka_bufs, p_s, a_s, kfull, kfree, pfull, pfree, n_tiles, False)
    mbarrier.wait(lfull.index(0), 0)
    l_i = l_s.load(gl.SliceLayout(1, acc.type.layout))
    _store_half(acc, l_i, OUT, O_PART, t, hb, sp, num_heads, stride_xt, stride_xh,
                stride_pt, stride_ph, stride_ps, single, oscale, 1)


@jit
def _tile_buffers(LAT_DESC: tma.tensor_descriptor, PE_DESC: tma.tensor_descriptor,
                  dtype: gl.constexpr, BLOCK_N: gl.constexpr, HALF: gl.constexpr,
                  ROPE: gl.constexpr, FP8: gl.constexpr) -> gl.tensor:
    """Two buffers of a tile in the MMAs' ``dtype``: ``[buffer * 2 + half]`` latent
    halves ``[BLOCK_N, HALF]``, ``[buffer]`` the rope ``[BLOCK_N, ROPE]``; in the copies'
    layouts for a 16-bit cache (``FP8`` 0), else in the MMAs' default ones (widened
    there)."""
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
    return ka_bufs, kp_bufs


@jit
def mla_decode_lead_kernel(
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
    arguments as for :func:`~vllm.attention.ops.gluon_mla_decode_kernels.mla_decode_gluon_kernel`,
    except that ``LAT_DESC``'s blocks are ``[BLOCK_N, L / 2]``, half the latent (used for
    16-bit caches only). ``num_warps`` 4: the lead warpgroup; the follower and the loader
    (a warp copying tiles of a 16-bit cache, a warpgroup widening those of an fp8 one,
    ``FP8`` 1: E4M3, 2: E5M2) are the partitions' own.

    fp8: the dots run in float16 on the stored values, as in the split-scores kernel: the
    query scaled into float16 a head at a time by a power of two, that power and
    ``K_SCALE`` multiplying the scores, ``K_SCALE`` the output."""
    gl.static_assert(num_warps == 4, "the default partition is one warpgroup")
    gl.static_assert(PAGE % BLOCK_N == 0, "a tile inside one page")
    gl.static_assert(BLOCK_H == 64, "the M of a warpgroup MMA")
    dtype: gl.constexpr = gl.float16 if FP8 != 0 else Q.dtype.element_ty
    HALF: gl.constexpr = KV_LORA // 2
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    F32_ROW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    hb, sp, t, req, start, end, n_tiles, n_last = _program_keys(TOK_REQ, TOK_POS,
                                                                num_splits, BLOCK_N)

    # two buffers of a tile each: [buffer * 2 + half] latent halves, [buffer] rope
    ka_bufs, kp_bufs = _tile_buffers(LAT_DESC, PE_DESC, dtype, BLOCK_N, HALF, ROPE, FP8)
    p_s = gl.allocate_shared_memory(
        dtype, [BLOCK_H, BLOCK_N], gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N],
                                                                        dtype))
    a_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], F32_ROW)
    l_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], F32_ROW)
    qk_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], F32_ROW)
    kfull = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pfull = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    pfree = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    lfull = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kfull.index(i), count=1)
        mbarrier.init(kfree.index(i), count=2)
    mbarrier.init(pfull.index(0), count=1)
    mbarrier.init(pfree.index(0), count=1)
    mbarrier.init(lfull.index(0), count=1)

    # the query in halves of the latent (the score MMAs' A operands), and the rope part
    q_s, qp_s = _query_buffers(dtype, BLOCK_H, HALF, ROPE)
    # an fp8 cache: the query scaled into float16's top binades
    oscale = _query_to_shared(Q, Q_PE, t, hb, num_heads, stride_qt, stride_qh, stride_et,
                              stride_eh, sm_scale, K_SCALE, q_s, qp_s, qk_s,
                              14 if FP8 != 0 else 0, LOAD)
    # a partition's arguments are run-time values: the compile-time flag as a scalar
    single = (n_tiles * 0 + SINGLE) != 0

    args = (q_s, qp_s, ka_bufs, kp_bufs, p_s, a_s, l_s, kfull, kfree, pfull, pfree, lfull,
            n_tiles, n_last, qk_s, oscale, OUT, O_PART, LSE_PART, t, hb, sp, num_heads,
            stride_xt, stride_xh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
            single)
    # the follower's own: what it reads
    fargs = (ka_bufs, p_s, a_s, l_s, kfull, kfree, pfull, pfree, lfull, n_tiles, oscale, OUT,
             O_PART, t, hb, sp, num_heads, stride_xt, stride_xh, stride_pt, stride_ph,
             stride_ps, single)
    page = n_tiles * 0 + PAGE
    if FP8 == 0:
        largs = (LAT_DESC, PE_DESC, BT, req, start, n_tiles, stride_bt, page, ka_bufs,
                 kp_bufs, kfull, kfree)
        gl.warp_specialize([
            (_lead, args),
            (_follow, fargs),
            (_load, largs),
        ], [4, 1], [FOLLOW_REGS, 24])
    else:
        wargs = (C, BT, req, start, end, n_tiles, stride_bt, stride_cb, stride_cs, page,
                 ka_bufs, kp_bufs, kfull, kfree)
        gl.warp_specialize([
            (_lead, args),
            (_follow, fargs),
            (_widener, wargs),
        ], [4, 4], [FOLLOW_REGS_FP8, WIDEN_REGS])
