"""Triton kernels of the paged attention family (imported only when Triton is).

One kernel body serves every layout of :mod:`vllm.attention.ops.paged_kv`: the
layout reaches it as strides (runtime) and split factors (constants), so the
address math folds to the plain strided form for the split layouts. Launch and
argument preparation: :mod:`vllm.attention.ops.triton_paged_attention`.

Tiling: a program owns ``BLOCK_Q`` query tokens of one request times the
``GROUP`` query heads of one kv head (``BLOCK_M = BLOCK_Q * GROUP`` rows, padded to a
power of two), loops over the keys in tiles of ``BLOCK_N`` with an online softmax in
float32, and feeds ``tl.dot`` the query's dtype (bf16/fp16; fp32 in IEEE mode).
Dequantisation is folded into the logits and the accumulator: a per-tensor or
per-head fp8 scale multiplies ``q.k`` and the final ``p.v``; a per-(token, head) scale
multiplies the logits' columns and ``p``'s columns. With ``NUM_SPLITS > 1`` a program
covers one of ``NUM_SPLITS`` chunks of the key range and writes an unnormalised
partial result that :func:`reduce_splits_kernel` merges.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import triton
import triton.language as tl

"""A tensor argument; a pointer inside the kernel."""

jit: Callable[[Callable[..., Any]], Any] = triton.jit
"""``triton.jit`` with a type, so mypy accepts the decorated kernels (as ``Any``)."""

LOG2E = 1.4426950408889634


@jit
def _find_request(qsl_ptr: tl.tensor, num_reqs: int, pid: tl.tensor, BLOCK_Q: tl.constexpr) -> tl.tensor:
    """Request owning global query-tile ``pid``; request ``i``'s tiles start at
    ``query_start_loc[i] // BLOCK_Q + i`` (so the grid needs no host-side table)."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if start <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@jit
