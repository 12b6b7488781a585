"""The nine standard backends' test grid, derived from their declarations, and an
independent float64 oracle (dense attention over the values the cache should hold)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from vllm.attention.backend import AttentionBackend
from vllm.attention.registry import get_backend

AnyBackend = type[AttentionBackend[Any]]

STANDARD: tuple[str, ...] = (
    "FLASH_ATTN",
    "FLASHINFER",
    "FLASHINFER_HND",
    "TRITON_ATTN",
    "FLEX_ATTENTION",
    "TREE_ATTN",
    "FLASH_ATTN_DIFFKV",
    "ROCM_ATTN",
    "ROCM_AITER_UNIFIED_ATTN",
    "ROCM_AITER_FA",
)
"""Registry names of the nine standard backends (FLASHINFER in both physical orders)."""

SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
GQA = ((2, 2), (8, 2), (8, 1))
"""(num_heads, num_kv_heads): ratios 1, 4 and 8."""

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


@dataclass(frozen=True)
class Case:
    backend: str
    device: str
    dtype: torch.dtype
    cache_dtype: str
    block_size: int
    num_heads: int = 8
    num_kv_heads: int = 2

    @property
    def id(self) -> str:
        return (f"{self.backend}-{self.device}-{SHORT[self.dtype]}-{self.cache_dtype}"
                f"-bs{self.block_size}-gqa{self.num_heads // self.num_kv_heads}")


def head_sizes(backend: AnyBackend) -> tuple[int, int | None]:
    """(head_size, head_size_v) for tests: 64 where allowed; DiffKV gets Dv = D // 2."""
    d = 64 if backend.head_sizes.admits(64) else backend.head_sizes.examples((16, 32, 128))[0]
    return d, (d // 2 if getattr(backend, "distinct_v_head_size", False) else None)


def grid_block_sizes(backend: AnyBackend) -> tuple[int, ...]:
    """Every block size of an explicit set; 16, 48 (not a power of 2) and 128 for
    "multiple of 16"."""
    return backend.block_sizes.examples((16, 48, 128))


def backend_cases(name: str, device: str) -> list[Case]:
    """The grid of one backend: every declared dtype x cache dtype x test block size,
    with GQA ratios 1, 4 and 8 in turn, so every backend meets all three."""
    b = get_backend(name)
    dtypes = [d for d in (torch.float32, torch.float16, torch.bfloat16) if d in b.supported_dtypes]
    out = []
    for dt in dtypes:
        for cd in sorted(b.supported_kv_cache_dtypes, key=lambda c: (c != "auto", c)):
            for bs in grid_block_sizes(b):
                h, kv = GQA[len(out) % len(GQA)]
                out.append(Case(name, device, dt, cd, bs, h, kv))
    return out


def cases(device: str) -> list[Any]:
    marks = [pytest.mark.gpu] if device == "cuda" else []
    return [pytest.param(c, id=c.id, marks=marks)
            for name in STANDARD for c in backend_cases(name, device)]


# -- the oracle -------------------------------------------------------------------------

_QMAX = {"int8_per_token_head": 127.0, "fp8_per_token_head": 448.0}
_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
        "fp8_e5m2": torch.float8_e5m2}


def stored(x: torch.Tensor, cache_dtype: str, scale: torch.Tensor) -> torch.Tensor:
    """float64 of what a cache in ``cache_dtype`` holds for rows ``x`` ``[T, H, D]``
    (DESIGN.md section 5, written out here independently of the writers)."""
    xf = x.float().cpu()
    if cache_dtype == "auto":
        return x.double().cpu()
    if cache_dtype in _FP8:
        dt = _FP8[cache_dtype]
        lim = torch.finfo(dt).max
        s = scale.float().cpu().view(1, -1, 1)
        return (xf / s).clamp(-lim, lim).to(dt).double() * s.double()
    qmax = _QMAX[cache_dtype]
    s = xf.abs().amax(-1, keepdim=True) / qmax
    y = xf / torch.where(s == 0, torch.ones_like(s), s)
    if cache_dtype == "int8_per_token_head":
        q = y.round().clamp(-127, 127).double()
    else:
        q = y.clamp(-448, 448).to(torch.float8_e4m3fn).double()
    return q * s.double()


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
          window: int | None = None, cap: float | None = None,
          visible: torch.Tensor | None = None) -> torch.Tensor:
    """float64 attention of one request: queries are the last ``Tq`` of ``Tk`` positions."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    tq, tk = q.shape[0], k.shape[0]
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    pos = torch.arange(tq).unsqueeze(1) + (tk - tq)
    t = torch.arange(tk).unsqueeze(0)
    mask = torch.ones(tq, tk, dtype=torch.bool)
    if causal:
        mask &= t <= pos
    if window is not None:
        mask &= (pos - t) < window
    if visible is not None:
        mask = visible.cpu()
    s = s.masked_fill(~mask, -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, v)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double().cpu() - ref).norm() / ref.norm())
