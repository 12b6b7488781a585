"""Rotary position embedding (RoPE) as the fused writers apply it.

:class:`RoPE` holds the table ``cos_sin_cache`` ``[max_position, rotary_dim]``
(cos in the first ``rotary_dim // 2`` columns, sin in the rest) and the pairing
style; :func:`rotate_reference` is the torch oracle the Triton kernels match
byte for byte, and :func:`apply_rope` rotates query/key rows in place (Triton on
CUDA, torch elsewhere).

Numerics (the contract the kernels reproduce): with ``x1, x2`` the two members
of a pair widened to float32 and ``c, s`` the table entries widened to float32,

    o1 = x1 * c - x2 * s        o2 = x2 * c + x1 * s

each product and the sum rounded to float32 separately (no fused multiply-add),
then rounded to the input dtype (nearest even; a NaN becomes the dtype's canonical
quiet NaN). ``neox`` pairs dimension ``j`` with ``j + rotary_dim // 2``, ``gptj``
pairs ``2j`` with ``2j + 1``; dimensions from ``rotary_dim`` on pass through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Literal, get_args

import torch

from vllm.attention.errors import InvalidArgumentError, InvalidTypeError

RoPEStyle = Literal["neox", "gptj"]
"""``neox``: dimension ``j`` pairs with ``j + rotary_dim // 2``; ``gptj``: ``2j`` with ``2j + 1``."""

ROPE_STYLES: Final[tuple[RoPEStyle, ...]] = get_args(RoPEStyle)
_TABLE_DTYPES: Final = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class RoPE:
    """A rotary embedding: its cos/sin table and pairing style.

    ``cos_sin_cache``: ``[max_position, rotary_dim]`` float32/fp16/bf16, cos in
    ``[:, :rotary_dim // 2]``, sin in ``[:, rotary_dim // 2:]`` (vLLM's layout).
    """

    cos_sin_cache: torch.Tensor
    style: RoPEStyle = "neox"

    def __post_init__(self) -> None:
        t: object = self.cos_sin_cache
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError("rope.cos_sin_cache", type(t).__name__, "a torch.Tensor")
        if t.dtype not in _TABLE_DTYPES:
            raise InvalidArgumentError("rope.cos_sin_cache.dtype", t.dtype,
                                       "torch.float32, float16 or bfloat16")
        if t.dim() != 2 or t.shape[1] < 2 or t.shape[1] % 2 or t.shape[0] < 1:
            raise InvalidArgumentError("rope.cos_sin_cache.shape", tuple(t.shape),
                                       "[max_position >= 1, rotary_dim] with an even rotary_dim >= 2")
        if self.style not in ROPE_STYLES:
            raise InvalidArgumentError("rope.style", self.style, "'neox' or 'gptj'")

    @property
    def rotary_dim(self) -> int:
        return int(self.cos_sin_cache.shape[1])

    @property
    def max_position(self) -> int:
        return int(self.cos_sin_cache.shape[0])

    @property
    def is_neox(self) -> bool:
        return self.style == "neox"

    @classmethod
    def build(cls, rotary_dim: int, max_position: int, *, base: float = 10000.0,
              style: RoPEStyle = "neox", dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> RoPE:
        """The standard table: ``inv_freq[j] = base ** (-2j / rotary_dim)``, angles
        ``position * inv_freq`` computed in float32, cos/sin then cast to ``dtype``."""
        if rotary_dim < 2 or rotary_dim % 2:
            raise InvalidArgumentError("rotary_dim", rotary_dim, "an even int >= 2")
        if max_position < 1:
            raise InvalidArgumentError("max_position", max_position, ">= 1")
        if not math.isfinite(base) or base <= 1.0:
            raise InvalidArgumentError("base", base, "a finite float > 1")
        inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        ang = torch.outer(torch.arange(max_position, dtype=torch.float32), inv)
        table = torch.cat([ang.cos(), ang.sin()], dim=-1).to(dtype=dtype, device=device)
        return cls(table, style)


def _pair_index(rotary_dim: int, neox: bool) -> tuple[slice, slice]:
    half = rotary_dim // 2
    if neox:
        return slice(0, half), slice(half, rotary_dim)
    return slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)


_CANONICAL_NAN: Final[dict[torch.dtype, tuple[torch.dtype, int]]] = {
    torch.float32: (torch.int32, 0x7FC00000),
    torch.float16: (torch.int16, 0x7E00),
    torch.bfloat16: (torch.int16, 0x7FC0),
}