def _token_offsets(off: tl.tensor, s_hi: int, s_lo: int, SPLIT: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr) -> tl.tensor:
    """In-block offset ``off`` -> element offset (``SPLIT`` = token split factor)."""
    if SPLIT == BLOCK_SIZE:
        return off * s_lo
    else:
        return (off // SPLIT) * s_hi + (off % SPLIT) * s_lo


@jit
def _dim_offsets(offs_d: tl.tensor, s_hi: int, S_LO: tl.constexpr, SPLIT: tl.constexpr,
                 HEAD: tl.constexpr) -> tl.tensor:
    """Head-dim index -> element offset (``SPLIT`` = dim split factor)."""
    if SPLIT == HEAD:
        return offs_d * S_LO
    else:
        return (offs_d // SPLIT) * s_hi + (offs_d % SPLIT) * S_LO


@jit
def _dot(a: tl.tensor, b: tl.tensor, IEEE: tl.constexpr, INTERPRETER: tl.constexpr) -> tl.tensor:
    """``a @ b`` in float32. The interpreter multiplies bf16 as raw uint16 bits, so
    there both sides (already rounded to the dot dtype) are widened first."""
    if INTERPRETER:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@jit
def _attend_tile(
    start: tl.tensor, hi: tl.tensor, q: tl.tensor, m_i: tl.tensor, l_i: tl.tensor, acc: tl.tensor,
    q_pos: tl.tensor, row_ok: tl.tensor, tok: tl.tensor, ctx_len: tl.tensor, kv_head: tl.tensor,
    k_ptr: tl.tensor, k_sb: int, k_head: tl.tensor, k_sth: int, k_stl: int, k_dim: tl.tensor,
    v_ptr: tl.tensor, v_sb: int, v_head: tl.tensor, v_sth: int, v_stl: int, v_dim: tl.tensor,
    ks_ptr: tl.tensor, ks_sb: int, ks_st: int, ks_sh: int, k_sc: tl.tensor,
    vs_ptr: tl.tensor, vs_sb: int, vs_st: int, vs_sh: int,
    bt_row: tl.tensor, tree_ptr: tl.tensor, tree_s: int,
    qk_scale: float, softcap_log2: float, window: int,
    BLOCK_N: tl.constexpr, HEAD_K: tl.constexpr, HEAD_V: tl.constexpr,
    HEAD_K_PAD: tl.constexpr, HEAD_V_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    K_TS: tl.constexpr, V_TS: tl.constexpr,
    DEQUANT: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_TREE: tl.constexpr, FP32_DOT: tl.constexpr,
    INTERPRETER: tl.constexpr, MASKED: tl.constexpr = True,
) -> tl.tensor:
    """Keys ``start .. start + BLOCK_N`` (clipped to ``hi``): one online-softmax step.
    Returns the updated ``(m_i, l_i, acc)``. ``MASKED=False``: the caller knows every
    key of the tile is below ``hi`` and visible to every row (no bounds, causal,
    window or tree masks are built)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hi
    off = offs_n % BLOCK_SIZE
    if BLOCK_SIZE % BLOCK_N == 0:
        # The whole tile lies in one page: one block-table read.
        blk = tl.load(bt_row + start // BLOCK_SIZE).to(tl.int64)
    elif MASKED:
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE).to(tl.int64)

    k_tok = _token_offsets(off, k_sth, k_stl, K_TS, BLOCK_SIZE)
    k_ptrs = k_ptr + (blk * k_sb + k_head + k_tok)[None, :] + k_dim[:, None]
    if HEAD_K == HEAD_K_PAD:
        if MASKED:
            k = tl.load(k_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
    else:
        dk_ok = tl.arange(0, HEAD_K_PAD) < HEAD_K
        if MASKED:
            k = tl.load(k_ptrs, mask=n_ok[None, :] & dk_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=dk_ok[:, None], other=0.0)
    s = _dot(q, k.to(q.dtype), FP32_DOT, INTERPRETER)
    if DEQUANT == 1:
        s = s * k_sc
    if DEQUANT == 2:
        if MASKED:
            k_tok_sc = tl.load(ks_ptr + blk * ks_sb + off * ks_st + kv_head * ks_sh,
                               mask=n_ok, other=0.0)
        else:
            k_tok_sc = tl.load(ks_ptr + blk * ks_sb + off * ks_st + kv_head * ks_sh)
        s = s * k_tok_sc[None, :]
    if MASKED or HAS_SOFTCAP:
        if HAS_SOFTCAP:
            # cap * tanh(x / cap) with tanh(y) = 1 - 2 / (exp(2y) + 1), in log2 units.
            e = tl.exp2(s * qk_scale)
            s = softcap_log2 * (1.0 - 2.0 / (e + 1.0))
        else:
            s = s * qk_scale

        if MASKED:
            visible = n_ok[None, :] & row_ok[:, None]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible = visible & ((q_pos[:, None] - offs_n[None, :]) < window)
            if HAS_TREE:
                j = offs_n - ctx_len
                in_new = j >= 0
                t_ok = row_ok[:, None] & (in_new & n_ok)[None, :]
                bits = tl.load(tree_ptr + tok[:, None] * tree_s + j[None, :], mask=t_ok, other=0)
                visible = visible & ((j < 0)[None, :] | (bits != 0))
            s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
    else:
        # Every key visible and finite: the row maximum is finite, and the scale (> 0,
        # the launcher's condition for unmasked tiles) folds into one FMA per logit.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    m_i = m_new

    v_tok = _token_offsets(off, v_sth, v_stl, V_TS, BLOCK_SIZE)
    v_ptrs = v_ptr + (blk * v_sb + v_head + v_tok)[:, None] + v_dim[None, :]
    if HEAD_V == HEAD_V_PAD:
        if MASKED:
            v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
    else:
        dv_ok = tl.arange(0, HEAD_V_PAD) < HEAD_V
        if MASKED:
            v = tl.load(v_ptrs, mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs, mask=dv_ok[None, :], other=0.0)
    if DEQUANT == 2:
        if MASKED:
            v_tok_sc = tl.load(vs_ptr + blk * vs_sb + off * vs_st + kv_head * vs_sh,
                               mask=n_ok, other=0.0)
        else:
            v_tok_sc = tl.load(vs_ptr + blk * vs_sb + off * vs_st + kv_head * vs_sh)
        p = p * v_tok_sc[None, :]
    acc += _dot(p.to(q.dtype), v.to(q.dtype), FP32_DOT, INTERPRETER)
    return m_i, l_i, acc


@jit
def _attend_range(
    start_lo: tl.tensor, start_hi: tl.tensor, hi: tl.tensor,
    q: tl.tensor, m_i: tl.tensor, l_i: tl.tensor, acc: tl.tensor,
    q_pos: tl.tensor, row_ok: tl.tensor, tok: tl.tensor, ctx_len: tl.tensor, kv_head: tl.tensor,
    k_ptr: tl.tensor, k_sb: int, k_head: tl.tensor, k_sth: int, k_stl: int, k_dim: tl.tensor,
    v_ptr: tl.tensor, v_sb: int, v_head: tl.tensor, v_sth: int, v_stl: int, v_dim: tl.tensor,
    ks_ptr: tl.tensor, ks_sb: int, ks_st: int, ks_sh: int, k_sc: tl.tensor,
    vs_ptr: tl.tensor, vs_sb: int, vs_st: int, vs_sh: int,
    bt_row: tl.tensor, tree_ptr: tl.tensor, tree_s: int,
    qk_scale: float, softcap_log2: float, window: int,
    BLOCK_N: tl.constexpr, HEAD_K: tl.constexpr, HEAD_V: tl.constexpr,
    HEAD_K_PAD: tl.constexpr, HEAD_V_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    K_TS: tl.constexpr, V_TS: tl.constexpr,
    DEQUANT: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_TREE: tl.constexpr, FP32_DOT: tl.constexpr,
    INTERPRETER: tl.constexpr, MASKED: tl.constexpr,
) -> tl.tensor:
    """Tiles starting at ``start_lo, start_lo + BLOCK_N, ... < start_hi`` (keys clipped to
    ``hi``), each through :func:`_attend_tile`. Returns the updated ``(m_i, l_i, acc)``."""
    # Numpy 2 rejects range() over the interpreter's 1-element scalars, so the
    # interpreter runs the same tile body under a while loop; compiled code keeps
    # the for loop, which Triton software-pipelines.
    if INTERPRETER:
        start = start_lo
        while start < start_hi:
            m_i, l_i, acc = _attend_tile(
                start, hi, q, m_i, l_i, acc, q_pos, row_ok, tok, ctx_len, kv_head,
                k_ptr, k_sb, k_head, k_sth, k_stl, k_dim, v_ptr, v_sb, v_head, v_sth, v_stl, v_dim,
                ks_ptr, ks_sb, ks_st, ks_sh, k_sc, vs_ptr, vs_sb, vs_st, vs_sh,
                bt_row, tree_ptr, tree_s, qk_scale, softcap_log2, window,
                BLOCK_N, HEAD_K, HEAD_V, HEAD_K_PAD, HEAD_V_PAD, BLOCK_SIZE, K_TS, V_TS,
                DEQUANT, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_TREE, FP32_DOT, INTERPRETER,
                MASKED,
            )
            start += BLOCK_N
    else:
        for start in range(start_lo, start_hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                start, hi, q, m_i, l_i, acc, q_pos, row_ok, tok, ctx_len, kv_head,
                k_ptr, k_sb, k_head, k_sth, k_stl, k_dim, v_ptr, v_sb, v_head, v_sth, v_stl, v_dim,
                ks_ptr, ks_sb, ks_st, ks_sh, k_sc, vs_ptr, vs_sb, vs_st, vs_sh,
                bt_row, tree_ptr, tree_s, qk_scale, softcap_log2, window,
                BLOCK_N, HEAD_K, HEAD_V, HEAD_K_PAD, HEAD_V_PAD, BLOCK_SIZE, K_TS, V_TS,
                DEQUANT, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_TREE, FP32_DOT, INTERPRETER,
                MASKED,
            )
    return m_i, l_i, acc


@jit
def paged_attention_kernel(
    out_ptr: tl.tensor, out_s_t: int, out_s_h: int,
    q_ptr: tl.tensor, q_s_t: int, q_s_h: int,
    k_ptr: tl.tensor, k_sb: int, k_sh: int, k_sth: int, k_stl: int, k_sdh: int,
    v_ptr: tl.tensor, v_sb: int, v_sh: int, v_sth: int, v_stl: int, v_sdh: int,
    ks_ptr: tl.tensor, ks_sb: int, ks_st: int, ks_sh: int,
    vs_ptr: tl.tensor, vs_sb: int, vs_st: int, vs_sh: int,
    bt_ptr: tl.tensor, bt_s: int,
    qsl_ptr: tl.tensor, seq_lens_ptr: tl.tensor,
    tree_ptr: tl.tensor, tree_s: int,
    ws_m_ptr: tl.tensor, ws_l_ptr: tl.tensor, ws_s_t: int,
    qk_scale: float, softcap_log2: float, window: int, num_reqs: int,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_K: tl.constexpr, HEAD_V: tl.constexpr,
    HEAD_K_PAD: tl.constexpr, HEAD_V_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    K_TS: tl.constexpr, K_DS: tl.constexpr, K_SDL: tl.constexpr,
    V_TS: tl.constexpr, V_DS: tl.constexpr, V_SDL: tl.constexpr,
    DEQUANT: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_TREE: tl.constexpr, FP32_DOT: tl.constexpr,
    NUM_SPLITS: tl.constexpr, INTERPRETER: tl.constexpr,
    SPLIT_MASKS: tl.constexpr = False, REVERSE_TILES: tl.constexpr = False,
) -> None:
    """Grid ``(num_tokens // BLOCK_Q + num_reqs, num_kv_heads, NUM_SPLITS)``.

    ``DEQUANT``: 0 none, 1 fp8 with ``ks_ptr[kv_head * ks_sh]``, 2 per-(token, head)
    scales at ``ks_ptr[block*ks_sb + offset*ks_st + head*ks_sh]`` (same for V).
    ``qk_scale``: ``scale * log2(e)``, or ``2 * scale * log2(e) / cap`` with a soft cap;
    ``softcap_log2``: ``cap * log2(e)``. With ``NUM_SPLITS > 1``, ``out_ptr`` is the
    float32 partial accumulator ``[num_tokens, Hq, NUM_SPLITS, HEAD_V]`` and
    ``ws_m_ptr``/``ws_l_ptr`` the ``[num_tokens, Hq, NUM_SPLITS]`` max / sum (log2 units).
    ``SPLIT_MASKS`` (mask only the edge key tiles) and ``REVERSE_TILES`` (last query
    tiles first) are the prefill launches' options (``TritonLaunchConfig``).
    """
    pid = tl.program_id(0)
    if REVERSE_TILES:
        # A request's last query tiles see the most keys (causal): start them first so
        # the grid's last wave holds short tiles, not long ones.
        pid = tl.num_programs(0) - 1 - pid
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    req = _find_request(qsl_ptr, num_reqs, pid, BLOCK_Q)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    q_tile = pid - (q_start // BLOCK_Q + req)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + offs_m // GROUP           # query token within the request
    head = kv_head * GROUP + offs_m % GROUP               # query head
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = ctx_len + q_idx
    tok = (q_start + q_idx).to(tl.int64)

    offs_dk = tl.arange(0, HEAD_K_PAD)
    offs_dv = tl.arange(0, HEAD_V_PAD)
    dk_ok = offs_dk < HEAD_K
    dv_ok = offs_dv < HEAD_V

    q = tl.load(q_ptr + tok[:, None] * q_s_t + head[:, None] * q_s_h + offs_dk[None, :],
                mask=row_ok[:, None] & dk_ok[None, :], other=0.0)

    # Key range this tile of queries can see, then this program's share of it.
    first_q = ctx_len + q_tile * BLOCK_Q
    last_q = ctx_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q) - 1
    hi = seq_len
    if CAUSAL:
        hi = tl.minimum(seq_len, last_q + 1)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, first_q - window + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
    if NUM_SPLITS > 1:
        tiles = (hi - lo + BLOCK_N - 1) // BLOCK_N
        per_split = ((tiles + NUM_SPLITS - 1) // NUM_SPLITS) * BLOCK_N
        lo = lo + split * per_split
        hi = tl.minimum(hi, lo + per_split)

    k_dim = _dim_offsets(offs_dk, k_sdh, K_SDL, K_DS, HEAD_K)
    v_dim = _dim_offsets(offs_dv, v_sdh, V_SDL, V_DS, HEAD_V)
    k_head = kv_head.to(tl.int64) * k_sh
    v_head = kv_head.to(tl.int64) * v_sh
    bt_row = bt_ptr + req.to(tl.int64) * bt_s
    k_sc = 1.0
    v_sc = 1.0
    if DEQUANT == 1:
        k_sc = tl.load(ks_ptr + kv_head * ks_sh)
        v_sc = tl.load(vs_ptr + kv_head * vs_sh)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_V_PAD], tl.float32)

    if SPLIT_MASKS:
        # Keys every row of the tile sees: below the first query (causal), below the
        # draft tree (tree), inside the last query's window. Their tiles skip all masks;
        # only the tiles at the edges of the range build them.
        full_lo = lo
        full_hi = hi
        if CAUSAL:
            full_hi = tl.minimum(full_hi, first_q + 1)
        if HAS_TREE:
            full_hi = tl.minimum(full_hi, ctx_len)
        if HAS_WINDOW:
            full_lo = tl.maximum(full_lo, last_q - window + 1)
        in_lo = tl.minimum(lo + tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK_N) * BLOCK_N, hi)
        in_hi = tl.maximum(lo + (tl.maximum(full_hi - lo, 0) // BLOCK_N) * BLOCK_N, in_lo)
        m_i, l_i, acc = _attend_range(
            lo, in_lo, hi, q, m_i, l_i, acc, q_pos, row_ok, tok, ctx_len, kv_head,
            k_ptr, k_sb, k_head, k_sth, k_stl, k_dim, v_ptr, v_sb, v_head, v_sth, v_stl, v_dim,
            ks_ptr, ks_sb, ks_st, ks_sh, k_sc, vs_ptr, vs_sb, vs_st, vs_sh,
            bt_row, tree_ptr, tree_s, qk_scale, softcap_log2, window,
            BLOCK_N, HEAD_K, HEAD_V, HEAD_K_PAD, HEAD_V_PAD, BLOCK_SIZE, K_TS, V_TS,
            DEQUANT, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_TREE, FP32_DOT, INTERPRETER, True)
        m_i, l_i, acc = _attend_range(
            in_lo, in_hi, hi, q, m_i, l_i, acc, q_pos, row_ok, tok, ctx_len, kv_head,
            k_ptr, k_sb, k_head, k_sth, k_stl, k_dim, v_ptr, v_sb, v_head, v_sth, v_stl, v_dim,
            ks_ptr, ks_sb, ks_st, ks_sh, k_sc, vs_ptr, vs_sb, vs_st, vs_sh,
            bt_row, tree_ptr, tree_s, qk_scale, softcap_log2, window,
            BLOCK_N, HEAD_K, HEAD_V, HEAD_K_PAD, HEAD_V_PAD, BLOCK_SIZE, K_TS, V_TS,
            DEQUANT, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_TREE, FP32_DOT, INTERPRETER, False)
        m_i, l_i, acc = _attend_range(
            in_hi, hi, hi, q, m_i, l_i, acc, q_pos, row_ok, tok, ctx_len, kv_head,
            k_ptr, k_sb, k_head, k_sth, k_stl, k_dim, v_ptr, v_sb, v_head, v_sth, v_stl, v_dim,
            ks_ptr, ks_sb, ks_st, ks_sh, k_sc, vs_ptr, vs_sb, vs_st, vs_sh,
            bt_row, tree_ptr, tree_s, qk_scale, softcap_log2, window,
            BLOCK_N, HEAD_K, HEAD_V, HEAD_K_PAD, HEAD_V_PAD, BLOCK_SIZE, K_TS, V_TS,
            DEQUANT, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_TREE, FP32_DOT, INTERPRETER, True)
    else:
        m_i, l_i, acc = _attend_range(
            lo, hi, hi, q, m_i, l_i, acc, q_pos, row_ok, tok, ctx_len, kv_head,
            k_ptr, k_sb, k_head, k_sth, k_stl, k_dim, v_ptr, v_sb, v_head, v_sth, v_stl, v_dim,
            ks_ptr, ks_sb, ks_st, ks_sh, k_sc, vs_ptr, vs_sb, vs_st, vs_sh,
            bt_row, tree_ptr, tree_s, qk_scale, softcap_log2, window,
            BLOCK_N, HEAD_K, HEAD_V, HEAD_K_PAD, HEAD_V_PAD, BLOCK_SIZE, K_TS, V_TS,
            DEQUANT, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_TREE, FP32_DOT, INTERPRETER, True)

    if DEQUANT == 1:
        acc = acc * v_sc

    if NUM_SPLITS == 1:
        l_ref = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_ref[:, None]
        o_ptrs = out_ptr + tok[:, None] * out_s_t + head[:, None] * out_s_h + offs_dv[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    else:
        ml = tok * ws_s_t + head * NUM_SPLITS + split
        tl.store(ws_m_ptr + ml, m_i, mask=row_ok)
        tl.store(ws_l_ptr + ml, l_i, mask=row_ok)
        a_ptrs = (out_ptr + tok[:, None] * out_s_t + head[:, None] * out_s_h
                  + split * HEAD_V + offs_dv[None, :])
        tl.store(a_ptrs, acc, mask=row_ok[:, None] & dv_ok[None, :])


@jit
def reduce_splits_kernel(
    out_ptr: tl.tensor, out_s_t: int, out_s_h: int,
    acc_ptr: tl.tensor, m_ptr: tl.tensor, l_ptr: tl.tensor, num_heads: int,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD_V: tl.constexpr, HEAD_V_PAD: tl.constexpr,
) -> None:
    """Grid ``(num_tokens, num_heads)``: merge the split partials of one (token, head).

    ``acc_ptr``: float32 ``[num_tokens, num_heads, NUM_SPLITS, HEAD_V]``; ``m_ptr``,
    ``l_ptr``: float32 ``[num_tokens, num_heads, NUM_SPLITS]`` (log2-unit max, sum).
    """
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (tok * num_heads + head) * NUM_SPLITS
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_V_PAD)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_V
    m = tl.load(m_ptr + base + offs_s, mask=s_ok, other=float("-inf"))
    l = tl.load(l_ptr + base + offs_s, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_ref)
    total = tl.sum(l * w, 0)
    acc = tl.load(acc_ptr + (base + offs_s)[:, None] * HEAD_V + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + tok * out_s_t + head * out_s_h + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)
