"""The writers' test oracle, written from the layout descriptions and nothing else.

Each cache is built here with ``as_strided`` over a flat storage of random bytes,
from explicit element-offset formulas; the decoders read the storage back with
the same formulas (plain index arithmetic, none of the library's views), and the
expected values come from quantisation written out here. A run writes random
K/V at random slots (some -1, extra rows past ``slot_mapping``), then checks
every written row and every byte outside the written slots.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm.attention import KVCacheLayout, KVQuant
from vllm.attention.writers import (
    LegacyPagedKVCacheWriter,
    mla_writer_for_layout,
    writer_for_layout,
)

L = KVCacheLayout
SPLIT = (L.SPLIT_NHD, L.SPLIT_HND, L.SPLIT_KV_FIRST, L.SPLIT_BLOCK_INTERLEAVED)
KV_LAYOUTS = (*SPLIT, L.LEGACY_PAGED, L.AITER_SHUFFLED, L.DIFFKV_PACKED)
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
       "fp8_e5m2": torch.float8_e5m2}
SCALED_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
PTQ_DTYPES = ("int8_per_token_head", "fp8_per_token_head")
IN_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}

NUM_BLOCKS, HEADS, HEAD_SIZE, HEAD_SIZE_V_DIFF = 3, 2, 32, 16
MLA_L, MLA_R = 64, 16
NUM_TOKENS, EXTRA_ROWS = 13, 3
HYBRID_PAD = 24
"""Extra elements per block in the hybrid variant: the cache is a view of a larger buffer."""

Index = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(block, offset, head, dim)`` broadcastable int64 tensors to element offsets."""


@dataclass(frozen=True)
class Case:
    layout: KVCacheLayout
    in_dtype: str
    cache_dtype: str
    block_size: int
    scale: str = "scale_tensor"
    hybrid: bool = False

    @property
    def id(self) -> str:
        tail = "-hybrid" if self.hybrid else ""
        return (f"{self.layout.value}-{self.in_dtype}-{self.cache_dtype}-bs{self.block_size}"
                f"-{self.scale}{tail}")

    @property
    def mla(self) -> bool:
        return self.layout in (L.MLA_LATENT, L.MLA_FP8_DS)


def all_cases() -> list[Case]:
    """The full grid: layout x input dtype x cache dtype x block size x scale shape."""
    cases: list[Case] = []
    for dt in IN_DTYPES:
        for bs in (16, 32):
            for layout in KV_LAYOUTS:
                for cd in SCALED_DTYPES:
                    for sc in ("scale_tensor", "scale_per_head"):
                        cases.append(Case(layout, dt, cd, bs, sc))
            for cd in PTQ_DTYPES:
                cases.append(Case(L.PER_TOKEN_HEAD_QUANT, dt, cd, bs, "scale_none"))
            for cd in SCALED_DTYPES:
                cases.append(Case(L.MLA_LATENT, dt, cd, bs))
            cases.append(Case(L.MLA_FP8_DS, dt, "fp8_ds_mla", bs * 2, "scale_none"))
    for layout in (*KV_LAYOUTS, L.PER_TOKEN_HEAD_QUANT, L.MLA_LATENT, L.MLA_FP8_DS):
        cd = {L.PER_TOKEN_HEAD_QUANT: "fp8_per_token_head", L.MLA_FP8_DS: "fp8_ds_mla"}.get(
            layout, "fp8_e4m3")
        sc = "scale_per_head" if layout in KV_LAYOUTS else "scale_none"
        cases.append(Case(layout, "bf16", cd, 16, sc, hybrid=True))
    return cases


# ---------------------------------------------------------------- physical layouts


