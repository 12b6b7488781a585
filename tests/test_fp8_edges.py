"""fp8 edge values: the reference quantisation against bytes computed from the fp8
format definitions, not from torch's own cast.

The expected byte of a float comes from :class:`Fp8Format`, a few lines of exact
(``fractions.Fraction``) arithmetic over the codes the format defines: saturate to
``±max`` (infinities included), round to the nearest code with ties to the even
code, keep the sign of zero, NaN as the project's one NaN byte ``0x7F``
(``docs/architecture.md``). The encoder itself is pinned by a hand-written table.
Checked: ``to_fp8``, ``quantize_fp8`` (with scales: the float32 quotient is
computed here independently), the split writer's stored bytes (torch reference and,
where Triton is installed, the kernel: interpreted on CPU, compiled on CUDA), and
the E4M3 parts of the per-token-head and fp8_ds_mla formats.
"""

from __future__ import annotations

import bisect
import math
import struct
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property

import pytest
import torch

from vllm.attention import KVCacheLayout, KVQuant
from vllm.attention.writers import FP8DsMLACacheWriter, PerTokenHeadKVCacheWriter, SplitKVCacheWriter
from vllm.attention.writers.kernels import triton_importable
from vllm.attention.writers.quant import FP8_NAN_BYTE, quantize_fp8, to_fp8

NAN_BYTE = 0x7F


@dataclass(frozen=True)
class Fp8Format:
    """An 8-bit float from its definition: 1 sign bit, ``exp_bits``, ``man_bits``."""

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    ieee_specials: bool
    """E5M2: the all-ones exponent holds inf and NaN. E4M3FN: only ``S.1111.111`` is
    NaN and there is no infinity."""

    def value(self, code: int) -> Fraction | None:
        """The exact value of a code with sign bit 0; None for inf / NaN codes."""
        e = (code >> self.man_bits) & ((1 << self.exp_bits) - 1)
        m = code & ((1 << self.man_bits) - 1)
        top = (1 << self.exp_bits) - 1
        if self.ieee_specials and e == top:
            return None
        if not self.ieee_specials and e == top and m == (1 << self.man_bits) - 1:
            return None
        scale = 1 << self.man_bits
        if e == 0:  # subnormal: 0.m * 2^(1 - bias)
            return Fraction(m, scale) * Fraction(2) ** (1 - self.bias)
        return (1 + Fraction(m, scale)) * Fraction(2) ** (e - self.bias)

    @cached_property
    def finite(self) -> list[tuple[Fraction, int]]:
        """``(value, code)`` of every finite non-negative code, ascending."""
        out = []
        for code in range(0x80):
            v = self.value(code)
            if v is not None:
                out.append((v, code))
        return sorted(out)

    @property
    def max(self) -> Fraction:
        return self.finite[-1][0]

    def encode(self, x: float) -> int:
        """The stored byte of float ``x``: saturating, nearest, ties to even."""
        if math.isnan(x):
            return NAN_BYTE
        sign = 0x80 if math.copysign(1.0, x) < 0 else 0
        if math.isinf(x) or Fraction(abs(x)) >= self.max:
            return sign | self.finite[-1][1]
        a = Fraction(abs(x))
        i = bisect.bisect_left(self.finite, (a, -1))  # first code >= a
        below, above = self.finite[max(i - 1, 0)], self.finite[i]
        if above[0] - a != a - below[0]:
            best = above if above[0] - a < a - below[0] else below
        else:  # a tie: the even code
            best = below if below[1] % 2 == 0 else above
        return sign | best[1]


E4M3 = Fp8Format("e4m3fn", 4, 3, 7, ieee_specials=False)
E5M2 = Fp8Format("e5m2", 5, 2, 15, ieee_specials=True)
FORMATS = {"fp8_e4m3": (E4M3, torch.float8_e4m3fn), "fp8_e5m2": (E5M2, torch.float8_e5m2)}

