"""The Triton kernels on CPU, under Triton's interpreter (``path="triton"`` on CPU
tensors), against the same oracle as the reference, and byte-for-byte against the
reference on values chosen to hit every rounding and saturation edge.

Skipped (with the reason) where Triton is not importable and where
CUDA is available (the GPU tests cover the compiled kernels on the same cases).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from tests.writers.oracle import KV_LAYOUTS, Case, L, check, edge_values, prepare, write
from vllm.attention import KVQuant
from vllm.attention.writers import (
    FP8DsMLACacheWriter,
    PerTokenHeadKVCacheWriter,
    SplitKVCacheWriter,
)

pytest.importorskip("triton", reason="triton is not installed: the kernels cannot run here")
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CUDA is available: the compiled kernels run in test_writers_gpu.py instead",
)

F = TypeVar("F", bound=Callable[..., object])


def numpy_ieee(fn: F) -> F:
    """The interpreter runs kernels in numpy, which warns where IEEE arithmetic makes
    a NaN or an infinity on purpose (the saturation and NaN inputs of these tests)."""
    for msg in ("invalid value encountered", "overflow encountered", "divide by zero"):
        fn = pytest.mark.filterwarnings(f"ignore:{msg}:RuntimeWarning")(fn)
    return fn


def _cases() -> list[Case]:
    out: list[Case] = []
    for layout in KV_LAYOUTS:
        out += [Case(layout, "bf16", "auto", 16, "scale_per_head"),
                Case(layout, "fp32", "fp8_e4m3", 16, "scale_per_head"),
                Case(layout, "fp16", "fp8_e5m2", 32, "scale_tensor"),
                Case(layout, "bf16", "fp8", 16, "scale_tensor", hybrid=True)]
    for dt in ("fp32", "fp16", "bf16"):
        for cd in ("int8_per_token_head", "fp8_per_token_head"):
            out.append(Case(L.PER_TOKEN_HEAD_QUANT, dt, cd, 16, "scale_none"))
        out.append(Case(L.MLA_FP8_DS, dt, "fp8_ds_mla", 64, "scale_none"))
    out += [Case(L.MLA_LATENT, "fp32", "auto", 16), Case(L.MLA_LATENT, "bf16", "fp8_e4m3", 16),
            Case(L.MLA_LATENT, "fp16", "fp8_e5m2", 32, hybrid=True),
            Case(L.PER_TOKEN_HEAD_QUANT, "bf16", "int8_per_token_head", 16, "scale_none",
                 hybrid=True)]
    return out


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_triton_kernel_interpreted(case: Case) -> None:
    # few tokens: the interpreter runs one program at a time
    w = prepare(case, "cpu", seed=zlib.crc32(case.id.encode()), num_tokens=5)
    write(w, "triton")
    check(w)


def _rows_of(x: torch.Tensor, d: int) -> torch.Tensor:
    """``x`` padded with ones to ``[rows, 1, d]``."""
    rows = -(-x.numel() // d)
    return torch.cat([x, torch.ones(rows * d - x.numel())]).view(rows, 1, d)


@numpy_ieee
@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_rounding_edges_match_reference(cache_dtype: str) -> None:
    d = 1024
    key = _rows_of(edge_values(), d)
    rows = key.shape[0]
    fp8 = torch.float8_e4m3fn if cache_dtype == "fp8_e4m3" else torch.float8_e5m2
    quant = KVQuant(cache_dtype, torch.ones(1), torch.ones(1))  # type: ignore[arg-type]
    slots = torch.arange(rows, dtype=torch.int64)
    writer = SplitKVCacheWriter(L.SPLIT_NHD)
    got = {}
    for path in ("torch", "triton"):
        cache = torch.zeros(rows, 2, 1, 1, d, dtype=fp8)
        writer.write(key, key, cache, slots, quant, path=path)  # type: ignore[arg-type]
        got[path] = cache.view(torch.uint8)[:, 0, 0]
    diff = (got["torch"] != got["triton"]).nonzero()
    assert diff.numel() == 0, [(key[int(i[0]), 0, int(i[1])].item(), int(got["torch"][tuple(i)]),
                                int(got["triton"][tuple(i)])) for i in diff[:5]]
    # the reference is torch's own saturating conversion, with NaN as the byte 0x7F
    m = torch.finfo(fp8).max
    want = key.clamp(-m, m).to(fp8).view(torch.uint8).clone()
    want[key.isnan()] = 0x7F
    assert torch.equal(got["torch"], want)


@numpy_ieee
@pytest.mark.parametrize("cache_dtype", ["int8_per_token_head", "fp8_per_token_head"])
def test_per_token_head_edges_match_reference(cache_dtype: str) -> None:
    h, d = 64, 16
    x = edge_values()
    x = x[: x.numel() // (h * d) * (h * d)].view(-1, h, d)
    special = torch.zeros(1, h, d)  # an all-zero row, a row with one NaN, one inf, halves
    special[0, 1, 3] = math.nan
    special[0, 1, 4] = 2.0
    special[0, 2, 0] = math.inf
    special[0, 3] = torch.arange(d) - 7.5
    special[0, 3, 0] = 127.0 * 0.5  # y values exactly halfway between integers
    key = torch.cat([x, special])
    rows = key.shape[0]
    slots = torch.arange(rows, dtype=torch.int64)
    quant = KVQuant(cache_dtype, torch.ones(1), torch.ones(1))  # type: ignore[arg-type]
    got = {}
    for path in ("torch", "triton"):
        cache = torch.zeros(rows, 2, 1, h, d + 4, dtype=torch.uint8)
        PerTokenHeadKVCacheWriter().write(key, key, cache, slots, quant,
                                          path=path)  # type: ignore[arg-type]
        got[path] = cache
    assert torch.equal(got["torch"], got["triton"])


@numpy_ieee
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_fp8_ds_mla_edges_match_reference(in_dtype: torch.dtype) -> None:
    x = edge_values()[:3072].view(-1, 512)
    x = torch.cat([x, torch.zeros(1, 512)])  # an all-zero entry: scales are FLT_MIN
    pe = edge_values()[: x.shape[0] * 64].view(-1, 64)
    rows = x.shape[0]
    slots = torch.arange(rows, dtype=torch.int64)
    quant = KVQuant("fp8_ds_mla", torch.ones(1), torch.ones(1))
    got = {}
    for path in ("torch", "triton"):
        cache = torch.zeros(rows, 1, 656, dtype=torch.uint8)
        FP8DsMLACacheWriter().write(x.to(in_dtype), pe.to(in_dtype), cache, slots, quant,
                                    path=path)  # type: ignore[arg-type]
        got[path] = cache
    assert torch.equal(got["torch"], got["triton"])