@dataclass(frozen=True)
class Physical:
    """A cache as the test builds it: logical shape/strides over a flat storage and
    the element offset of every (block, offset, head, dim) of K and of V."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    numel: int
    k_index: Index
    v_index: Index
    heads: int
    k_width: int
    v_width: int


def physical(case: Case) -> Physical:
    nb, bs, h = NUM_BLOCKS, case.block_size, HEADS
    d = HEAD_SIZE
    pad = HYBRID_PAD if case.hybrid else 0
    elem = storage_dtype(case).itemsize
    x = 16 // elem
    lay = case.layout
    if lay is L.SPLIT_NHD:
        bsz = 2 * bs * h * d + pad
        return Physical((nb, 2, bs, h, d), (bsz, bs * h * d, h * d, d, 1), nb * bsz,
                        lambda b, o, hh, j: b * bsz + o * h * d + hh * d + j,
                        lambda b, o, hh, j: b * bsz + bs * h * d + o * h * d + hh * d + j,
                        h, d, d)
    if lay is L.SPLIT_HND:
        bsz = 2 * h * bs * d + pad
        return Physical((nb, 2, bs, h, d), (bsz, h * bs * d, d, bs * d, 1), nb * bsz,
                        lambda b, o, hh, j: b * bsz + hh * bs * d + o * d + j,
                        lambda b, o, hh, j: b * bsz + h * bs * d + hh * bs * d + o * d + j,
                        h, d, d)
    if lay is L.SPLIT_KV_FIRST:
        bsz = bs * h * d + pad
        return Physical((2, nb, bs, h, d), (nb * bsz, bsz, h * d, d, 1), 2 * nb * bsz,
                        lambda b, o, hh, j: b * bsz + o * h * d + hh * d + j,
                        lambda b, o, hh, j: nb * bsz + b * bsz + o * h * d + hh * d + j,
                        h, d, d)
    if lay is L.SPLIT_BLOCK_INTERLEAVED:
        bsz = bs * 2 * h * d + pad
        return Physical((nb, 2, bs, h, d), (bsz, h * d, 2 * h * d, d, 1), nb * bsz,
                        lambda b, o, hh, j: b * bsz + o * 2 * h * d + hh * d + j,
                        lambda b, o, hh, j: b * bsz + o * 2 * h * d + h * d + hh * d + j,
                        h, d, d)
    if lay is L.LEGACY_PAGED:
        # K [nb, H, D/x, bs, x], V [nb, H, D, bs], each block's row contiguous
        bsz = bs * h * d + pad
        return Physical((2, nb, bs * h * d), (nb * bsz, bsz, 1), 2 * nb * bsz,
                        lambda b, o, hh, j: (b * bsz + hh * d * bs + (j // x) * bs * x
                                             + o * x + j % x),
                        lambda b, o, hh, j: nb * bsz + b * bsz + hh * d * bs + j * bs + o,
                        h, d, d)
    if lay is L.AITER_SHUFFLED:
        # K [nb, H, D/x, bs, x], V [nb, H, bs/x, D, x]
        bsz = bs * h * d + pad
        return Physical((2, nb, bs, h, d), (nb * bsz, bsz, h * d, d, 1), 2 * nb * bsz,
                        lambda b, o, hh, j: (b * bsz + hh * d * bs + (j // x) * bs * x
                                             + o * x + j % x),
                        lambda b, o, hh, j: (nb * bsz + b * bsz + hh * bs * d
                                             + (o // x) * d * x + j * x + o % x),
                        h, d, d)
    if lay is L.DIFFKV_PACKED:
        dv = HEAD_SIZE_V_DIFF
        w = d + dv
        bsz = bs * h * w + pad
        return Physical((nb, bs, h, w), (bsz, h * w, w, 1), nb * bsz,
                        lambda b, o, hh, j: b * bsz + o * h * w + hh * w + j,
                        lambda b, o, hh, j: b * bsz + o * h * w + hh * w + d + j,
                        h, d, dv)
    if lay is L.PER_TOKEN_HEAD_QUANT:
        w = d + 4  # bytes: D values then a little-endian float32 scale
        bsz = 2 * bs * h * w + pad
        return Physical((nb, 2, bs, h, w), (bsz, bs * h * w, h * w, w, 1), nb * bsz,
                        lambda b, o, hh, j: b * bsz + o * h * w + hh * w + j,
                        lambda b, o, hh, j: b * bsz + bs * h * w + o * h * w + hh * w + j,
                        h, w, w)
    if lay is L.MLA_LATENT:
        w = MLA_L + MLA_R
        bsz = bs * w + pad
        return Physical((nb, bs, w), (bsz, w, 1), nb * bsz,
                        lambda b, o, hh, j: b * bsz + o * w + j,
                        lambda b, o, hh, j: b * bsz + o * w + MLA_L + j,
                        1, MLA_L, MLA_R)
    if lay is L.MLA_FP8_DS:
        bsz = bs * 656 + pad
        return Physical((nb, bs, 656), (bsz, 656, 1), nb * bsz,
                        lambda b, o, hh, j: b * bsz + o * 656 + j,
                        lambda b, o, hh, j: b * bsz + o * 656 + j,  # unused
                        1, 656, 0)
    raise AssertionError(lay)


def storage_dtype(case: Case) -> torch.dtype:
    if case.cache_dtype == "auto":
        return IN_DTYPES[case.in_dtype]
    if case.cache_dtype in FP8:
        return FP8[case.cache_dtype]
    return torch.uint8


def gather(flat: torch.Tensor, index: Index, blocks: torch.Tensor, offsets: torch.Tensor,
           heads: int, width: int) -> torch.Tensor:
    """Decoder: elements ``[n, heads, width]`` of the flat storage, by formula."""
    b = blocks.view(-1, 1, 1)
    o = offsets.view(-1, 1, 1)
    hh = torch.arange(heads, device=flat.device).view(1, -1, 1)
    j = torch.arange(width, device=flat.device).view(1, 1, -1)
    return flat[index(b, o, hh, j)]


# ---------------------------------------------------------------- expected values


def fp8_bits(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating RNE conversion of float32 ``y``; every NaN is the byte 0x7F."""
    m = torch.finfo(dtype).max
    q = torch.clamp(y, -m, m).to(dtype).view(torch.uint8).clone()
    q[torch.isnan(y)] = 0x7F
    return q


