"""Small helpers shared by tests (not a conftest: imported explicitly)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` inside, restored after. The test
    packages of small-shape work run with one thread: on a shared 2-core machine the
    thread pool costs more in contention than it gains."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def raw(t: torch.Tensor) -> torch.Tensor:
    """Every byte of ``t``'s storage (uint8, shares memory)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def fill_random_bytes(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    r = raw(t)
    r.copy_(torch.randint(0, 256, r.shape, generator=g, dtype=torch.uint8))


def every_16_bit_pattern(dtype: torch.dtype, heads: int, d: int = 128) -> torch.Tensor:
    """All 65,536 bit patterns of a 16-bit dtype (NaNs, infinities, subnormals and both
    zeros included) as rows ``[65536 / (heads * d), heads, d]``."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    return bits.view(dtype).view(-1, heads, d)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def any_scale_quant(cache_dtype: str, k_scale: torch.Tensor, v_scale: torch.Tensor) -> Any:
    """A ``KVQuant`` holding scales of any value (zero, negative, subnormal, huge).

    ``KVQuant`` refuses such values in CPU tensors and does not read device tensors back
    to check them, so a kernel can meet them on a device. A test that holds the kernel to
    the torch reference for them builds the reference's ``KVQuant`` this way: the dtype and
    shape checks still run (on ones), then the scales are put in place.
    """
    from vllm.attention import KVQuant

    quant = KVQuant(cache_dtype, torch.ones_like(k_scale), torch.ones_like(v_scale))  # type: ignore[arg-type]
    object.__setattr__(quant, "k_scale", k_scale.reshape(-1))
    object.__setattr__(quant, "v_scale", v_scale.reshape(-1))
    return quant