def round_to(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``y`` to ``dtype``, nearest even, every NaN the canonical quiet NaN
    (set explicitly: torch's own conversions differ by device and code path)."""
    out = y.to(dtype)
    bits, nan = _CANONICAL_NAN[dtype]
    return out.view(bits).masked_fill(y.isnan(), nan).view(dtype)


def rotate_reference(x: torch.Tensor, positions: torch.Tensor, rope: RoPE) -> torch.Tensor:
    """The oracle: rows ``[0, N)`` of ``x`` ``[>= N, H, D]`` rotated (``N =
    positions.shape[0]``), as a new tensor of ``x``'s dtype; other rows copied."""
    n = positions.shape[0]
    r = rope.rotary_dim
    first, second = _pair_index(r, rope.is_neox)
    table = rope.cos_sin_cache.index_select(0, positions.to(rope.cos_sin_cache.device))
    table = table.to(torch.float32).to(x.device).unsqueeze(1)  # [N, 1, r]
    c, s = table[..., : r // 2], table[..., r // 2:]
    rows = x[:n].to(torch.float32)
    x1, x2 = rows[..., first], rows[..., second]
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    out = x.clone()
    out[:n, :, first] = round_to(o1, x.dtype)
    out[:n, :, second] = round_to(o2, x.dtype)
    return out


def check_rope_args(
    positions: object,
    rope: object,
    *,
    num_tokens: int,
    head_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, RoPE]:
    """Checked ``positions`` (int64 ``[>= num_tokens]`` on ``device``) and ``rope``
    (a :class:`RoPE` on ``device`` with ``rotary_dim <= head_size``). Metadata only:
    position values are range-checked in checked mode (:func:`check_positions_in_range`)."""
    if not isinstance(positions, torch.Tensor):
        raise InvalidTypeError("positions", type(positions).__name__, "a torch.Tensor")
    if not isinstance(rope, RoPE):
        raise InvalidTypeError("rope", type(rope).__name__, "a vllm.attention.rope.RoPE")
    if positions.dtype != torch.int64:
        raise InvalidArgumentError("positions.dtype", positions.dtype, "torch.int64")
    if positions.dim() != 1 or positions.shape[0] < num_tokens:
        raise InvalidArgumentError("positions.shape", tuple(positions.shape),
                                   f"[>= num_tokens={num_tokens}]")
    if positions.device != device:
        raise InvalidArgumentError("positions.device", str(positions.device),
                                   f"{device} (the cache's)")
    if rope.cos_sin_cache.device != device:
        raise InvalidArgumentError("rope.cos_sin_cache.device", str(rope.cos_sin_cache.device),
                                   f"{device} (the cache's)")
    if rope.rotary_dim > head_size:
        raise InvalidArgumentError("rope.rotary_dim", rope.rotary_dim,
                                   f"<= the rotated head size {head_size}")
    return positions, rope


def check_query(query: object, *, rows: int, head_size: int, dtype: torch.dtype,
                device: torch.device, name: str = "query") -> torch.Tensor:
    """``query`` is ``[>= rows, num_heads, head_size]`` of ``dtype`` on ``device``."""
    if not isinstance(query, torch.Tensor):
        raise InvalidTypeError(name, type(query).__name__, "a torch.Tensor or None")
    if query.dim() != 3 or query.shape[2] != head_size or query.shape[0] < rows:
        raise InvalidArgumentError(f"{name}.shape", tuple(query.shape),
                                   f"[>= {rows}, num_heads, {head_size}]")
    if query.dtype != dtype:
        raise InvalidArgumentError(f"{name}.dtype", query.dtype, f"{dtype} (the key's)")
    if query.device != device:
        raise InvalidArgumentError(f"{name}.device", str(query.device), f"{device} (the cache's)")
    return query


def check_positions_in_range(positions: torch.Tensor, rope: RoPE) -> None:
    """Checked mode: every position indexes a row of the table (reads the values)."""
    if positions.numel() == 0:
        return
    lo, hi = int(positions.min().item()), int(positions.max().item())
    if lo < 0 or hi >= rope.max_position:
        raise InvalidArgumentError("positions", f"values in [{lo}, {hi}]",
                                   f"positions in [0, {rope.max_position}) (the table's rows)")


def apply_rope(
    query: torch.Tensor | None,
    key: torch.Tensor | None,
    positions: torch.Tensor,
    rope: RoPE,
    *,
    path: Literal["torch", "triton"] | None = None,
) -> None:
    """Rotate rows ``[0, positions.shape[0])`` of ``query`` and ``key`` (``[>= N, H, D]``,
    any strides, either may be None) in place. Triton on CUDA, torch elsewhere."""
    from vllm.attention.writers.dispatch import resolve_path

    anchor = key if key is not None else query
    if anchor is None:
        return
    n = positions.shape[0]
    check_rope_args(positions, rope, num_tokens=n, head_size=anchor.shape[-1],
                    device=anchor.device)
    for name, x in (("query", query), ("key", key)):
        if x is not None:
            check_query(x, rows=n, head_size=anchor.shape[-1], dtype=anchor.dtype,
                        device=anchor.device, name=name)
    if resolve_path(anchor.device, path) == "triton":
        from vllm.attention.writers.kernels import rope_launch

        rope_launch(query, key, positions, rope.cos_sin_cache, rope.is_neox).run()
        return
    for x in (query, key):
        if x is not None:
            x[:n] = rotate_reference(x[:n], positions, rope)