def f32_bytes(x: torch.Tensor) -> torch.Tensor:
    """Little-endian bytes ``[..., 4]`` of float32 ``x``; NaN as 0x7FC00000."""
    x = x.clone()
    x[torch.isnan(x)] = math.nan
    return x.contiguous().view(torch.uint8).view(*x.shape, 4)


def expected_scaled(x: torch.Tensor, cache_dtype: str, scale: torch.Tensor) -> torch.Tensor:
    """``[n, H, D]`` rows as stored, in the storage's integer bits."""
    if cache_dtype == "auto":
        return x.view(BITS[x.element_size()])
    y = x.to(torch.float32) / scale.view(1, -1, 1)
    return fp8_bits(y, FP8[cache_dtype])


def expected_per_token_head(x: torch.Tensor, cache_dtype: str) -> torch.Tensor:
    """``[n, H, D]`` rows as their ``[n, H, D + 4]`` bytes (see docs/layouts.md)."""
    n, h, d = x.shape
    out = torch.empty(n, h, d + 4, dtype=torch.uint8)
    xf = x.to(torch.float32).cpu()
    qmax = 127.0 if cache_dtype == "int8_per_token_head" else 448.0
    for i in range(n):
        for k in range(h):
            row = xf[i, k]
            amax = math.nan if bool(row.isnan().any()) else float(row.abs().max())
            scale = torch.tensor(amax, dtype=torch.float32) / torch.tensor(qmax)
            div = scale if float(scale) != 0.0 else torch.tensor(1.0)
            y = row / div
            if cache_dtype == "int8_per_token_head":
                q = torch.round(torch.clamp(y, -127.0, 127.0))
                q[torch.isnan(y)] = 0
                out[i, k, :d] = q.to(torch.int8).view(torch.uint8)
            else:
                out[i, k, :d] = fp8_bits(y, torch.float8_e4m3fn)
            out[i, k, d:] = f32_bytes(scale.reshape(1))[0]
    return out.to(x.device)


