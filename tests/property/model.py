"""The model behind the writer property tests: random write cases, the tensors they
describe, and an oracle that checks every byte of the cache's storage.

A :class:`WriteCase` is plain data (layout, dtypes, sizes, physical stride order,
padding, slot-mapping shape, input views, a seed). :func:`draw_case` builds one
from a :class:`Chooser`, so the same generator feeds Hypothesis on CPU
(:class:`HypothesisChooser`) and the seeded GPU sweep (:class:`RandomChooser`).

The oracle knows nothing of the library's views: the cache is an ``as_strided``
view of a flat storage of random bytes, built here from a stride order and
paddings; element ``(block, offset, head, dim)`` of K and V is located with the
layout formulas of ``docs/layouts.md`` written out below; the stored bits are
computed here from the write semantics of ``docs/architecture.md``. A check then
requires, for the whole storage (padding, bytes before and after the view
included):

* every kept token's slot holds exactly the expected bits;
* every byte outside the written slots is unchanged (tokens with a negative slot, or a
  slot past the cache, write nothing);
* a slot named twice holds, element by element, one of its tokens' values
  (duplicates are unspecified, but never leak into another slot);
* rows of ``key``/``value`` past ``slot_mapping.shape[0]`` are never read: they
  hold NaN / inf, which would show in any slot (or any per-row scale) they reached.
"""

from __future__ import annotations

import collections
import functools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from vllm.attention import KVCacheLayout, KVQuant
from vllm.attention.writers import (
    AiterShuffledKVCacheWriter,
    DiffKVCacheWriter,
    FP8DsMLACacheWriter,
    LegacyPagedKVCacheWriter,
    MLALatentCacheWriter,
    PerTokenHeadKVCacheWriter,
    SplitKVCacheWriter,
)

L = KVCacheLayout
T = TypeVar("T")

IN_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
}
FP8: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}
SCALED = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
PTQ = ("int8_per_token_head", "fp8_per_token_head")
BITS: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
SPLIT_LAYOUTS = (L.SPLIT_NHD, L.SPLIT_HND, L.SPLIT_KV_FIRST, L.SPLIT_BLOCK_INTERLEAVED)
CANONICAL_ORDER: dict[KVCacheLayout, tuple[int, ...]] = {
    L.SPLIT_NHD: (0, 1, 2, 3, 4),
    L.SPLIT_HND: (0, 1, 3, 2, 4),
    L.SPLIT_BLOCK_INTERLEAVED: (0, 2, 1, 3, 4),
    L.SPLIT_KV_FIRST: (0, 1, 2, 3, 4),
    L.PER_TOKEN_HEAD_QUANT: (0, 1, 2, 3, 4),
    L.DIFFKV_PACKED: (0, 1, 2, 3),
    L.MLA_LATENT: (0, 1, 2),
    L.MLA_FP8_DS: (0, 1, 2),
    L.LEGACY_PAGED: (0, 1, 2),
    L.AITER_SHUFFLED: (0, 1, 2, 3, 4),
}

FAMILIES = ("split", "legacy_paged", "aiter", "diffkv", "per_token_head", "mla_latent",
            "fp8_ds_mla")
"""One writer family per entry (``vllm/attention/writers/*``)."""

INPUT_STYLES = ("contiguous", "fused_slice", "head_major", "broadcast")
"""How ``key``/``value`` sit in memory: their own tensor; slices of one fused
projection output (as models produce them); head-major and transposed; one row
broadcast over heads (stride 0)."""

CASES_RUN: collections.Counter[str] = collections.Counter()
"""Write cases checked in this process, per ``"<family>/<path>"`` (the summary reads it)."""


# ------------------------------------------------------------------ choosers


class Chooser(Protocol):
    """Where a case's random choices come from."""

    def integer(self, lo: int, hi: int) -> int: ...

    def choice(self, options: Sequence[T]) -> T: ...


