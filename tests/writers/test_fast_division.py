"""The arithmetic of the fp8 writers' division by a scale (``_scale_kind`` and
``_fp8_quotient`` in ``vllm/attention/writers/kernels/triton_kernels.py``: the multiply by
the reciprocal for powers of two, the FAST_DIV Markstein quotient for other scales of
moderate size, the IEEE division for the rest), replayed on CPU in numpy with an exact
fused multiply-add, against the IEEE quotient ``x / s``: the fp8 bytes the writers store
(E4M3 and E5M2, through the reference's ``to_fp8``) are identical for every bf16 and
fp16 input and for fp32 inputs at and next to every fp8 rounding midpoint, over scales
that stress the reciprocal (powers of two, mantissas next to 1 and 2, subnormal, zero,
negative, infinite, NaN, and both edges of the moderate range, 2**-30 and 2**30).
Where the float32 results differ at all, the quotient is below 2**-40 or above 2**34
(fp8 stores zero, or saturates, for both: E5M2's smallest step is 2**-16, E4M3's
largest value 448); that is checked too. Negative zeros, infinities and NaN are among
the 16-bit inputs, so the clamp and the sign of a zero quotient are checked as well.

This tests the algorithm; ``tests/writers/test_writers_gpu.py`` checks the compiled
kernel's stored bytes on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.attention.writers.quant import to_fp8

F32 = np.float32
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``a*b + c`` of float32 arrays rounded once to float32: the product is exact in
    float64, the sum is made round-to-odd there (TwoSum finds the error), and rounding
    a round-to-odd float64 to float32 rounds the exact value correctly."""
    a64, b64, c64 = (np.asarray(v, dtype=np.float64) for v in (a, b, c))
    p = a64 * b64
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    even = (s.view(np.int64) & 1) == 0
    fix = (err != 0) & even & np.isfinite(s)
    s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def scale_kind(s: np.float32) -> int:
    """``_scale_kind``: 0 power of two, 1 positive and moderate (FAST_DIV), 2 the rest."""
    b = int(np.float32(s).view(np.uint32))
    e = (b >> 23) & 0xFF
    if (b & 0x7FFFFF) == 0 and 1 <= e <= 253:
        return 0
    return 1 if 97 <= e <= 156 and b < 0x80000000 else 2


def clamp_keep_sign(x: np.ndarray, lim: float) -> np.ndarray:
    """PTX ``min.NaN.xorsign.abs.f32 x, lim`` for ``lim > 0``: ``min(|x|, lim)`` with
    ``x``'s sign, NaN for NaN."""
    m = np.minimum(np.abs(x), F32(lim)).astype(np.float32)
    out = np.where(np.signbit(x), -m, m).astype(np.float32)
    return np.where(np.isnan(x), F32(np.nan), out).astype(np.float32)


def fast_div(x: np.ndarray, s: np.float32) -> np.ndarray:
    """The kernel's quotient for scale ``s``, operation for operation (float32, round to
    nearest even)."""
    kind = scale_kind(s)
    with np.errstate(all="ignore"):
        if kind == 2:
            return (x / s).astype(np.float32)
        r = F32(F32(1.0) / s)
        if kind == 0:
            return (x * r).astype(np.float32)
        c = clamp_keep_sign(x, 2.0**64)
        q = (c * r).astype(np.float32)
    e = fma32(q, np.full_like(q, s), -c)
    return fma32(-e, np.full_like(q, r), q)


def _scales() -> list[np.float32]:
    rng = np.random.default_rng(7)
    special = [1.0, 2.0**-20, 2.0**12, 3.0, 0.1, 1 / 3, 7.0, 448 / 3, -1.5, 0.0, 1e-39,
               2.0**-127, 1e38, 3e38, 2.0**-30, 2.0**30, np.inf, -np.inf, np.nan]
    near = [np.nextafter(F32(v), F32(0.0)) for v in (1.0, 2.0, 2.0**-30, 2.0**30)]
    near += [np.nextafter(F32(v), F32(np.inf)) for v in (1.0, 2.0**-30, 2.0**30)]
    near += [F32(1.5 * 2.0**-30), F32(-1.75 * 2.0**29), F32(1.25 * 2.0**-31)]
    spread = list(10.0 ** (rng.random(8) * 8 - 4)) + list(10.0 ** (rng.random(6) * 70 - 35))
    return [F32(v) for v in special + near + spread]