def expected_ds_mla(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """``[n, 512]`` + ``[n, 64]`` as their ``[n, 656]`` entries (see docs/layouts.md)."""
    n = kv_c.shape[0]
    out = torch.empty(n, 656, dtype=torch.uint8)
    xf = kv_c.to(torch.float32).cpu()
    for i in range(n):
        for t in range(4):
            tile = xf[i, t * 128:(t + 1) * 128]
            amax = math.nan if bool(tile.isnan().any()) else float(tile.abs().max())
            scale = torch.tensor(amax, dtype=torch.float32) / torch.tensor(448.0)
            scale = torch.maximum(scale, torch.tensor(2.0 ** -126))
            out[i, t * 128:(t + 1) * 128] = fp8_bits(tile / scale, torch.float8_e4m3fn)
            out[i, 512 + 4 * t: 516 + 4 * t] = f32_bytes(scale.reshape(1))[0]
        pe = k_pe[i].cpu()
        if pe.dtype == torch.float32:
            bits = pe.to(torch.bfloat16).view(torch.int16).clone()
            bits[torch.isnan(pe)] = 0x7FC0
        else:
            bits = pe.view(torch.int16)
        out[i, 528:] = bits.contiguous().view(torch.uint8)
    return out.to(kv_c.device)


def edge_values() -> torch.Tensor:
    """float32 values on and around every E4M3/E5M2 rounding boundary, subnormals of
    both formats and of float32, zeros, the saturation limits, inf, NaN, random bits."""
    vals = []
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dt).to(torch.float32)
        fin = codes[torch.isfinite(codes)].unique().sort().values
        mids = (fin[1:] + fin[:-1]) / 2
        for v in (fin, mids):
            vals += [v, torch.nextafter(v, torch.full_like(v, math.inf)),
                     torch.nextafter(v, torch.full_like(v, -math.inf))]
    vals.append(torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, 2.0 ** -126, 448.0, 464.0,
                              480.0, 57344.0, 61440.0, 65536.0, 1e30, -1e30,
                              math.inf, -math.inf, math.nan, -math.nan]))
    gen = torch.Generator().manual_seed(7)
    bits = torch.randint(-2**31, 2**31 - 1, (4096,), generator=gen, dtype=torch.int64)
    vals.append(bits.to(torch.int32).view(torch.float32))
    return torch.cat(vals)


# ---------------------------------------------------------------- one run


def random_rows(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator,
                device: str) -> torch.Tensor:
    """Never zero; some values past the fp8 ranges (saturation)."""
    x = torch.randn(shape, generator=gen) * 4
    x[x.abs() < 0.05] = 0.5
    big = torch.rand(shape, generator=gen) < 0.02
    x[big] *= 200
    huge = torch.rand(shape, generator=gen) < 0.005
    x[huge] = torch.sign(x[huge]) * 60000.0
    return x.to(dtype).to(device)


@dataclass
class Written:
    """One write and what the oracle expects of it."""

    case: Case
    storage: torch.Tensor
    before: torch.Tensor
    cache: torch.Tensor
    phys: Physical
    key: torch.Tensor
    value: torch.Tensor
    slots: torch.Tensor
    quant: KVQuant