class RandomChooser:
    """Choices from a seeded :class:`random.Random` (the GPU sweep)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, options: Sequence[T]) -> T:
        return options[self.rng.randrange(len(options))]


@functools.cache
def _integers(lo: int, hi: int) -> Any:
    from hypothesis import strategies as st

    return st.integers(lo, hi)


class HypothesisChooser:
    """Choices drawn through Hypothesis (shrinkable)."""

    def __init__(self, draw: Callable[[Any], Any]) -> None:
        self._draw = draw

    def integer(self, lo: int, hi: int) -> int:
        return int(self._draw(_integers(lo, hi)))

    def choice(self, options: Sequence[T]) -> T:
        return options[int(self._draw(_integers(0, len(options) - 1)))]


def percent(c: Chooser, p: int) -> bool:
    """True with probability ``p``% (a shrinkable draw)."""
    return c.integer(0, 99) < p


# ------------------------------------------------------------------ cases


@dataclass(frozen=True)
class WriteCase:
    """One write: everything needed to rebuild its tensors on any device."""

    family: str
    layout: KVCacheLayout
    in_dtype: str
    cache_dtype: str
    num_blocks: int
    block_size: int
    num_heads: int
    head_size: int
    head_size_v: int
    """DiffKV's Dv; the rope width R for MLA; equal to ``head_size`` otherwise."""
    num_tokens: int
    extra_rows: int
    order: tuple[int, ...]
    """Physical order of the logical axes, outermost first."""
    pads: tuple[int, ...]
    """Padding added to each physical axis' stride, in elements (a view of a larger buffer;
    on the innermost axis, gaps between elements)."""
    storage_offset: int
    tail: int
    scale_kind: str
    neg_percent: int
    duplicates: int
    input_style: str
    slots_strided: bool
    specials: bool
    seed: int
    past_percent: int = 0
    """Share of tokens whose slot lies past the cache (``>= num_slots``): skipped outside
    checked mode (``docs/errors.md``), never written anywhere."""

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def mla(self) -> bool:
        return self.family in ("mla_latent", "fp8_ds_mla")

    @property
    def storage_dtype(self) -> torch.dtype:
        if self.cache_dtype == "auto":
            return IN_DTYPES[self.in_dtype]
        if self.cache_dtype in FP8:
            return FP8[self.cache_dtype]
        return torch.uint8

    def describe(self) -> str:
        return (f"{self.family}/{self.layout.value} in={self.in_dtype} cache={self.cache_dtype} "
                f"nb={self.num_blocks} bs={self.block_size} H={self.num_heads} "
                f"D={self.head_size}/{self.head_size_v} T={self.num_tokens}+{self.extra_rows} "
                f"order={self.order} pads={self.pads} off={self.storage_offset} "
                f"scale={self.scale_kind} neg={self.neg_percent}% dup={self.duplicates} "
                f"inputs={self.input_style} strided_slots={self.slots_strided} "
                f"specials={self.specials} past={self.past_percent}% seed={self.seed}")


def _x(dtype: torch.dtype) -> int:
    """Elements per 16 bytes (the legacy / AITER x-split)."""
    return 16 // dtype.itemsize


TOKEN_BUCKETS: tuple[tuple[int, int], ...] = (
    (0, 0), (1, 8), (1, 8), (1, 8), (9, 64), (9, 64), (9, 64), (65, 512), (65, 512),
    (513, 4096),
)
"""``num_tokens`` ranges, drawn with equal weight (so 10% empty, 10% in the thousands)."""

ELEMENT_BUDGET = 12288
"""Most elements per operand (``T * H * W``) of one case: many small cases beat a few
big ones; cases in the thousands of tokens get narrow rows."""


CACHE_BUDGET = 65536
"""Most storage elements of a case's cache, roughly (block sizes shrink to fit)."""


def _num_tokens(c: Chooser, max_tokens: int) -> int:
    lo, hi = c.choice(TOKEN_BUCKETS)
    hi = min(hi, max_tokens)
    return c.integer(min(lo, hi), hi)


