"""Triton kernels of the KV-cache writers. Import through ``load_kernels`` only.

Bit-exactness with the torch reference (``vllm.attention.writers``) rests on:

* inputs arrive as their raw bits (int32 for fp32, int16 for fp16/bf16) and are
  widened to float32 exactly (bf16 by a 16-bit shift);
* division by an fp8 scale is the IEEE quotient or provably stores the same byte: a
  multiply by the exact reciprocal of a power of two, or (FAST_DIV) a Markstein
  quotient for scales of moderate size (``_scale_kind``, ``_fp8_quotient``);
* clamps keep NaN explicitly (``tl.minimum``/``tl.maximum`` may drop it);
* under the interpreter and on GPUs before sm_89, float32 -> fp8 and float32 -> bf16
  rounding is integer code (round to nearest even, NaN to one canonical byte pattern):
  Triton's interpreter does not round to nearest even. Compiled for sm_89+ (HW_CVT)
  the hardware conversions are used where they give the same bytes (``cvt.rn.satfinite``
  for fp8; ``cvt.rn.bf16x2.f32`` / ``cvt.rn.f16.f32`` for the fused RoPE's fp8 writes;
  the conversion's own NaN byte where claimed, HW_NAN); the exhaustive GPU byte tests in
  ``tests/writers/test_writers_gpu.py`` and ``tests/speed/test_gpu.py`` hold them to
  the reference.

The scales' reciprocals of compiled kernels (FAST_RCP) are ``div.rn``'s own fast
sequence without its range check, exact for every scale they serve (GPU-tested for
every such float32).

Offsets that multiply a slot or a token index are int64 (caches can exceed 2**31
elements). Layout diagrams: ``docs/layouts.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import triton
import triton.language as tl

jit: Callable[[Callable[..., Any]], Any] = triton.jit
"""``triton.jit`` with a type, so mypy accepts the decorated kernels (as ``Any``).
Parameters are annotated ``tl.tensor`` for mypy: the compiler resolves annotations
as globals (only ``tl`` names are allowed) and ignores this one."""


def jit_token_count(*names: str) -> Callable[[Callable[..., Any]], Any]:
    """``triton.jit`` that does not specialise on the token-count arguments ``names``:
    one compiled kernel serves every batch size (Triton would otherwise compile apart
    for 1, multiples of 16 and the rest)."""
    decorator: Callable[[Callable[..., Any]], Any] = triton.jit(do_not_specialize=list(names))
    return decorator


@jit
def _ld(ptrs: tl.tensor, mask: tl.tensor, HINT: tl.constexpr) -> tl.tensor:
    """``tl.load`` (``other=0``) with an L2 hint. HINT: 0 none, 1 ``evict_first`` (rows
    streamed once), 2 ``evict_last`` (a table every layer reads again)."""
    if HINT == 1:
        x = tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first")
    elif HINT == 2:
        x = tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_last")
    else:
        x = tl.load(ptrs, mask=mask, other=0)
    return x


@jit
def _st(ptrs: tl.tensor, value: tl.tensor, mask: tl.tensor, HINT: tl.constexpr) -> None:
    """``tl.store`` with an L2 hint. HINT: 0 none, 1 ``evict_first``."""
    if HINT == 1:
        tl.store(ptrs, value, mask=mask, eviction_policy="evict_first")
    else:
        tl.store(ptrs, value, mask=mask)


@jit
def _load_f32(ptrs: tl.tensor, mask: tl.tensor, IN_KIND: tl.constexpr,
              HINT: tl.constexpr = 0) -> tl.tensor:
    """Input bits to float32, exactly. IN_KIND: 0 fp32 (int32 bits), 1 fp16, 2 bf16 (int16
    bits). HINT: :func:`_ld`'s."""
    return _widen(_ld(ptrs, mask, HINT), IN_KIND)