HAND_TABLE: dict[str, list[tuple[float, int]]] = {
    # value -> byte, worked out by hand from the bit layouts
    "fp8_e4m3": [
        (1.0, 0x38), (-1.0, 0xB8), (240.0, 0x77), (256.0, 0x78), (448.0, 0x7E),
        (464.0, 0x7E), (500.0, 0x7E), (math.inf, 0x7E), (-math.inf, 0xFE), (-1e30, 0xFE),
        (math.nan, 0x7F), (-math.nan, 0x7F), (0.0, 0x00), (-0.0, 0x80),
        (2.0 ** -9, 0x01), (2.0 ** -10, 0x00), (-(2.0 ** -10), 0x80), (1.5 * 2.0 ** -9, 0x02),
        (7 * 2.0 ** -9, 0x07), (2.0 ** -6, 0x08), (1.0625, 0x38), (1.1875, 0x3A),
        (-3e-4, 0x80), (1e-40, 0x00), (2.0 ** -126, 0x00),
    ],
    "fp8_e5m2": [
        (1.0, 0x3C), (-1.0, 0xBC), (57344.0, 0x7B), (61440.0, 0x7B), (1e9, 0x7B),
        (math.inf, 0x7B), (-math.inf, 0xFB), (math.nan, 0x7F), (-math.nan, 0x7F),
        (0.0, 0x00), (-0.0, 0x80), (2.0 ** -16, 0x01), (2.0 ** -17, 0x00),
        (3 * 2.0 ** -17, 0x02), (2.0 ** -14, 0x04), (1.125, 0x3C), (1.375, 0x3E),
        (-(2.0 ** -18), 0x80),
    ],
}


def f32(x: float) -> float:
    """``x`` rounded to float32 (round to nearest even; past the range, ±inf)."""
    try:
        return float(struct.unpack("<f", struct.pack("<f", x))[0])
    except OverflowError:  # struct refuses exactly the values that round to ±inf
        return math.copysign(math.inf, x)


def f32_from_bits(bits: int) -> float:
    return float(struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0])


def edge_values(fmt: Fp8Format) -> list[float]:
    """Every code, every midpoint (ties), one float32 ulp either side of both, the
    saturation boundary, zeros, float32 subnormals, infinities and NaN payloads."""
    vals: list[float] = []
    finite = [float(v) for v, _ in fmt.finite]
    step_past_max = float(fmt.finite[-1][0] - fmt.finite[-2][0])
    points = finite + [finite[-1] + step_past_max]  # the code that would follow max
    for lo, hi in zip(points, points[1:]):
        vals += [lo, (lo + hi) / 2]
    for v in list(vals):
        vals += [math.nextafter(v, math.inf), math.nextafter(v, -math.inf)]
    vals += [1e-45, 1e-40, 2.0 ** -126, 3.4e38, math.inf, math.nan]
    vals = [f32(v) for v in vals]  # every value here is a float32
    vals += [-v for v in vals]
    for bits in (0x7FC00000, 0xFFC00000, 0x7FC00001, 0x7F800001, 0xFFFFFFFF, 0x80000000,
                 0x00000001, 0x80000001):
        vals.append(f32_from_bits(bits))
    return vals


def random_float32(n: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2**32, (n,), generator=g, dtype=torch.int64)
    return [f32_from_bits(int(b)) for b in bits]


def as_tensor(vals: list[float]) -> torch.Tensor:
    """float32 tensor holding exactly ``vals`` (NaN payloads and signs included)."""
    bits = [struct.unpack("<i", struct.pack("<f", v))[0] for v in vals]
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32)


def expected_bytes(fmt: Fp8Format, vals: list[float]) -> torch.Tensor:
    return torch.tensor([fmt.encode(v) for v in vals], dtype=torch.uint8)


def _diff(got: torch.Tensor, want: torch.Tensor, vals: list[float]) -> list[str]:
    bad = (got != want).nonzero().flatten()[:8].tolist()
    return [f"{vals[i]!r} ({struct.pack('<f', vals[i]).hex()}): got {int(got[i]):#04x}, "
            f"want {int(want[i]):#04x}" for i in bad]


# ---------------------------------------------------------------------- the encoder


@pytest.mark.parametrize("cache_dtype", list(FORMATS))
def test_encoder_matches_the_hand_table(cache_dtype: str) -> None:
    fmt, _ = FORMATS[cache_dtype]
    for value, byte in HAND_TABLE[cache_dtype]:
        assert fmt.encode(value) == byte, (value, hex(fmt.encode(value)), hex(byte))