def _fit(width: int, n: int, heads: int, quantum: int = 1) -> int:
    """``width`` cut down (to a multiple of ``quantum``) so ``n * heads * width`` fits
    the element budget."""
    room = ELEMENT_BUDGET // max(1, n * heads)
    return max(quantum, min(width, room // quantum * quantum))


def draw_case(c: Chooser, family: str, *, max_tokens: int = 4096, small: bool = False) -> WriteCase:
    """A random valid write of ``family``. ``small`` keeps sizes tiny (interpreter runs)."""
    if family not in FAMILIES:
        raise ValueError(f"family: got {family!r}, expected one of {FAMILIES}")
    n = _num_tokens(c, 6 if small else max_tokens)
    in_dtype = c.choice(tuple(IN_DTYPES))
    dmax = 24 if small else 160
    heads = c.integer(1, 3 if small else 8)
    if n * heads > ELEMENT_BUDGET // 4:
        heads = 1
    layout: KVCacheLayout
    if family == "split":
        layout = c.choice(SPLIT_LAYOUTS)
        cache_dtype = c.choice(SCALED)
        bs = c.integer(1, 64)
        d = _fit(c.integer(1, dmax), n, heads)
        dv = d
    elif family in ("legacy_paged", "aiter"):
        layout = L.LEGACY_PAGED if family == "legacy_paged" else L.AITER_SHUFFLED
        cache_dtype = c.choice(SCALED)
        elem = IN_DTYPES[in_dtype] if cache_dtype == "auto" else FP8[cache_dtype]
        x = _x(elem)
        d = _fit(x * c.integer(1, max(1, dmax // x)), n, heads, x)
        dv = d
        bs = x * c.integer(1, 4) if family == "aiter" else c.integer(1, 64)
    elif family == "diffkv":
        layout = L.DIFFKV_PACKED
        cache_dtype = c.choice(SCALED)
        bs = c.integer(1, 64)
        d = _fit(c.integer(1, dmax), n, heads)
        dv = _fit(c.integer(1, dmax), n, heads)
    elif family == "per_token_head":
        layout = L.PER_TOKEN_HEAD_QUANT
        cache_dtype = c.choice(PTQ)
        bs = c.integer(1, 64)
        d = _fit(c.integer(1, dmax), n, heads)
        dv = d
    elif family == "mla_latent":
        layout = L.MLA_LATENT
        cache_dtype = c.choice(SCALED)
        heads = 1
        bs = c.integer(1, 64)
        d = _fit(c.integer(1, 32 if small else 576), n, 1)
        dv = _fit(c.integer(1, 16 if small else 80), n, 1)
    else:
        layout = L.MLA_FP8_DS
        cache_dtype = "fp8_ds_mla"
        heads = 1
        bs = c.integer(1, 8 if small else 64)
        d, dv = 512, 64
        if n > 64:  # 656-byte entries: keep the big cases rare
            n = 64 + (n - 64) // 8
    if cache_dtype == "auto" and family not in ("per_token_head", "fp8_ds_mla"):
        scale_kind = "none"
    elif family in ("per_token_head", "fp8_ds_mla"):
        scale_kind = "none"
    else:
        per_head = family not in ("mla_latent",) and percent(c, 50)
        scale_kind = c.choice(("one", "mid", "tiny", "huge")) + ("_per_head" if per_head else "")
    dup = 0
    if n >= 2 and percent(c, 15):
        dup = c.integer(1, min(4, n // 2))
    neg = c.choice((0, 0, 10, 50, 100))
    seed = c.integer(0, 2**31 - 1)
    # Memory-placement details come from the seed: fewer Hypothesis draws per example
    # (it shrinks the sizes and dtypes above, and the seed as a whole).
    m = RandomChooser(seed)
    row = 2 * heads * (d + dv) if family not in ("mla_latent", "fp8_ds_mla") else d + dv
    extra_blocks = m.integer(0, 3)
    while bs > 1 and (-(-n // bs) + extra_blocks) * bs * row > CACHE_BUDGET:
        bs = max(1, bs // 2)  # big rows: smaller blocks keep the cache small
        if family == "aiter":
            bs = max(x, bs // x * x)
            break
    num_blocks = max(1, -(-n // bs)) + extra_blocks  # room for every token's own slot
    ndim = 3 if layout in (L.MLA_LATENT, L.MLA_FP8_DS, L.LEGACY_PAGED) else (
        4 if layout is L.DIFFKV_PACKED else 5)
    order = CANONICAL_ORDER[layout]
    if layout not in (L.LEGACY_PAGED, L.AITER_SHUFFLED) and percent(m, 40):
        rest = list(range(ndim))
        order = tuple(rest.pop(m.integer(0, len(rest) - 1)) for _ in range(ndim))
    pads = (0,) * ndim
    if percent(m, 50):
        if layout in (L.LEGACY_PAGED, L.AITER_SHUFFLED):
            # rows of a block are reinterpreted: only the K/V and block axes may be padded
            pads = (m.choice((0, 8, 32)), m.choice((0, 16, 48))) + (0,) * (ndim - 2)
        else:
            # outer axes: a view of a larger buffer; innermost: gaps between elements
            pads = tuple(m.choice((0, 0, 1, 7, 64)) for _ in range(ndim - 1)) + (
                m.choice((0, 0, 1)),)
    return WriteCase(
        family=family, layout=layout, in_dtype=in_dtype, cache_dtype=cache_dtype,
        num_blocks=num_blocks, block_size=bs, num_heads=heads, head_size=d, head_size_v=dv,
        num_tokens=n, extra_rows=m.choice((0, 0, 1, 3, 17)), order=order, pads=pads,
        storage_offset=m.choice((0, 0, 5, 64)), tail=m.choice((0, 3, 40)),
        scale_kind=scale_kind, neg_percent=neg, duplicates=dup,
        input_style=m.choice(INPUT_STYLES), slots_strided=percent(m, 25),
        specials=percent(m, 30), seed=seed, past_percent=m.choice((0, 0, 0, 10, 50)),
    )


# ------------------------------------------------------------------ the cache


def logical_shape(case: WriteCase) -> tuple[int, ...]:
    nb, bs, h, d, dv = (case.num_blocks, case.block_size, case.num_heads, case.head_size,
                        case.head_size_v)
    lay = case.layout
    if lay in (L.SPLIT_NHD, L.SPLIT_HND, L.SPLIT_BLOCK_INTERLEAVED):
        return (nb, 2, bs, h, d)
    if lay in (L.SPLIT_KV_FIRST, L.AITER_SHUFFLED):
        return (2, nb, bs, h, d)
    if lay is L.PER_TOKEN_HEAD_QUANT:
        return (nb, 2, bs, h, d + 4)
    if lay is L.LEGACY_PAGED:
        return (2, nb, bs * h * d)
    if lay is L.DIFFKV_PACKED:
        return (nb, bs, h, d + dv)
    if lay is L.MLA_LATENT:
        return (nb, bs, d + dv)
    return (nb, bs, 656)


def logical_strides(case: WriteCase) -> tuple[tuple[int, ...], int]:
    """Strides of the logical axes for the case's physical order and paddings, and
    the storage extent (elements from the storage offset to one past the last)."""
    shape = logical_shape(case)
    phys = [shape[a] for a in case.order]
    strides_phys = [0] * len(phys)
    inner = 1  # elements spanned by one step of the axis inside
    for i in range(len(phys) - 1, -1, -1):
        strides_phys[i] = inner + case.pads[i]
        inner = strides_phys[i] * phys[i]
    strides = [0] * len(shape)
    for i, axis in enumerate(case.order):
        strides[axis] = strides_phys[i]
    extent = 1 + sum((s - 1) * st for s, st in zip(shape, strides))
    return tuple(strides), extent


Index = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(block, offset, head, dim)`` broadcastable int64 tensors to storage element offsets."""


def operand_indices(case: WriteCase) -> list[tuple[str, Index, int]]:
    """``(name, index, width)`` of each stored operand, from the layout formulas."""
    s, _ = logical_strides(case)
    off = case.storage_offset
    d, dv, bs = case.head_size, case.head_size_v, case.block_size
    lay = case.layout
    if lay in (L.SPLIT_NHD, L.SPLIT_HND, L.SPLIT_BLOCK_INTERLEAVED, L.PER_TOKEN_HEAD_QUANT):
        w = d + 4 if lay is L.PER_TOKEN_HEAD_QUANT else d
        return [
            ("K", lambda b, o, h, j: off + b * s[0] + o * s[2] + h * s[3] + j * s[4], w),
            ("V", lambda b, o, h, j: off + s[1] + b * s[0] + o * s[2] + h * s[3] + j * s[4], w),
        ]
    if lay is L.SPLIT_KV_FIRST:
        return [
            ("K", lambda b, o, h, j: off + b * s[1] + o * s[2] + h * s[3] + j * s[4], d),
            ("V", lambda b, o, h, j: off + s[0] + b * s[1] + o * s[2] + h * s[3] + j * s[4], d),
        ]
    if lay is L.DIFFKV_PACKED:
        return [
            ("K", lambda b, o, h, j: off + b * s[0] + o * s[1] + h * s[2] + j * s[3], d),
            ("V", lambda b, o, h, j: off + b * s[0] + o * s[1] + h * s[2] + (d + j) * s[3], dv),
        ]
    if lay is L.MLA_LATENT:
        return [
            ("latent", lambda b, o, h, j: off + b * s[0] + o * s[1] + j * s[2], d),
            ("rope", lambda b, o, h, j: off + b * s[0] + o * s[1] + (d + j) * s[2], dv),
        ]
    if lay is L.MLA_FP8_DS:
        return [("entry", lambda b, o, h, j: off + b * s[0] + o * s[1] + j * s[2], 656)]
    x = _x(case.storage_dtype)
    h_all = case.num_heads
    if lay is L.LEGACY_PAGED:
        # K [nb, H, D/x, bs, x], V [nb, H, D, bs]; each block's row is contiguous
        return [
            ("K", lambda b, o, h, j: off + b * s[1] + h * d * bs + (j // x) * bs * x
             + o * x + j % x, d),
            ("V", lambda b, o, h, j: off + s[0] + b * s[1] + h * d * bs + j * bs + o, d),
        ]
    if lay is L.AITER_SHUFFLED:
        # K [nb, H, D/x, bs, x], V [nb, H, bs/x, D, x]: the bytes of a (bs, H, D) block
        del h_all
        return [
            ("K", lambda b, o, h, j: off + b * s[1] + h * d * bs + (j // x) * bs * x
             + o * x + j % x, d),
            ("V", lambda b, o, h, j: off + s[0] + b * s[1] + h * bs * d + (o // x) * d * x
             + j * x + o % x, d),
        ]
    raise AssertionError(lay)


# ------------------------------------------------------------------ expected bits


def fp8_expected(y: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """float32 ``y`` stored as fp8: saturate to the finite range, round to nearest
    even (torch's cast; ``tests/test_fp8_edges.py`` checks it against the format
    definition), every NaN as the byte 0x7F. uint8."""
    m = torch.finfo(fp8).max
    q = y.clamp(-m, m).to(fp8).view(torch.uint8).clone()
    q[y.isnan()] = 0x7F
    return q


def f32_le_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 ``[...]`` as little-endian bytes ``[..., 4]``; NaN as 0x7FC00000."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = torch.where(x.isnan(), torch.full_like(bits, 0x7FC00000), bits)
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int64)
    return ((bits.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8)


def bf16_bits_rne(x: torch.Tensor) -> torch.Tensor:
    """float32 to bf16 bits by integer round-to-nearest-even; NaN as 0x7FC0. int16."""
    b = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    r = torch.where(x.isnan(), torch.full_like(r, 0x7FC0), r)
    return torch.where(r >= 0x8000, r - 0x10000, r).to(torch.int16)


def _row_scale(rows: torch.Tensor, qmax: float, floor: float | None) -> torch.Tensor:
    """``amax(|row|) / qmax`` per last-axis row (NaN if the row has one), float32."""
    isnan = rows.isnan()
    amax = torch.where(isnan, torch.zeros_like(rows), rows.abs()).amax(-1)
    scale = amax / torch.tensor(qmax)
    if floor is not None:
        scale = torch.maximum(scale, torch.tensor(floor))
    return torch.where(isnan.any(-1), torch.full_like(scale, math.nan), scale)


def expected_scaled(x: torch.Tensor, cache_dtype: str, scale: torch.Tensor) -> torch.Tensor:
    """Rows ``[n, H, W]`` as stored (bits of the storage element)."""
    if cache_dtype == "auto":
        return x.view(BITS[x.element_size()])
    y = x.to(torch.float32) / scale.view(1, -1, 1)
    return fp8_expected(y, FP8[cache_dtype])


def expected_per_token_head(x: torch.Tensor, cache_dtype: str) -> torch.Tensor:
    """Rows ``[n, H, D]`` as their ``[n, H, D + 4]`` bytes."""
    xf = x.to(torch.float32)
    int8 = cache_dtype == "int8_per_token_head"
    scale = _row_scale(xf, 127.0 if int8 else 448.0, None)
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale)
    y = xf / divisor.unsqueeze(-1)
    if int8:
        r = y.clamp(-127.0, 127.0).round()  # torch.round: half to even
        q = torch.where(y.isnan(), torch.zeros_like(r), r).to(torch.int8).view(torch.uint8)
    else:
        q = fp8_expected(y, torch.float8_e4m3fn)
    return torch.cat([q, f32_le_bytes(scale)], dim=-1)


def expected_ds_mla(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """``[n, 512]`` latent and ``[n, 64]`` rope as ``[n, 656]`` entry bytes."""
    n = kv_c.shape[0]
    tiles = kv_c.to(torch.float32).reshape(n, 4, 128)
    scale = _row_scale(tiles, 448.0, 2.0 ** -126)
    q = fp8_expected(tiles / scale.unsqueeze(-1), torch.float8_e4m3fn).reshape(n, 512)
    if k_pe.dtype == torch.float32:
        rope = bf16_bits_rne(k_pe)
    else:
        rope = k_pe.contiguous().view(torch.int16)
    rope_bytes = rope.contiguous().view(torch.uint8).reshape(n, 128)
    return torch.cat([q, f32_le_bytes(scale).reshape(n, 16), rope_bytes], dim=-1)


# ------------------------------------------------------------------ tensors


@dataclass
class Built:
    """A case's tensors on a device, and a CPU copy of the storage before the write."""

    case: WriteCase
    storage: torch.Tensor
    before: torch.Tensor
    cache: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    slots: torch.Tensor
    quant: KVQuant
    extra: dict[str, Any] = field(default_factory=dict)


def _values(shape: tuple[int, ...], gen: torch.Generator, specials: bool) -> torch.Tensor:
    """float32 values: mostly normal, some saturating, some tiny; with ``specials``
    also zeros of both signs, infinities, NaN and fp8 rounding ties."""
    x = torch.randn(shape, generator=gen) * 3
    u = torch.rand(shape, generator=gen)
    x = torch.where(u < 0.03, x * 500, x)
    x = torch.where((u >= 0.03) & (u < 0.06), x * 1e-4, x)
    if specials:
        pick = torch.randint(0, 10, shape, generator=gen)
        table = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1.0625, 0.0029296875,
                              448.0, 464.0, 2.0 ** -10])
        sel = torch.rand(shape, generator=gen) < 0.05
        x = torch.where(sel, table[pick], x)
    return x


def _rows(case: WriteCase, width: int, heads: int, gen: torch.Generator) -> torch.Tensor:
    """``[T + extra, heads, width]`` float32 values with NaN / inf past ``num_tokens``."""
    rows = case.num_tokens + case.extra_rows
    x = _values((rows, heads, width), gen, case.specials)
    if case.extra_rows:
        poison = torch.full((case.extra_rows, heads, width), math.nan)
        poison[1::2] = math.inf
        x[case.num_tokens:] = poison
    return x


def _as_input(x: torch.Tensor, case: WriteCase, dtype: torch.dtype, gen: torch.Generator,
              other_width: int, device: str | torch.device) -> torch.Tensor:
    """``x`` ``[R, H, W]`` in ``dtype`` on ``device``, laid out as ``case.input_style``
    says (views are taken on the device: ``.to()`` would make them dense)."""
    rows, heads, width = x.shape
    style = case.input_style
    if style == "fused_slice":
        # one projection output [R, H*(W + other) + 5]; x is a column slice of it
        total = heads * (width + other_width) + 5
        buf = torch.randn(rows, total, generator=gen).to(dtype)
        start = heads * other_width + 5
        buf[:, start:start + heads * width] = x.reshape(rows, heads * width).to(dtype)
        return buf.to(device)[:, start:start + heads * width].unflatten(1, (heads, width))
    if style == "head_major":
        return x.transpose(0, 1).contiguous().to(dtype).to(device).transpose(0, 1)
    if style == "broadcast" and heads > 1:
        return x[:, :1].to(dtype).to(device).expand(rows, heads, width)
    return x.to(dtype).contiguous().to(device)


def _slots(case: WriteCase, gen: torch.Generator, device: str | torch.device) -> torch.Tensor:
    n = case.num_tokens
    slots = torch.randperm(case.num_slots, generator=gen)[:n].to(torch.int64)
    if case.duplicates:
        src = torch.randperm(n, generator=gen)[: 2 * case.duplicates]
        slots[src[case.duplicates:]] = slots[src[: case.duplicates]]
    if case.neg_percent and n:
        neg = torch.rand(n, generator=gen) * 100 < case.neg_percent
        fill = torch.tensor([-1, -1, -1, -2, -(2 ** 40), -(2 ** 63)], dtype=torch.int64)
        which = torch.randint(0, fill.numel(), (n,), generator=gen)
        slots = torch.where(neg, fill[which], slots)
    if case.past_percent and n:
        past = torch.rand(n, generator=gen) * 100 < case.past_percent
        ns, bs = case.num_slots, case.block_size
        fill = torch.tensor([ns, ns + 1, ns + bs, 2 * ns + 3, 2 ** 40, 2 ** 62], dtype=torch.int64)
        which = torch.randint(0, fill.numel(), (n,), generator=gen)
        slots = torch.where(past & (slots >= 0), fill[which], slots)
    if case.slots_strided:
        # a strided view into a larger buffer whose other entries are out of range
        big = torch.full((2 * n + 3,), case.num_slots + 7, dtype=torch.int64)
        big[3::2] = slots
        return big.to(device)[3::2]
    return slots.to(device)


def _scale(case: WriteCase, gen: torch.Generator) -> torch.Tensor:
    kind = case.scale_kind.removesuffix("_per_head")
    count = case.num_heads if case.scale_kind.endswith("_per_head") else 1
    if kind in ("none", "one"):
        return torch.ones(count)
    base = {"mid": 1.0, "tiny": 1e-3, "huge": 1e3}[kind]
    return (torch.rand(count, generator=gen) * 0.75 + 0.25) * base


def build(case: WriteCase, device: str | torch.device = "cpu") -> Built:
    """The case's cache (random bytes), inputs, slot mapping and quant on ``device``."""
    gen = torch.Generator().manual_seed(case.seed)
    strides, extent = logical_strides(case)
    numel = case.storage_offset + extent + case.tail
    sdt = case.storage_dtype
    words = -(-numel * sdt.itemsize // 8)  # random int64 words: 8x fewer draws than bytes
    raw = torch.randint(-(2**63), 2**63 - 1, (words,), generator=gen, dtype=torch.int64)
    before = raw.view(torch.uint8)[: numel * sdt.itemsize].view(sdt)
    storage = before.to(device)
    cache = storage.as_strided(logical_shape(case), strides, case.storage_offset)
    dt = IN_DTYPES[case.in_dtype]
    h = case.num_heads
    if case.family == "mla_latent" or case.family == "fp8_ds_mla":
        latent = _rows(case, case.head_size, 1, gen)
        rope = _rows(case, case.head_size_v, 1, gen)
        if case.input_style == "fused_slice":
            # kv_c and k_pe split out of one [R, L + R] projection, as models do
            fused = torch.cat([latent[:, 0], rope[:, 0]], dim=-1).to(dt).to(device)
            key, value = fused.split([case.head_size, case.head_size_v], dim=-1)
        else:
            key, value = latent[:, 0].to(dt).to(device), rope[:, 0].to(dt).to(device)
        if case.input_style == "head_major":
            value = value.unsqueeze(1)  # k_pe as [T, 1, R]
    else:
        key = _as_input(_rows(case, case.head_size, h, gen), case, dt, gen, case.head_size_v,
                        device)
        value = _as_input(_rows(case, case.head_size_v, h, gen), case, dt, gen,
                          case.head_size, device)
    slots = _slots(case, gen, device)
    k_scale, v_scale = _scale(case, gen), _scale(case, gen)
    quant = KVQuant(case.cache_dtype, k_scale.to(device), v_scale.to(device))  # type: ignore[arg-type]
    return Built(case, storage, before.clone(), cache, key, value, slots, quant)


# ------------------------------------------------------------------ write and check


def writer_for(case: WriteCase) -> Any:
    lay = case.layout
    if lay in SPLIT_LAYOUTS:
        return SplitKVCacheWriter(lay)
    return {
        L.LEGACY_PAGED: LegacyPagedKVCacheWriter,
        L.AITER_SHUFFLED: AiterShuffledKVCacheWriter,
        L.DIFFKV_PACKED: DiffKVCacheWriter,
        L.PER_TOKEN_HEAD_QUANT: PerTokenHeadKVCacheWriter,
        L.MLA_LATENT: MLALatentCacheWriter,
        L.MLA_FP8_DS: FP8DsMLACacheWriter,
    }[lay]()


def write(b: Built, path: str | None) -> None:
    writer_for(b.case).write(b.key, b.value, b.cache, b.slots, b.quant, path=path)


def expected_rows(b: Built, rows: torch.Tensor) -> list[torch.Tensor]:
    """Stored bits ``[m, H, W]`` per operand for token rows ``rows`` (CPU)."""
    c = b.case
    key, value = b.key.cpu()[rows], b.value.cpu()[rows]
    k_scale, v_scale = b.quant.k_scale.cpu(), b.quant.v_scale.cpu()
    if c.family == "fp8_ds_mla":
        return [expected_ds_mla(key, value.reshape(value.shape[0], c.head_size_v)).unsqueeze(1)]
    if c.family == "mla_latent":
        pe = value.reshape(value.shape[0], 1, c.head_size_v)
        return [expected_scaled(key.unsqueeze(1), c.cache_dtype, k_scale),
                expected_scaled(pe, c.cache_dtype, k_scale)]
    if c.family == "per_token_head":
        return [expected_per_token_head(key, c.cache_dtype),
                expected_per_token_head(value, c.cache_dtype)]
    return [expected_scaled(key, c.cache_dtype, k_scale),
            expected_scaled(value, c.cache_dtype, v_scale)]


def _locate(case: WriteCase, flat_index: int) -> str:
    """Which slot (if any) a storage element belongs to, for failure messages."""
    for name, index, width in operand_indices(case):
        nb, bs, h = case.num_blocks, case.block_size, case.num_heads
        blocks = torch.arange(nb).view(-1, 1, 1, 1)
        offs = torch.arange(bs).view(1, -1, 1, 1)
        hh = torch.arange(h).view(1, 1, -1, 1)
        jj = torch.arange(width).view(1, 1, 1, -1)
        hit = (index(blocks, offs, hh, jj) == flat_index).nonzero()
        if hit.numel():
            b, o, hd, j = hit[0].tolist()
            return f"{name} of slot {b * bs + o} (block {b}, offset {o}, head {hd}, elem {j})"
    return "no slot (padding or outside the cache view)"


def check(b: Built) -> None:
    """The invariants of the module docstring, over the whole storage."""
    c = b.case
    bits = BITS[c.storage_dtype.itemsize]
    got = b.storage.cpu().view(bits)
    want = b.before.view(bits).clone()
    free = torch.ones_like(want, dtype=torch.bool)  # False: a duplicated slot's elements
    slots = b.slots.cpu()
    kept = ((slots >= 0) & (slots < c.num_slots)).nonzero().flatten()
    kept_slots = slots[kept]
    uniq, inverse, counts = torch.unique(kept_slots, return_inverse=True, return_counts=True)
    dup_token = counts[inverse] > 1
    heads = 1 if c.mla else c.num_heads
    rows = expected_rows(b, kept)
    for (name, index, width), stored in zip(operand_indices(c), rows):
        blk = (kept_slots // c.block_size).view(-1, 1, 1)
        off = (kept_slots % c.block_size).view(-1, 1, 1)
        hh = torch.arange(heads).view(1, -1, 1)
        jj = torch.arange(width).view(1, 1, -1)
        idx = index(blk, off, hh, jj).expand(-1, heads, width)
        stored = stored.view(bits)
        single = ~dup_token
        want[idx[single]] = stored[single]
        if bool(dup_token.any()):
            free[idx[dup_token]] = False
            for s in kept_slots[dup_token].unique().tolist():
                tokens = (kept_slots == s).nonzero().flatten()
                cand = stored[tokens]  # [k, heads, width]
                at = got[idx[tokens[0]]]
                ok = (cand == at.unsqueeze(0)).any(0)
                assert bool(ok.all()), (
                    f"{c.describe()}\n{name} of duplicated slot {s}: element(s) "
                    f"{ok.logical_not().nonzero()[:5].tolist()} match none of its tokens' rows"
                )
    bad = ((got != want) & free).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{c.describe()}\n{bad.numel()} storage element(s) differ from the expected bytes; "
        f"first at element {int(bad[0])}: got {int(got[bad[0]])}, want {int(want[bad[0]])} "
        f"({_locate(c, int(bad[0]))})"
    )


def run_case(case: WriteCase, device: str | torch.device = "cpu",
             path: str | None = None) -> None:
    """Build, write, check; counted in :data:`CASES_RUN`."""
    b = build(case, device)
    write(b, path)
    check(b)
    CASES_RUN[f"{case.family}/{path or 'default'}"] += 1