def prepare(case: Case, device: str = "cpu", seed: int = 0,
            num_tokens: int = NUM_TOKENS) -> Written:
    gen = torch.Generator().manual_seed(seed)
    phys = physical(case)
    sdt = storage_dtype(case)
    raw = torch.randint(0, 256, (phys.numel * sdt.itemsize,), generator=gen, dtype=torch.uint8)
    storage = raw.view(sdt).to(device)
    cache = storage.as_strided(phys.shape, phys.strides)
    num_slots = NUM_BLOCKS * case.block_size
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:max(1, num_tokens // 4)]] = -1
    dt = IN_DTYPES[case.in_dtype]
    rows = num_tokens + EXTRA_ROWS
    if case.layout is L.MLA_LATENT:
        key = random_rows((rows, MLA_L), dt, gen, device)
        value = random_rows((rows, 1, MLA_R), dt, gen, device)
    elif case.layout is L.MLA_FP8_DS:
        key = random_rows((rows, 512), dt, gen, device)
        value = random_rows((rows, 64), dt, gen, device)
    else:
        dv = HEAD_SIZE_V_DIFF if case.layout is L.DIFFKV_PACKED else HEAD_SIZE
        key = random_rows((rows, HEADS, HEAD_SIZE), dt, gen, device)
        value = random_rows((rows, HEADS, dv), dt, gen, device)
    nscale = HEADS if case.scale == "scale_per_head" else 1
    k_scale = (torch.rand(nscale, generator=gen) * 0.75 + 0.25).to(device)
    v_scale = (torch.rand(nscale, generator=gen) * 0.75 + 0.25).to(device)
    quant = KVQuant(case.cache_dtype, k_scale, v_scale)
    return Written(case, storage, storage.clone(), cache, phys, key, value,
                   slots.to(device), quant)


def write(w: Written, path: str | None) -> None:
    if w.case.mla:
        mla = mla_writer_for_layout(w.case.layout)
        mla.write(w.key, w.value, w.cache, w.slots, w.quant, path=path)
    else:
        writer = writer_for_layout(w.case.layout)
        if isinstance(writer, LegacyPagedKVCacheWriter):  # bound, as a layer binds it
            writer = writer.bound_to(num_kv_heads=HEADS, head_size=HEAD_SIZE,
                                     head_size_v=HEAD_SIZE)
        writer.write(w.key, w.value, w.cache, w.slots, w.quant,
                     path=path)


def expected_rows(w: Written) -> list[tuple[str, Index, torch.Tensor]]:
    """``(name, index, expected bits [m, heads, width])`` for the kept tokens."""
    n = w.slots.shape[0]
    keep = w.slots >= 0
    c, q, phys = w.case, w.quant, w.phys
    if c.layout is L.MLA_FP8_DS:
        entries = expected_ds_mla(w.key[:n][keep], w.value[:n][keep])
        return [("entry", phys.k_index, entries.unsqueeze(1))]
    if c.layout is L.PER_TOKEN_HEAD_QUANT:
        return [("K", phys.k_index, expected_per_token_head(w.key[:n][keep], c.cache_dtype)),
                ("V", phys.v_index, expected_per_token_head(w.value[:n][keep], c.cache_dtype))]
    if c.layout is L.MLA_LATENT:
        kv_c = w.key[:n][keep].unsqueeze(1)
        pe = w.value[:n][keep]
        return [("latent", phys.k_index, expected_scaled(kv_c, c.cache_dtype, q.k_scale)),
                ("rope", phys.v_index, expected_scaled(pe, c.cache_dtype, q.k_scale))]
    return [("K", phys.k_index, expected_scaled(w.key[:n][keep], c.cache_dtype, q.k_scale)),
            ("V", phys.v_index, expected_scaled(w.value[:n][keep], c.cache_dtype, q.v_scale))]


def check(w: Written) -> None:
    """Every written row decodes to its expected bits; every other byte is unchanged."""
    keep = w.slots >= 0
    slots = w.slots[keep]
    blocks, offsets = slots // w.case.block_size, slots % w.case.block_size
    elem_bits = BITS[w.storage.element_size()]
    flat = w.storage.view(elem_bits)
    expected_flat = w.before.view(elem_bits).clone()
    for name, index, want in expected_rows(w):
        heads, width = want.shape[1], want.shape[2]
        got = gather(flat, index, blocks, offsets, heads, width)
        bad = (got != want.view(elem_bits)).nonzero()
        assert bad.numel() == 0, (
            f"{w.case.id}: {name} differs at (token, head, dim) {bad[:5].tolist()} of "
            f"{tuple(got.shape)}: got {got[tuple(bad[0])].item()} want "
            f"{want.view(elem_bits)[tuple(bad[0])].item()}"
        )
        expected_flat[index(blocks.view(-1, 1, 1), offsets.view(-1, 1, 1),
                            torch.arange(heads, device=flat.device).view(1, -1, 1),
                            torch.arange(width, device=flat.device).view(1, 1, -1))] = \
            want.view(elem_bits)
    changed = (flat != expected_flat).nonzero()
    assert changed.numel() == 0, (
        f"{w.case.id}: {changed.numel()} storage element(s) outside the written rows changed, "
        f"first at {changed[:5].flatten().tolist()}"
    )