def test_format_definitions() -> None:
    assert E4M3.max == 448 and len(E4M3.finite) == 127  # 0x7F is NaN, no inf
    assert E5M2.max == 57344 and len(E5M2.finite) == 124  # 0x7C inf, 0x7D-0x7F NaN
    assert E4M3.finite[1] == (Fraction(1, 512), 0x01) and E5M2.finite[1] == (Fraction(1, 65536), 0x01)
    assert FP8_NAN_BYTE == NAN_BYTE


# ---------------------------------------------------------------------- the reference


@pytest.mark.parametrize("cache_dtype", list(FORMATS))
def test_to_fp8_edges(cache_dtype: str) -> None:
    fmt, dtype = FORMATS[cache_dtype]
    vals = edge_values(fmt) + random_float32(4096, seed=1)
    got = to_fp8(as_tensor(vals), dtype).view(torch.uint8)
    want = expected_bytes(fmt, vals)
    assert torch.equal(got, want), _diff(got, want, vals)


@pytest.mark.parametrize("cache_dtype", list(FORMATS))
def test_overflow_saturates_nan_stays_nan_zero_keeps_its_sign(cache_dtype: str) -> None:
    fmt, dtype = FORMATS[cache_dtype]
    m = float(fmt.max)
    vals = [m, m * 1.01, m * 2, 1e38, math.inf, -m * 1.01, -math.inf, math.nan,
            f32_from_bits(0xFFC00000), 0.0, -0.0]
    got = to_fp8(as_tensor(vals), dtype).view(torch.uint8).tolist()
    top = fmt.finite[-1][1]
    assert got == [top] * 5 + [0x80 | top] * 2 + [NAN_BYTE] * 2 + [0x00, 0x80]
    back = torch.tensor(got, dtype=torch.uint8).view(dtype).float()
    assert bool(back[:7].isfinite().all()) and bool(back[7:9].isnan().all())
    assert math.copysign(1.0, float(back[10])) < 0


@pytest.mark.parametrize("cache_dtype", list(FORMATS))
def test_subnormals_round_to_nearest_even(cache_dtype: str) -> None:
    fmt, dtype = FORMATS[cache_dtype]
    unit = float(fmt.finite[1][0])  # the smallest subnormal
    # k/2 units for k = 0..2**(man_bits+1): exact codes and the ties between them
    halves = [unit * k / 2 for k in range(2 ** (fmt.man_bits + 1) + 1)]
    vals = halves + [-v for v in halves]
    got = to_fp8(as_tensor(vals), dtype).view(torch.uint8)
    want = expected_bytes(fmt, vals)
    assert torch.equal(got, want), _diff(got, want, vals)
    # ties went to the even code: half a unit is 0, one and a half units is 2 units
    assert got[1].item() == 0x00 and got[3].item() == 0x02


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("cache_dtype", list(FORMATS))
def test_quantize_fp8_with_per_head_scales(cache_dtype: str, in_dtype: torch.dtype) -> None:
    """``quantize_fp8`` = encode(float32(x) / scale), the quotient rounded once to float32."""
    fmt, dtype = FORMATS[cache_dtype]
    scales = [1.0, 0.5, 0.3, 1e-3, 7.0, 1e3]
    vals = edge_values(fmt) + random_float32(1024, seed=2)
    x = as_tensor(vals).to(in_dtype)
    xs = x.to(torch.float32).tolist()
    width = len(xs)
    rows = x.view(1, 1, width).expand(1, len(scales), width)
    got = quantize_fp8(rows, torch.tensor(scales, dtype=torch.float32), dtype).view(torch.uint8)
    for h, s in enumerate(scales):
        s32 = f32(s)
        quotients = [v if math.isnan(v) else f32(v / s32) for v in xs]
        want = expected_bytes(fmt, quotients)
        assert torch.equal(got[0, h], want), (s, _diff(got[0, h], want, quotients))


# ---------------------------------------------------------------------- the writers