@jit
def _split_offset(i: tl.tensor, SPLIT: tl.constexpr, s_hi: tl.tensor, s_lo: tl.tensor
                  ) -> tl.tensor:
    """Element offset of index ``i`` stored split as ``(i // SPLIT, i % SPLIT)`` with
    strides ``s_hi``, ``s_lo``: a slot's offset in its block or a dimension of the
    x-split layouts (SPLIT 1: ``i * s_hi``)."""
    return (i // SPLIT) * s_hi + (i % SPLIT) * s_lo


@jit
def _max(a: tl.tensor, b: tl.tensor) -> tl.tensor:
    # Our own combine function: tl.max is itself a @jit function, fixed to compiled or
    # interpreted when triton is first imported, which breaks the interpreted copy.
    return tl.maximum(a, b)


@jit
def _clamp_keep_nan(y: tl.tensor, lo: tl.constexpr, hi: tl.constexpr) -> tl.tensor:
    c = tl.minimum(tl.maximum(y, lo), hi)
    return tl.where(y != y, y, c)


@jit
def _fp8_bits(y: tl.tensor, MANT: tl.constexpr, BIAS: tl.constexpr) -> tl.tensor:
    """float32 (finite values already within the format's range, or NaN) to fp8 bits.

    Round to nearest even; NaN becomes 0x7F. E4M3: MANT=3, BIAS=7; E5M2: MANT=2, BIAS=15.
    """
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    e = (a >> 23).to(tl.int32)
    # Normal results: drop 23 - MANT mantissa bits with round-half-even, rebias.
    SHIFT: tl.constexpr = 23 - MANT
    half: tl.constexpr = (1 << (SHIFT - 1)) - 1
    normal = ((a + half + ((a >> SHIFT) & 1)) >> SHIFT) - ((127 - BIAS) << MANT)
    # Subnormal results: the integer count of the smallest subnormal, 2**(1 - BIAS - MANT).
    shift = tl.minimum(tl.maximum(151 - BIAS - MANT - e, 1), 31).to(tl.uint32)
    m = (a & 0x7FFFFF) | 0x800000
    sub = (m + ((1 << (shift - 1)) - 1) + ((m >> shift) & 1)) >> shift
    sub = tl.where(e == 0, 0, sub)
    q = tl.where(e >= 128 - BIAS, normal, sub) | sign
    q = tl.where(y != y, 0x7F, q)
    return q.to(tl.uint8)


@jit
def _bf16_bits(y: tl.tensor) -> tl.tensor:
    """float32 to bf16 bits (in a uint32): round to nearest even, NaN becomes 0x7FC0."""
    b = y.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return tl.where(y != y, 0x7FC0, r)


@jit
def _scatter_rows(
    slot: tl.tensor, valid: tl.tensor, t: tl.tensor, pid_h: tl.tensor,
    x_ptr: tl.tensor, x_st: tl.tensor, x_sh: tl.tensor, x_sd: tl.tensor,
    c_ptr: tl.tensor, c_sb: tl.tensor, c_so_hi: tl.tensor, c_so_lo: tl.tensor, c_sh: tl.tensor,
    c_sd_hi: tl.tensor, c_sd_lo: tl.tensor,
    s_ptr: tl.tensor, s_sh: tl.tensor,
    num_heads: tl.tensor, block_size: tl.tensor, head_size: tl.tensor,
    IN_KIND: tl.constexpr, MODE: tl.constexpr, XO: tl.constexpr, XD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
) -> None:
    """Rows ``[BLOCK_H, D]`` of one token into one operand (K or V) of the cache."""
    h = (pid_h * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    hm = h < num_heads
    mask = valid & hm[:, None] & (d < head_size)[None, :]
    src = x_ptr + t * x_st + h[:, None] * x_sh + d[None, :] * x_sd
    blk, off = _split_slot(slot, block_size, -1)
    base = blk * c_sb + _split_offset(off, XO, c_so_hi, c_so_lo)
    dim_off = _split_offset(d, XD, c_sd_hi, c_sd_lo)
    dst = c_ptr + base + h[:, None] * c_sh + dim_off[None, :]
    if MODE == 0:
        tl.store(dst, tl.load(src, mask=mask), mask=mask)
    else:
        x = _load_f32(src, mask, IN_KIND)
        s = tl.load(s_ptr + h * s_sh, mask=hm, other=1.0)
        y = tl.div_rn(x, s[:, None])
        if MODE == 1:
            q = _fp8_bits(_clamp_keep_nan(y, -448.0, 448.0), 3, 7)
        else:
            q = _fp8_bits(_clamp_keep_nan(y, -57344.0, 57344.0), 2, 15)
        tl.store(dst, q, mask=mask)


@jit
def scatter_kv_kernel(
    slot_ptr: tl.tensor, slot_st: tl.tensor,
    k_ptr: tl.tensor, k_st: tl.tensor, k_sh: tl.tensor, k_sd: tl.tensor,
    v_ptr: tl.tensor, v_st: tl.tensor, v_sh: tl.tensor, v_sd: tl.tensor,
    kc_ptr: tl.tensor, kc_sb: tl.tensor, kc_so_hi: tl.tensor, kc_so_lo: tl.tensor, kc_sh: tl.tensor,
    kc_sd_hi: tl.tensor, kc_sd_lo: tl.tensor,
    vc_ptr: tl.tensor, vc_sb: tl.tensor, vc_so_hi: tl.tensor, vc_so_lo: tl.tensor, vc_sh: tl.tensor,
    vc_sd_hi: tl.tensor, vc_sd_lo: tl.tensor,
    ks_ptr: tl.tensor, ks_sh: tl.tensor, vs_ptr: tl.tensor, vs_sh: tl.tensor,
    num_heads: tl.tensor, block_size: tl.tensor, num_slots: tl.tensor,
    head_size_k: tl.tensor, head_size_v: tl.tensor,
    IN_KIND: tl.constexpr, MODE: tl.constexpr,
    K_XO: tl.constexpr, K_XD: tl.constexpr, V_XO: tl.constexpr, V_XD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
) -> None:
    """One program per (token, group of BLOCK_H heads): K and V rows to their slot.

    Element ``(slot, h, d)`` of an operand lives at ``blk*sb + (off//XO)*so_hi +
    (off%XO)*so_lo + h*sh + (d//XD)*sd_hi + (d%XD)*sd_lo`` (``blk, off = divmod(slot,
    block_size)``), which covers every split layout, the legacy paged and AITER
    shuffled x-splits, DiffKV and the MLA latent. MODE: 0 copy bits (``auto``),
    1 fp8 E4M3, 2 fp8 E5M2 (scale stride 0 for a ``[1]`` scale, 1 for ``[H]``).
    """
    t = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    slot = tl.load(slot_ptr + t * slot_st)
    valid = (slot >= 0) & (slot < num_slots)
    _scatter_rows(slot, valid, t, pid_h, k_ptr, k_st, k_sh, k_sd,
                  kc_ptr, kc_sb, kc_so_hi, kc_so_lo, kc_sh, kc_sd_hi, kc_sd_lo,
                  ks_ptr, ks_sh, num_heads, block_size, head_size_k,
                  IN_KIND, MODE, K_XO, K_XD, BLOCK_H, BLOCK_DK)
    _scatter_rows(slot, valid, t, pid_h, v_ptr, v_st, v_sh, v_sd,
                  vc_ptr, vc_sb, vc_so_hi, vc_so_lo, vc_sh, vc_sd_hi, vc_sd_lo,
                  vs_ptr, vs_sh, num_heads, block_size, head_size_v,
                  IN_KIND, MODE, V_XO, V_XD, BLOCK_H, BLOCK_DV)


@jit
def _store_f32_bytes(ptrs0: tl.tensor, stride: tl.tensor, value: tl.tensor, mask: tl.tensor) -> None:
    """The 4 little-endian bytes of float32 ``value`` [N] at ``ptrs0`` [N] + j * stride."""
    j = tl.arange(0, 4)
    bits = value.to(tl.uint32, bitcast=True)
    b = ((bits[:, None] >> (j * 8).to(tl.uint32)[None, :]) & 0xFF).to(tl.uint8)
    tl.store(ptrs0[:, None] + j[None, :] * stride, b, mask=mask[:, None])


@jit
def _per_token_head_rows(
    slot: tl.tensor, valid: tl.tensor, t: tl.tensor, pid_h: tl.tensor,
    x_ptr: tl.tensor, x_st: tl.tensor, x_sh: tl.tensor, x_sd: tl.tensor,
    c_ptr: tl.tensor, c_sb: tl.tensor, c_so: tl.tensor, c_sh: tl.tensor, c_sj: tl.tensor,
    num_heads: tl.tensor, block_size: tl.tensor, head_size: tl.tensor,
    IN_KIND: tl.constexpr, INT8: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
) -> None:
    """Rows ``[BLOCK_H, D]`` as D quantised bytes then the row's float32 scale."""
    h = (pid_h * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    hm = h < num_heads
    mask = valid & hm[:, None] & (d < head_size)[None, :]
    x = _load_f32(x_ptr + t * x_st + h[:, None] * x_sh + d[None, :] * x_sd, mask, IN_KIND)
    isnan = x != x
    amax = tl.reduce(tl.where(isnan, 0.0, tl.abs(x)), 1, _max)
    has_nan = tl.reduce(isnan.to(tl.int32), 1, _max) > 0
    if INT8:
        scale = tl.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
    else:
        scale = tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    scale = tl.where(has_nan, float("nan"), scale)  # a NaN poisons its row
    divisor = tl.where(scale == 0.0, 1.0, scale)  # an all-zero row stores zeros
    y = tl.div_rn(x, divisor[:, None])
    if INT8:
        c = _clamp_keep_nan(y, -127.0, 127.0)
        c = tl.where(c != c, 0.0, c)  # NaN stores 0 (int8 has no NaN; the scale is NaN)
        f = tl.floor(c)
        frac = c - f
        fi = f.to(tl.int32)
        up = (frac > 0.5) | ((frac == 0.5) & ((fi & 1) == 1))
        q = tl.where(up, fi + 1, fi).to(tl.int8).to(tl.uint8, bitcast=True)
    else:
        q = _fp8_bits(_clamp_keep_nan(y, -448.0, 448.0), 3, 7)
    row = c_ptr + (slot // block_size) * c_sb + (slot % block_size) * c_so + h * c_sh
    tl.store(row[:, None] + d[None, :] * c_sj, q, mask=mask)
    _store_f32_bytes(row + head_size * c_sj, c_sj, scale, valid & hm)


@jit
def per_token_head_kernel(
    slot_ptr: tl.tensor, slot_st: tl.tensor,
    k_ptr: tl.tensor, k_st: tl.tensor, k_sh: tl.tensor, k_sd: tl.tensor,
    v_ptr: tl.tensor, v_st: tl.tensor, v_sh: tl.tensor, v_sd: tl.tensor,
    kc_ptr: tl.tensor, kc_sb: tl.tensor, kc_so: tl.tensor, kc_sh: tl.tensor, kc_sj: tl.tensor,
    vc_ptr: tl.tensor, vc_sb: tl.tensor, vc_so: tl.tensor, vc_sh: tl.tensor, vc_sj: tl.tensor,
    num_heads: tl.tensor, block_size: tl.tensor, num_slots: tl.tensor, head_size: tl.tensor,
    IN_KIND: tl.constexpr, INT8: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
) -> None:
    """One program per (token, group of heads); the cache operands are uint8
    ``[nb, bs, H, D + 4]`` views addressed in bytes."""
    t = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    slot = tl.load(slot_ptr + t * slot_st)
    valid = (slot >= 0) & (slot < num_slots)
    _per_token_head_rows(slot, valid, t, pid_h, k_ptr, k_st, k_sh, k_sd,
                         kc_ptr, kc_sb, kc_so, kc_sh, kc_sj, num_heads, block_size, head_size,
                         IN_KIND, INT8, BLOCK_H, BLOCK_D)
    _per_token_head_rows(slot, valid, t, pid_h, v_ptr, v_st, v_sh, v_sd,
                         vc_ptr, vc_sb, vc_so, vc_sh, vc_sj, num_heads, block_size, head_size,
                         IN_KIND, INT8, BLOCK_H, BLOCK_D)


@jit
def fp8_ds_mla_kernel(
    slot_ptr: tl.tensor, slot_st: tl.tensor,
    kv_ptr: tl.tensor, kv_st: tl.tensor, kv_sd: tl.tensor,
    pe_ptr: tl.tensor, pe_st: tl.tensor, pe_sd: tl.tensor,
    c_ptr: tl.tensor, c_sb: tl.tensor, c_so: tl.tensor, c_sj: tl.tensor,
    block_size: tl.tensor, num_slots: tl.tensor,
    IN_KIND: tl.constexpr,
) -> None:
    """One program per token: the 656-byte entry (512 E4M3, 4 float32 tile scales,
    64 16-bit rope values; fp32 rope is rounded to bf16)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t * slot_st)
    valid = (slot >= 0) & (slot < num_slots)
    tile = tl.arange(0, 4)
    j = tile[:, None] * 128 + tl.arange(0, 128)[None, :]  # [4, 128] latent index
    full = valid & (j >= 0)
    x = _load_f32(kv_ptr + t * kv_st + j * kv_sd, full, IN_KIND)
    isnan = x != x
    amax = tl.reduce(tl.where(isnan, 0.0, tl.abs(x)), 1, _max)
    has_nan = tl.reduce(isnan.to(tl.int32), 1, _max) > 0
    scale = tl.maximum(tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)),
                       1.1754943508222875e-38)  # FLT_MIN
    scale = tl.where(has_nan, float("nan"), scale)
    q = _fp8_bits(_clamp_keep_nan(tl.div_rn(x, scale[:, None]), -448.0, 448.0), 3, 7)
    entry = c_ptr + (slot // block_size) * c_sb + (slot % block_size) * c_so
    tl.store(entry + j * c_sj, q, mask=full)
    _store_f32_bytes(entry + (512 + tile * 4) * c_sj, c_sj, scale, valid & (tile >= 0))
    r = tl.arange(0, 64)
    pe = pe_ptr + t * pe_st + r * pe_sd
    rmask = valid & (r >= 0)
    if IN_KIND == 0:
        bits = _bf16_bits(_load_f32(pe, rmask, IN_KIND))
    else:
        bits = tl.load(pe, mask=rmask, other=0).to(tl.int32) & 0xFFFF
    k = tl.arange(0, 2)
    b = ((bits[:, None] >> (k * 8)[None, :]) & 0xFF).to(tl.uint8)
    tl.store(entry + (528 + r[:, None] * 2 + k[None, :]) * c_sj, b, mask=rmask[:, None])


# -- fused RoPE + write -----------------------------------------------------------------
# Rotation numerics are vllm.attention.rope's: products and sums rounded to float32
# one by one (launched with enable_fp_fusion=False, so no FMA contraction), then
# rounded to the input dtype with a canonical NaN, then stored or quantised exactly
# as the plain write stores that rounded row.


@jit
def _widen(bits: tl.tensor, IN_KIND: tl.constexpr, PACKED: tl.constexpr = False) -> tl.tensor:
    """Input-dtype bits (int32 / int16) to float32, exactly. PACKED (compiled kernels,
    bf16): :func:`_widen_bf16_pairs`."""
    if IN_KIND == 0:
        x = bits.to(tl.float32, bitcast=True)
    elif IN_KIND == 1:
        x = bits.to(tl.float16, bitcast=True).to(tl.float32)
    elif PACKED:
        x = _widen_bf16_pairs(bits)
    else:
        x = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x


@jit
def _widen_bf16_pairs(bits: tl.tensor) -> tl.tensor:
    """bf16 bits (int16) to float32, two elements per 32-bit register as they were
    loaded: a shift for the low half and a mask for the high one (the compiler's own
    widening extracts each half first). Compiled kernels only (inline PTX)."""
    return tl.inline_asm_elementwise(
        "{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }",
        "=r,=r,r", [bits], dtype=tl.float32, is_pure=True, pack=2)


@jit
def _to_input_bits(y: tl.tensor, IN_KIND: tl.constexpr) -> tl.tensor:
    """float32 to the input dtype's bits: nearest even, NaN as the canonical quiet NaN."""
    nan = y != y
    if IN_KIND == 0:
        b = tl.where(nan, 0x7FC00000, y.to(tl.int32, bitcast=True))
    elif IN_KIND == 1:
        h = y.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        b = tl.where(nan, 0x7E00, h).to(tl.int16)
    else:
        b = _bf16_bits(y).to(tl.int32).to(tl.int16)
    return b


@jit
def _scale_kind(s: tl.tensor) -> tl.tensor:
    """Elementwise int32 class of fp8 scales, which decides how a program divides by them
    (the largest class of its heads' scales):

    * 0: ``+-2**k``, k in [-126, 126], a normal float32 whose reciprocal is a normal
      float32, exactly. Then ``x * (1 / s)`` is the same real number as ``x / s`` and
      float32 multiplication rounds it as division does (overflow, underflow, signed
      zeros and NaN included): one multiply an element. Scale 1.0 (no calibration) is
      one.
    * 1: any other ``s`` with ``2**-30 <= s < 2**30`` (positive: :func:`_fp8_quotient`
      keeps a zero's sign only for ``s > 0``): :func:`_fp8_quotient` (FAST_DIV) when
      the launch allows it, else the IEEE division.
    * 2: the rest (zero, negative non-powers of two, subnormal, huge, infinite, NaN):
      the IEEE division."""
    b = s.to(tl.uint32, bitcast=True)
    e = (b >> 23) & 0xFF
    pow2 = ((b & 0x7FFFFF) == 0) & (e >= 1) & (e <= 253)
    moderate = (e >= 97) & (e <= 156) & (b < 0x80000000)
    return tl.where(pow2, 0, tl.where(moderate, 1, 2))


@jit
def _reciprocal(s: tl.tensor, FAST_RCP: tl.constexpr) -> tl.tensor:
    """``1 / s`` correctly rounded, for scales of :func:`_scale_kind` 0 and 1 (other
    scales are never multiplied by it). FAST_RCP (compiled kernels): the sequence the
    compiler emits for ``div.rn.f32`` when its range check passes -- the hardware
    approximation refined by two FMA steps -- without that check and its branch to the
    slow path: the check always passes for these scales (the numerator is 1 and ``s``
    is a normal float32 of exponent within [-126, 126]), and a branch before the table
    loads of the fused RoPE kernel made the program wait for the scale first. Otherwise
    ``div_rn`` (the GPU test compares both for every float32 scale of those kinds)."""
    if FAST_RCP:
        r = tl.inline_asm_elementwise(
            "{ .reg .f32 y, e, n; neg.f32 n, $1; rcp.approx.ftz.f32 y, $1; "
            "fma.rn.f32 e, n, y, 0f3F800000; fma.rn.f32 y, y, e, y; "
            "fma.rn.f32 e, n, y, 0f3F800000; fma.rn.f32 $0, y, e, y; }",
            "=r,r", [s], dtype=tl.float32, is_pure=True, pack=1)
    else:
        r = tl.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    return r


@jit
def _load_scales(s_ptr: tl.tensor, s_sh: tl.tensor, h: tl.tensor, hm: tl.tensor,
                 MODE: tl.constexpr, SCALAR_S: tl.constexpr,
                 BLOCK_H: tl.constexpr, FAST_RCP: tl.constexpr = False,
                 ) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Heads ``h``'s fp8 scales ``[BLOCK_H]`` (ones for MODE 0, not loaded), their
    reciprocals (:func:`_reciprocal`, computed once here for every store that follows)
    and the largest :func:`_scale_kind` among them (0 for MODE 0). SCALAR_S: one scale
    for every head (a ``[1]`` scale), loaded, inverted and classified once, no
    cross-warp reduction."""
    if MODE == 0:
        s = tl.full((BLOCK_H,), 1.0, tl.float32)
        r = s
        kind = 0
    elif SCALAR_S:
        s0 = tl.load(s_ptr)
        s = tl.broadcast_to(s0, (BLOCK_H,))
        kind = _scale_kind(s0)
    else:
        s = tl.load(s_ptr + h * s_sh, mask=hm, other=1.0)
        kind = tl.reduce(_scale_kind(s), 0, _max)
    if MODE != 0:
        r = _reciprocal(s, FAST_RCP)  # a splat's: one division
    return s, r, kind


@jit
def _fp8_quotient(x: tl.tensor, s: tl.tensor, r: tl.tensor) -> tl.tensor:
    """``x / s`` as the fp8 store that follows sees it, for scales ``s`` (broadcast
    against ``x``) of :func:`_scale_kind` 1 (compiled kernels only: it needs a true
    fused multiply-add and inline PTX). ``r``: the correctly rounded reciprocals
    ``1/s``. Per element:

    * ``x`` is clamped to ``|x| <= 2**64`` keeping its sign and NaN (one
      ``min.NaN.xorsign.abs``): beyond that ``x / s > 2**34`` and fp8 saturates for both,
      and below it ``q`` cannot overflow, so the correction is never ``inf - inf``
      (which made the old form select ``q`` where the correction was NaN);
    * ``q = x*r`` and one Markstein correction written with the residual's sign turned,
      ``q - (q*s - x)*r`` (two FMAs; the residual is exact). For ``x = +-0`` the
      residual is ``+0`` and its product with ``-r`` is ``-0``, which keeps ``q``'s
      sign: ``-0`` stays ``-0`` with no fix-up (``s > 0`` in class 1).

    Wherever the result can differ from the IEEE quotient its magnitude is below
    2**-40 or above 2**34, where both store the same fp8 byte
    (``tests/writers/test_fast_division.py`` checks the arithmetic on CPU, bit for bit,
    with an exact FMA; the GPU tests every stored byte)."""
    # inline PTX throughout: Triton's ``-x`` is ``0 - x``, an FADD of its own, where
    # ptxas folds a ``neg`` into the FMA's operand (4 instructions an element in all)
    return tl.inline_asm_elementwise(
        "{ .reg .f32 c, q, e; min.NaN.xorsign.abs.f32 c, $1, 0f5F800000; "
        "mul.rn.f32 q, c, $3; neg.f32 c, c; fma.rn.f32 e, q, $2, c; "
        "neg.f32 e, e; fma.rn.f32 $0, e, $3, q; }",
        "=r,r,r,r", [x, tl.broadcast_to(s, x.shape), tl.broadcast_to(r, x.shape)],
        dtype=tl.float32, is_pure=True, pack=1)


@jit
def _store_as(dst: tl.tensor, bits: tl.tensor, s: tl.tensor, r: tl.tensor, s_kind: tl.tensor,
              mask: tl.tensor, IN_KIND: tl.constexpr, MODE: tl.constexpr,
              HW_CVT: tl.constexpr, FAST_DIV: tl.constexpr, HW_NAN: tl.constexpr,
              IS_F32: tl.constexpr = False, PACKED: tl.constexpr = False,
              HINT: tl.constexpr = 0) -> None:
    """Store input-dtype ``bits`` as the cache stores them (MODE 0 copy, 1 E4M3, 2 E5M2)
    after dividing by the scales ``s`` (broadcast against ``bits``); ``r`` and ``s_kind``
    are :func:`_load_scales`'s reciprocals and class of them. FAST_DIV:
    :func:`_fp8_quotient` for class 1. HW_NAN: :func:`_fp8_store_bits`'s. IS_F32 (fp8
    modes only): ``bits`` already holds the input's values as float32
    (:func:`_rotate_pairs` with AS_F32). PACKED: :func:`_widen`'s. HINT: :func:`_st`'s."""
    if MODE == 0:
        _st(dst, bits, mask, HINT)
    else:
        x = bits if IS_F32 else _widen(bits, IN_KIND, PACKED)
        _store_fp8(dst, x, s, r, s_kind, mask, MODE, HW_CVT, FAST_DIV, HW_NAN, HINT)


@jit
def _store_fp8(dst: tl.tensor, x: tl.tensor, s: tl.tensor, r: tl.tensor, s_kind: tl.tensor,
               mask: tl.tensor, MODE: tl.constexpr, HW_CVT: tl.constexpr,
               FAST_DIV: tl.constexpr, HW_NAN: tl.constexpr, HINT: tl.constexpr = 0) -> None:
    """:func:`_store_as` of float32 values ``x`` (exactly the input's values) into an fp8
    cache (MODE 1 E4M3, 2 E5M2)."""
    # each branch stores (no value leaves the runtime if: a yielded tile at 8 warps
    # stored other bytes on the H200, Triton 3.6)
    if s_kind == 0:
        _st(dst, _fp8_store_bits(x * r, MODE, HW_CVT, False, HW_NAN), mask, HINT)
    elif FAST_DIV:
        if s_kind == 1:
            _st(dst, _fp8_store_bits(_fp8_quotient(x, s, r), MODE, HW_CVT, False, HW_NAN),
                mask, HINT)
        else:
            _st(dst, _fp8_store_bits(tl.div_rn(x, s), MODE, HW_CVT, True, HW_NAN), mask, HINT)
    else:
        _st(dst, _fp8_store_bits(tl.div_rn(x, s), MODE, HW_CVT, True, HW_NAN), mask, HINT)


@jit
def _round_to_bf16_pairs(x: tl.tensor) -> tl.tensor:
    """float32 ``x`` rounded to bfloat16 (to nearest even) and widened back, two elements
    per conversion (``cvt.rn.bf16x2.f32``, one packed instruction where the per-element
    ``cvt.rn.bf16.f32`` takes one each; the halves are widened by a shift and a mask).
    Compiled kernels only (inline PTX)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; cvt.rn.bf16x2.f32 t, $3, $2; shl.b32 $0, t, 16; "
        "and.b32 $1, t, 0xffff0000; }",
        "=r,=r,r,r", [x], dtype=tl.float32, is_pure=True, pack=2)


@jit
def _rotate_pairs(
    x1: tl.tensor, x2: tl.tensor, c: tl.tensor, s: tl.tensor, IN_KIND: tl.constexpr,
    AS_F32: tl.constexpr = False, PAIRS: tl.constexpr = False,
) -> tuple[tl.tensor, tl.tensor]:
    """Rotated input-dtype bits of the pairs ``(x1, x2)`` (input bits) by ``c``, ``s``
    (float32, broadcast against them). AS_F32 (compiled kernels writing fp8): the same
    values as float32 (the rotated row rounded to the input dtype by the hardware
    conversion, round to nearest even; a NaN may keep its payload, which no fp8 byte
    shows), for :func:`_store_as` with IS_F32; bf16 rows two at a time
    (:func:`_round_to_bf16_pairs`) with PAIRS (the launch's PACKED_WIDEN)."""
    y1 = _widen(x1, IN_KIND)
    y2 = _widen(x2, IN_KIND)
    o1 = y1 * c - y2 * s
    o2 = y2 * c + y1 * s
    if not AS_F32:
        r1 = _to_input_bits(o1, IN_KIND)
        r2 = _to_input_bits(o2, IN_KIND)
    elif IN_KIND == 1:
        r1 = o1.to(tl.float16).to(tl.float32)
        r2 = o2.to(tl.float16).to(tl.float32)
    elif IN_KIND == 2 and PAIRS:
        r1 = _round_to_bf16_pairs(o1)
        r2 = _round_to_bf16_pairs(o2)
    elif IN_KIND == 2:
        r1 = o1.to(tl.bfloat16).to(tl.float32)
        r2 = o2.to(tl.bfloat16).to(tl.float32)
    else:
        r1 = o1
        r2 = o2
    return r1, r2


@jit
def _rotate_at(
    x1: tl.tensor, x2: tl.tensor, pos_ptrs: tl.tensor, tm: tl.tensor, cs_ptr: tl.tensor,
    cs_sp: tl.tensor, cs_sd: tl.tensor, j: tl.tensor, half: tl.tensor, jm: tl.tensor,
    IN_KIND: tl.constexpr, CS_KIND: tl.constexpr, HINT: tl.constexpr,
    AS_F32: tl.constexpr = False, PAIRS: tl.constexpr = False,
) -> tuple[tl.tensor, tl.tensor]:
    """:func:`_rotate_pairs` of rows ``[BLOCK_T, H, BLOCK_R]`` by the cos/sin rows of
    the positions at ``pos_ptrs`` ``[BLOCK_T]`` (tokens in range ``tm``): the positions
    are loaded here, after the caller's row loads, so the rows do not wait for them.
    HINT: the table rows' :func:`_ld` hint; AS_F32, PAIRS: :func:`_rotate_pairs`'s."""
    pos = tl.load(pos_ptrs, mask=tm, other=0)
    # the table row is loaded in the rows' own layout (each thread the columns it
    # rotates; repeats hit L1): a [BLOCK_R] load broadcast to the rows would be
    # exchanged through shared memory, behind two barriers
    zero = tl.zeros(x1.shape, tl.int32)
    row = cs_ptr + pos[:, None, None] * cs_sp + zero
    m2 = jm[None, None, :] & (zero == 0)
    c = _load_f32(row + (j * cs_sd)[None, None, :], m2, CS_KIND, HINT)
    s = _load_f32(row + ((j + half) * cs_sd)[None, None, :], m2, CS_KIND, HINT)
    o1, o2 = _rotate_pairs(x1, x2, c, s, IN_KIND, AS_F32, PAIRS)
    return o1, o2


@jit
def _split_slot(slot: tl.tensor, block_size: tl.tensor, BS_SHIFT: tl.constexpr
                ) -> tuple[tl.tensor, tl.tensor]:
    """``divmod(slot, block_size)`` for slots >= 0 (others are masked by the caller);
    BS_SHIFT >= 0: ``block_size == 2**BS_SHIFT``, a shift and a mask instead of a 64-bit
    division."""
    if BS_SHIFT >= 0:
        blk = slot >> BS_SHIFT
        off = slot & ((1 << BS_SHIFT) - 1)
    else:
        blk = slot // block_size
        off = slot % block_size
    return blk, off


@jit_token_count("num_write", "num_rows")
def rope_kv_kernel(
    pos_ptr: tl.tensor, pos_st: tl.tensor,
    cs_ptr: tl.tensor, cs_sp: tl.tensor, cs_sd: tl.tensor, half: tl.tensor,
    q_ptr: tl.tensor, q_st: tl.tensor, q_sh: tl.tensor, q_sd: tl.tensor,
    num_q_heads: tl.tensor, q_groups: tl.tensor,
    k_ptr: tl.tensor, k_st: tl.tensor, k_sh: tl.tensor, k_sd: tl.tensor,
    num_kv_heads: tl.tensor, head_size_k: tl.tensor,
    slot_ptr: tl.tensor, slot_st: tl.tensor, num_write: tl.tensor, num_rows: tl.tensor,
    v_ptr: tl.tensor, v_st: tl.tensor, v_sh: tl.tensor, v_sd: tl.tensor, head_size_v: tl.tensor,
    kc_ptr: tl.tensor, kc_sb: tl.tensor, kc_so_hi: tl.tensor, kc_so_lo: tl.tensor, kc_sh: tl.tensor,
    kc_sd_hi: tl.tensor, kc_sd_lo: tl.tensor,
    vc_ptr: tl.tensor, vc_sb: tl.tensor, vc_so_hi: tl.tensor, vc_so_lo: tl.tensor, vc_sh: tl.tensor,
    vc_sd_hi: tl.tensor, vc_sd_lo: tl.tensor,
    ks_ptr: tl.tensor, ks_sh: tl.tensor, vs_ptr: tl.tensor, vs_sh: tl.tensor,
    block_size: tl.tensor, num_slots: tl.tensor,
    IN_KIND: tl.constexpr, CS_KIND: tl.constexpr, MODE: tl.constexpr, HW_CVT: tl.constexpr,
    NEOX: tl.constexpr, WRITE: tl.constexpr, PASS_K: tl.constexpr,
    K_XO: tl.constexpr, K_XD: tl.constexpr, V_XO: tl.constexpr, V_XD: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_PK: tl.constexpr, BLOCK_DV: tl.constexpr, CACHE_HINTS: tl.constexpr,
    SCALAR_S: tl.constexpr, FAST_DIV: tl.constexpr = False, HW_NAN: tl.constexpr = False,
    SAME_SCALE: tl.constexpr = False, BLOCK_T: tl.constexpr = 1, BS_SHIFT: tl.constexpr = -1,
    PACKED_WIDEN: tl.constexpr = False, FAST_RCP: tl.constexpr = False,
) -> None:
    """One program per (BLOCK_T tokens, head group); tokens from ``num_rows`` on do
    nothing. Groups below ``q_groups`` rotate ``q`` in place; the others rotate ``k``
    and -- with WRITE -- store it and ``v`` at the token's slot (tokens from
    ``num_write`` on and negative slots store nothing), without WRITE rotate ``k`` in
    place. Pairs: NEOX ``(j, j + half)``, else ``(2j, 2j + 1)``; key dimensions from
    ``2 * half`` on are stored unrotated (PASS_K). Cache addressing and MODE as
    :func:`scatter_kv_kernel`. CACHE_HINTS, bits: 1 the key/value rows are loaded
    ``evict_first``, 2 the cos/sin rows ``evict_last``, so that the table rows of this
    step's positions stay in L2 for the next layer's call while the rows stream
    through; 4 the cache rows are stored ``evict_first`` too. SCALAR_S, SAME_SCALE,
    PACKED_WIDEN (also the rotated keys' rounding, :func:`_rotate_pairs`' PAIRS),
    FAST_RCP: as :func:`scatter_kv_tiled_kernel`; BS_SHIFT:
    :func:`_split_slot`'s."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < num_rows
    g = tl.program_id(1)
    j = tl.arange(0, BLOCK_R)
    jm = j < half
    if NEOX:
        i1 = j
        i2 = j + half
    else:
        i1 = 2 * j
        i2 = 2 * j + 1
    ROW_HINT: tl.constexpr = CACHE_HINTS & 1
    TABLE_HINT: tl.constexpr = 2 if CACHE_HINTS & 2 else 0
    SH: tl.constexpr = 1 if CACHE_HINTS & 4 else 0
    # Issue order sets the latency of the small batches: the rows (and the slot) are
    # loaded first, none of them waits for another load, then the position and its
    # cos/sin row (_rotate_at; the row waits for the position): two memory round trips
    # before the stores, where a load masked by the slot would make it three.
    # (names differ between the branches: a runtime if merges same-named values)
    if g < q_groups:
        hq = (g * BLOCK_HQ + tl.arange(0, BLOCK_HQ)).to(tl.int64)
        mq = (tm[:, None] & (hq < num_q_heads)[None, :])[:, :, None] & jm[None, None, :]
        qrow = (q_ptr + t[:, None] * q_st + hq[None, :] * q_sh)[:, :, None]
        qx1 = tl.load(qrow + i1[None, None, :] * q_sd, mask=mq, other=0)
        qx2 = tl.load(qrow + i2[None, None, :] * q_sd, mask=mq, other=0)
        q1, q2 = _rotate_at(qx1, qx2, pos_ptr + t * pos_st, tm, cs_ptr, cs_sp, cs_sd, j, half,
                            jm, IN_KIND, CS_KIND, TABLE_HINT)
        tl.store(qrow + i1[None, None, :] * q_sd, q1, mask=mq)
        tl.store(qrow + i2[None, None, :] * q_sd, q2, mask=mq)
    else:
        h = ((g - q_groups) * BLOCK_HK + tl.arange(0, BLOCK_HK)).to(tl.int64)
        hm = h < num_kv_heads
        base = (k_ptr + t[:, None] * k_st + h[None, :] * k_sh)[:, :, None]
        if WRITE:
            live = tm & (t < num_write)
            slot = tl.load(slot_ptr + t * slot_st, mask=live, other=-1)
            # rows below num_write always exist: the loads do not wait for the slot
            lh = (live[:, None] & hm[None, :])[:, :, None]
            lm = lh & jm[None, None, :]
            kx1 = _ld(base + i1[None, None, :] * k_sd, lm, ROW_HINT)
            kx2 = _ld(base + i2[None, None, :] * k_sd, lm, ROW_HINT)
            if PASS_K:
                d = 2 * half + tl.arange(0, BLOCK_PK)
                pl = lh & (d < head_size_k)[None, None, :]
                pbits = _ld(base + d[None, None, :] * k_sd, pl, ROW_HINT)
            dv = tl.arange(0, BLOCK_DV)
            vl = lh & (dv < head_size_v)[None, None, :]
            vbits = _ld(v_ptr + t[:, None, None] * v_st + h[None, :, None] * v_sh
                        + dv[None, None, :] * v_sd, vl, ROW_HINT)
            skh, rkh, kkind = _load_scales(ks_ptr, ks_sh, h, hm, MODE, SCALAR_S, BLOCK_HK,
                                           FAST_RCP)
            if SAME_SCALE:
                svh, rvh, vkind = skh, rkh, kkind
            else:
                svh, rvh, vkind = _load_scales(vs_ptr, vs_sh, h, hm, MODE, SCALAR_S,
                                               BLOCK_HK, FAST_RCP)
            sk, rk = skh[None, :, None], rkh[None, :, None]
            sv, rv = svh[None, :, None], rvh[None, :, None]
            # compiled fp8 writes take the rotated keys as float32 (hardware rounding to the
            # input dtype instead of the integer code; no bits in between)
            ROT_F32: tl.constexpr = MODE != 0 and HW_CVT
            b1, b2 = _rotate_at(kx1, kx2, pos_ptr + t * pos_st, tm, cs_ptr, cs_sp, cs_sd, j,
                                half, jm, IN_KIND, CS_KIND, TABLE_HINT, ROT_F32, PACKED_WIDEN)
            # every load before the first store (see scatter_kv_tiled_kernel)
            ok = ((slot >= 0) & (slot < num_slots))[:, None, None]
            blk, off = _split_slot(slot, block_size, BS_SHIFT)
            k_row = blk * kc_sb + _split_offset(off, K_XO, kc_so_hi, kc_so_lo)
            kdst = kc_ptr + k_row[:, None, None] + h[None, :, None] * kc_sh
            k1 = kdst + _split_offset(i1, K_XD, kc_sd_hi, kc_sd_lo)[None, None, :]
            k2 = kdst + _split_offset(i2, K_XD, kc_sd_hi, kc_sd_lo)[None, None, :]
            _store_as(k1, b1, sk, rk, kkind, ok & lm, IN_KIND, MODE, HW_CVT, FAST_DIV, HW_NAN,
                      ROT_F32, PACKED_WIDEN, SH)
            _store_as(k2, b2, sk, rk, kkind, ok & lm, IN_KIND, MODE, HW_CVT, FAST_DIV, HW_NAN,
                      ROT_F32, PACKED_WIDEN, SH)
            if PASS_K:
                _store_as(kdst + _split_offset(d, K_XD, kc_sd_hi, kc_sd_lo)[None, None, :],
                          pbits, sk, rk, kkind, ok & pl, IN_KIND, MODE, HW_CVT, FAST_DIV,
                          HW_NAN, False, PACKED_WIDEN, SH)
            v_row = blk * vc_sb + _split_offset(off, V_XO, vc_so_hi, vc_so_lo)
            vdst = vc_ptr + v_row[:, None, None] + h[None, :, None] * vc_sh
            _store_as(vdst + _split_offset(dv, V_XD, vc_sd_hi, vc_sd_lo)[None, None, :],
                      vbits, sv, rv, vkind, ok & vl, IN_KIND, MODE, HW_CVT, FAST_DIV, HW_NAN,
                      False, PACKED_WIDEN, SH)
        else:
            m = (tm[:, None] & hm[None, :])[:, :, None] & jm[None, None, :]
            kx1 = tl.load(base + i1[None, None, :] * k_sd, mask=m, other=0)
            kx2 = tl.load(base + i2[None, None, :] * k_sd, mask=m, other=0)
            b1, b2 = _rotate_at(kx1, kx2, pos_ptr + t * pos_st, tm, cs_ptr, cs_sp, cs_sd, j,
                                half, jm, IN_KIND, CS_KIND, TABLE_HINT)
            tl.store(base + i1[None, None, :] * k_sd, b1, mask=m)
            tl.store(base + i2[None, None, :] * k_sd, b2, mask=m)


# -- the token-major scatter, tiled ---------------------------------------------------------
# For caches whose rows are token-major (every split layout, DiffKV, the MLA latent):
# BLOCK_T tokens per program, K/V loads that do not wait for the slot (rows below
# num_tokens always exist), and on sm_89+ (HW_CVT) the hardware fp8 conversion
# (cvt.rn.satfinite: round to nearest even, saturating, like the reference after its
# clamp) instead of the integer rounding code; the interpreter and older GPUs keep the
# integer code. Byte-identical to scatter_kv_kernel either way.


@jit
def _fp8_store_bits(y: tl.tensor, MODE: tl.constexpr, HW_CVT: tl.constexpr,
                    CLAMP: tl.constexpr = True, HW_NAN: tl.constexpr = False) -> tl.tensor:
    """float32 ``y`` (already divided by its scale) to the fp8 byte the reference stores
    (MODE 1 E4M3, 2 E5M2).

    The reference clamps to the format's largest finite value, then rounds. The hardware
    conversion (``cvt.rn.satfinite``) saturates by itself: every value beyond the largest
    finite one, infinities included, becomes it, so with ``CLAMP=False`` the clamp is left
    out on that path (two min/max and a NaN select an element fewer; the exhaustive GPU
    byte test runs that path). HW_NAN (with HW_CVT): the conversion itself stores every
    NaN as the reference's byte 0x7F (:func:`~vllm.attention.writers.kernels.hardware_fp8_nan`),
    so no select after it either: the converted pairs are stored as they come."""
    LIM: tl.constexpr = 448.0 if MODE == 1 else 57344.0
    if HW_CVT:
        c = _clamp_keep_nan(y, -LIM, LIM) if CLAMP else y
        if MODE == 1:
            b = c.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        else:
            b = c.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        q = b if HW_NAN else tl.where(y != y, 0x7F, b)
    elif MODE == 1:
        q = _fp8_bits(_clamp_keep_nan(y, -LIM, LIM), 3, 7)
    else:
        q = _fp8_bits(_clamp_keep_nan(y, -LIM, LIM), 2, 15)
    return q.to(tl.uint8)


@jit
def _tile_load(
    t: tl.tensor, tm: tl.tensor, h: tl.tensor, hm: tl.tensor,
    x_ptr: tl.tensor, x_st: tl.tensor, x_sh: tl.tensor, x_sd: tl.tensor,
    head_size: tl.tensor, BLOCK_D: tl.constexpr, HINT: tl.constexpr = 0,
) -> tl.tensor:
    """Input bits ``[BLOCK_T, BLOCK_H, D]`` of one operand (heads ``h``, in range ``hm``).
    HINT: :func:`_ld`'s."""
    d = tl.arange(0, BLOCK_D)
    load_mask = tm[:, None, None] & hm[None, :, None] & (d < head_size)[None, None, :]
    src = (x_ptr + t[:, None, None] * x_st + h[None, :, None] * x_sh
           + d[None, None, :] * x_sd)
    return _ld(src, load_mask, HINT)


@jit
def _tile_store(
    bits: tl.tensor, s: tl.tensor, r: tl.tensor, s_kind: tl.tensor, ok: tl.tensor,
    row: tl.tensor, h: tl.tensor, hm: tl.tensor,
    c_ptr: tl.tensor, c_sh: tl.tensor, c_sd: tl.tensor, head_size: tl.tensor,
    IN_KIND: tl.constexpr, MODE: tl.constexpr, HW_CVT: tl.constexpr, FAST_DIV: tl.constexpr,
    HW_NAN: tl.constexpr, BLOCK_D: tl.constexpr, PACKED: tl.constexpr,
    HINT: tl.constexpr = 0,
) -> None:
    """Store :func:`_tile_load`'s rows (heads ``h``, in range ``hm``); ``row`` ``[BLOCK_T]``
    is each token's element offset of ``(slot, head 0, dim 0)`` in the cache operand;
    ``s``, ``r``, ``s_kind`` from :func:`_load_scales`; PACKED: :func:`_widen`'s; HINT:
    :func:`_st`'s."""
    d = tl.arange(0, BLOCK_D)
    store_mask = ok[:, None, None] & hm[None, :, None] & (d < head_size)[None, None, :]
    dst = c_ptr + row[:, None, None] + h[None, :, None] * c_sh + d[None, None, :] * c_sd
    _store_as(dst, bits, s[None, :, None], r[None, :, None], s_kind, store_mask, IN_KIND,
              MODE, HW_CVT, FAST_DIV, HW_NAN, False, PACKED, HINT)


@jit_token_count("num_tokens")
def scatter_kv_tiled_kernel(
    slot_ptr: tl.tensor, slot_st: tl.tensor, num_tokens: tl.tensor,
    k_ptr: tl.tensor, k_st: tl.tensor, k_sh: tl.tensor, k_sd: tl.tensor,
    v_ptr: tl.tensor, v_st: tl.tensor, v_sh: tl.tensor, v_sd: tl.tensor,
    kc_ptr: tl.tensor, kc_sb: tl.tensor, kc_so: tl.tensor, kc_sh: tl.tensor, kc_sd: tl.tensor,
    vc_ptr: tl.tensor, vc_sb: tl.tensor, vc_so: tl.tensor, vc_sh: tl.tensor, vc_sd: tl.tensor,
    ks_ptr: tl.tensor, ks_sh: tl.tensor, vs_ptr: tl.tensor, vs_sh: tl.tensor,
    num_heads: tl.tensor, block_size: tl.tensor, num_slots: tl.tensor,
    head_size_k: tl.tensor, head_size_v: tl.tensor,
    IN_KIND: tl.constexpr, MODE: tl.constexpr, HW_CVT: tl.constexpr, FAST_DIV: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, SCALAR_S: tl.constexpr, HW_NAN: tl.constexpr = False,
    SLOT_LINEAR: tl.constexpr = False, SAME_SCALE: tl.constexpr = False,
    BS_SHIFT: tl.constexpr = -1, PACKED_WIDEN: tl.constexpr = False,
    FAST_RCP: tl.constexpr = False, CACHE_HINTS: tl.constexpr = 0,
) -> None:
    """One program per (BLOCK_T tokens, group of BLOCK_H heads) of a token-major cache
    (element ``(slot, h, d)`` at ``blk*sb + off*so + h*sh + d*sd``). MODE as
    :func:`scatter_kv_kernel`. SLOT_LINEAR: each block follows the last in both targets
    (``sb == block_size * so``), so ``blk*sb + off*so`` is ``slot*so``: no division.
    SAME_SCALE (with SCALAR_S): the caller passes one scale for K and V (the MLA latent
    and rope parts), loaded, inverted and classified once. BS_SHIFT: :func:`_split_slot`'s.
    PACKED_WIDEN (compiled fp8 writes of bf16 input, tiles of two or more elements a
    thread: ``kernels.pairs_fit``): :func:`_widen_bf16_pairs`. FAST_RCP (compiled
    fp8 writes): :func:`_reciprocal`'s. CACHE_HINTS, bits: 1 the K/V rows are loaded
    ``evict_first``, 4 the cache rows are stored ``evict_first`` (writes larger than L2
    stream through it once; launch variants of ``tune_writers.py``, off by default)."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    pid_h = tl.program_id(1)
    tm = t < num_tokens
    slot = tl.load(slot_ptr + t * slot_st, mask=tm, other=-1)
    ok = tm & (slot >= 0) & (slot < num_slots)
    # Every load before the first store: the stores may alias the inputs as far as the
    # compiler knows, so loads placed after a store would wait for it (one more memory
    # round trip on the latency-bound small writes).
    h = (pid_h * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    hm = h < num_heads
    ROW_HINT: tl.constexpr = CACHE_HINTS & 1
    SH: tl.constexpr = 1 if CACHE_HINTS & 4 else 0
    kb = _tile_load(t, tm, h, hm, k_ptr, k_st, k_sh, k_sd, head_size_k, BLOCK_DK, ROW_HINT)
    vb = _tile_load(t, tm, h, hm, v_ptr, v_st, v_sh, v_sd, head_size_v, BLOCK_DV, ROW_HINT)
    ks, kr, kkind = _load_scales(ks_ptr, ks_sh, h, hm, MODE, SCALAR_S, BLOCK_H, FAST_RCP)
    if SAME_SCALE:
        vs, vr, vkind = ks, kr, kkind
    else:
        vs, vr, vkind = _load_scales(vs_ptr, vs_sh, h, hm, MODE, SCALAR_S, BLOCK_H, FAST_RCP)
    if SLOT_LINEAR:
        k_row = slot * kc_so
        v_row = slot * vc_so
    else:
        blk, off = _split_slot(slot, block_size, BS_SHIFT)
        k_row = blk * kc_sb + off * kc_so
        v_row = blk * vc_sb + off * vc_so
    _tile_store(kb, ks, kr, kkind, ok, k_row, h, hm, kc_ptr, kc_sh, kc_sd, head_size_k,
                IN_KIND, MODE, HW_CVT, FAST_DIV, HW_NAN, BLOCK_DK, PACKED_WIDEN, SH)
    _tile_store(vb, vs, vr, vkind, ok, v_row, h, hm, vc_ptr, vc_sh, vc_sd, head_size_v,
                IN_KIND, MODE, HW_CVT, FAST_DIV, HW_NAN, BLOCK_DV, PACKED_WIDEN, SH)