SCALES = _scales()


def _inputs(kind: str) -> np.ndarray:
    if kind == "bf16":
        return (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)
    if kind == "fp16":
        return np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    raise ValueError(kind)


def _bytes(y: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return to_fp8(torch.from_numpy(np.ascontiguousarray(y)), dtype).view(torch.uint8).numpy()


def _check(x: np.ndarray, s: np.float32) -> None:
    with np.errstate(all="ignore"):
        want = (x / s).astype(np.float32)
        got = fast_div(x, s)
    for dtype in FP8:
        differ = _bytes(want, dtype) != _bytes(got, dtype)
        assert not differ.any(), (
            f"scale {s!r}, {dtype}: {int(differ.sum())} byte(s) differ, e.g. x = "
            f"{x[differ][:3]}, IEEE {want[differ][:3]}, fast {got[differ][:3]}")
    bits_differ = (want.view(np.uint32) != got.view(np.uint32)) & ~(np.isnan(want) & np.isnan(got))
    seen = np.isfinite(want) & (np.abs(want) >= 2.0**-40) & (np.abs(want) <= 2.0**34)
    where = bits_differ & seen
    assert not where.any(), (f"scale {s!r}: float32 quotients differ in the range fp8 sees: "
                             f"x = {x[where][:3]}, IEEE {want[where][:3]}, fast {got[where][:3]}")


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_fast_division_stores_the_ieee_bytes_for_every_16_bit_input(kind: str) -> None:
    x = _inputs(kind)
    for s in SCALES:
        _check(x, s)


def test_fast_division_at_fp8_rounding_midpoints() -> None:
    """fp32 inputs whose quotient is exactly an fp8 midpoint, or one ulp either side:
    where a quotient off by one ulp would round to the other neighbour."""
    mids = []
    for dtype in FP8:
        vals = torch.arange(256, dtype=torch.uint8).view(dtype).float().numpy()
        vals = np.unique(vals[np.isfinite(vals)]).astype(np.float64)
        mids.append((vals[:-1] + vals[1:]) / 2)
    m = np.concatenate(mids)
    for s in SCALES:
        if not np.isfinite(s) or s == 0:
            continue
        with np.errstate(all="ignore"):
            base = (m * np.float64(s)).astype(np.float32)
            x = np.concatenate([base, np.nextafter(base, F32(np.inf)),
                                np.nextafter(base, F32(-np.inf)), -base])
        _check(x, s)


def test_exact_fma_emulation_against_fractions() -> None:
    """The emulated FMA itself, against exact rational arithmetic, on random and
    cancelling operands."""
    from fractions import Fraction

    rng = np.random.default_rng(11)
    a = rng.standard_normal(400).astype(np.float32) * F32(1e3)
    b = rng.standard_normal(400).astype(np.float32)
    c = np.concatenate([(-(a[:200].astype(np.float64) * b[:200])).astype(np.float32),
                        rng.standard_normal(200).astype(np.float32)])
    got = fma32(a, b, c)
    for i in range(a.size):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        # the float32 nearest to the exact value (ties to even), via float64 candidates
        lo = np.float32(float(exact))
        cands = {lo, np.nextafter(lo, F32(np.inf)), np.nextafter(lo, F32(-np.inf))}
        best = min(cands, key=lambda v: (abs(Fraction(float(v)) - exact),
                                         int(np.float32(v).view(np.uint32)) & 1))
        assert got[i] == best or (got[i] == 0 and best == 0), (a[i], b[i], c[i], got[i], best)
