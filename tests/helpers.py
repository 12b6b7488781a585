"""Small helpers shared by tests (not a conftest: imported explicitly)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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