PATHS = [
    "torch",
    pytest.param("triton", marks=[
        pytest.mark.skipif(not triton_importable(), reason="triton is not installed"),
        pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
        pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
        pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
    ]),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("cache_dtype", list(FORMATS))
def test_split_writer_stores_the_defined_bytes(cache_dtype: str, path: str) -> None:
    """Through ``SplitKVCacheWriter`` (CPU: the reference, or the kernel interpreted;
    CUDA: the compiled kernel), K with scale 1 and V with scale 2."""
    fmt, dtype = FORMATS[cache_dtype]
    device = "cuda" if path == "triton" and torch.cuda.is_available() else "cpu"
    vals = edge_values(fmt)
    d = 256
    vals += [1.0] * (-len(vals) % d)
    x = as_tensor(vals).view(-1, 1, d)
    rows = x.shape[0]
    cache = torch.zeros(rows, 2, 1, 1, d, dtype=dtype, device=device)
    quant = KVQuant(cache_dtype, torch.ones(1, device=device),  # type: ignore[arg-type]
                    torch.full((1,), 2.0, device=device))
    slots = torch.arange(rows, dtype=torch.int64, device=device)
    SplitKVCacheWriter(KVCacheLayout.SPLIT_NHD).write(x.to(device), x.to(device), cache, slots,
                                                      quant, path=path)  # type: ignore[arg-type]
    stored = cache.view(torch.uint8).cpu()
    k_got, v_got = stored[:, 0].flatten(), stored[:, 1].flatten()
    k_want = expected_bytes(fmt, vals)
    halved = [v if math.isnan(v) else f32(v / 2.0) for v in vals]
    v_want = expected_bytes(fmt, halved)
    assert torch.equal(k_got, k_want), _diff(k_got, k_want, vals)
    assert torch.equal(v_got, v_want), _diff(v_got, v_want, halved)


def test_per_token_head_fp8_values_are_the_defined_bytes() -> None:
    """fp8_per_token_head: scale = float32(amax / 448) computed here, each value
    encoded from float32(x / scale)."""
    vals = [v for v in edge_values(E4M3) if math.isfinite(v)][:480]
    d = 16
    rows = torch.tensor(vals, dtype=torch.float32).view(1, -1, d)
    h = rows.shape[1]
    cache = torch.zeros(1, 2, 1, h, d + 4, dtype=torch.uint8)
    quant = KVQuant("fp8_per_token_head", torch.ones(1), torch.ones(1))
    PerTokenHeadKVCacheWriter().write(rows, rows, cache, torch.zeros(1, dtype=torch.int64),
                                      quant, path="torch")
    for head in range(h):
        row = rows[0, head].tolist()
        scale = f32(max(abs(v) for v in row) / 448.0)
        div = scale if scale != 0.0 else 1.0
        want = [E4M3.encode(f32(v / div)) for v in row]
        got = cache[0, 0, 0, head, :d].tolist()
        assert got == want, (head, row, got, want)
        assert cache[0, 0, 0, head, d:].tolist() == list(struct.pack("<f", scale))


def test_fp8_ds_mla_latent_is_the_defined_bytes() -> None:
    """fp8_ds_mla: per 128-value tile, scale = max(float32(amax / 448), FLT_MIN);
    values encoded as E4M3 from float32(x / scale)."""
    pool = [v for v in edge_values(E4M3) if math.isfinite(v)]
    latent = torch.tensor((pool * 3)[:512], dtype=torch.float32).view(1, 512)
    latent[0, 384:] = torch.tensor(pool[:128]) * 1e-30  # a tile whose scale is FLT_MIN
    rope = torch.zeros(1, 64)
    cache = torch.zeros(1, 1, 656, dtype=torch.uint8)
    quant = KVQuant("fp8_ds_mla", torch.ones(1), torch.ones(1))
    FP8DsMLACacheWriter().write(latent, rope, cache, torch.zeros(1, dtype=torch.int64), quant,
                                path="torch")
    entry = cache[0, 0].tolist()
    for t in range(4):
        tile = latent[0, t * 128:(t + 1) * 128].tolist()
        scale = max(f32(max(abs(v) for v in tile) / 448.0), 2.0 ** -126)
        want = [E4M3.encode(f32(v / scale)) for v in tile]
        assert entry[t * 128:(t + 1) * 128] == want, t
        assert entry[512 + 4 * t: 516 + 4 * t] == list(struct.pack("<f", scale)), t
