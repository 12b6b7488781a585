"""``read_slots`` returns exactly what the oracle says is stored; ``dequantize`` gives
the input back (exactly for ``auto``, within the format's rounding otherwise);
``reference_write`` writes what the writers write."""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.writers.oracle import (
    BITS,
    HEAD_SIZE,
    IN_DTYPES,
    MLA_L,
    Case,
    L,
    all_cases,
    expected_rows,
    prepare,
    write,
)
from vllm.attention import InvalidArgumentError
from vllm.attention.writers import reference_write
from vllm.attention.writers.readback import (
    FP8DsMLARows,
    KVRows,
    MLARows,
    PerTokenHeadRows,
    dequantize,
    read_slots,
)

CASES = [c for c in all_cases() if c.block_size in (16, 32) and c.in_dtype != "fp16"
         and c.cache_dtype != "fp8" and (c.scale != "scale_tensor" or c.mla or c.hybrid)]


def _read(case: Case, cache: torch.Tensor, slots: torch.Tensor, **kw: object) -> object:
    extra: dict[str, object] = {}
    if case.layout is L.LEGACY_PAGED:
        extra = {"num_kv_heads": 2, "head_size": HEAD_SIZE}
    if case.layout is L.DIFFKV_PACKED:
        extra = {"head_size": HEAD_SIZE}
    if case.layout is L.MLA_LATENT:
        extra = {"kv_lora_rank": MLA_L}
    if case.layout is L.MLA_FP8_DS:
        extra = {"model_dtype": IN_DTYPES[case.in_dtype]}
    return read_slots(case.layout, cache, slots, **extra, **kw)  # type: ignore[call-overload]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITS[t.element_size()])


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_read_slots_is_what_was_stored(case: Case) -> None:
    w = prepare(case, "cpu", seed=zlib.crc32(case.id.encode()))
    write(w, "torch")
    kept = w.slots[w.slots >= 0]
    got = _read(case, w.cache, kept, quant=w.quant)
    want = [e[2] for e in expected_rows(w)]
    if isinstance(got, (KVRows, MLARows)):
        parts = list(got)
    elif isinstance(got, PerTokenHeadRows):
        # stored row = values then the float32 scale's bytes
        parts = [torch.cat([_bits(got.key).view(torch.uint8),
                            got.key_scale.contiguous().view(torch.uint8).view(-1, 2, 4)], -1),
                 torch.cat([_bits(got.value).view(torch.uint8),
                            got.value_scale.contiguous().view(torch.uint8).view(-1, 2, 4)], -1)]
    else:
        assert isinstance(got, FP8DsMLARows)
        parts = [torch.cat([got.latent.view(torch.uint8),
                            got.scales.contiguous().view(torch.uint8),
                            got.rope.contiguous().view(torch.uint8)], -1).unsqueeze(1)]
    assert len(parts) == len(want)
    for g, e in zip(parts, want):
        g = _bits(g).reshape(e.shape)
        assert torch.equal(g.view(torch.uint8), e.contiguous().view(torch.uint8)), case.id


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_dequantize_recovers_the_input(case: Case) -> None:
    w = prepare(case, "cpu", seed=zlib.crc32(case.id.encode()))
    write(w, "torch")
    keep = w.slots >= 0
    n = w.slots.shape[0]
    first, second = _read(case, w.cache, w.slots[keep], quant=w.quant,
                          dequantize=True)  # type: ignore[misc]
    a = w.key[:n][keep].float()
    b = w.value[:n][keep].float().reshape(second.shape)
    if case.cache_dtype == "auto":
        assert torch.equal(first, a) and torch.equal(second, b)
        return
    # within half an fp8 step (of the scaled value) plus saturation
    if case.layout is L.MLA_FP8_DS:
        assert torch.equal(second, b.to(torch.bfloat16 if case.in_dtype != "fp16"
                                         else torch.float16).float())
        pairs = [(first, a)]
    else:
        pairs = [(first, a), (second, b)]
    for got, x in pairs:
        rel = 2.0 ** -3 if "e5m2" in case.cache_dtype else 2.0 ** -4
        if case.cache_dtype == "int8_per_token_head":
            rel = 1 / 127
        sat = x.abs() > 400 * 0.25  # may have saturated at the smallest test scale
        err = (got - x).abs()
        if "per_token" in case.cache_dtype:
            tol = rel * x.abs().amax(-1, keepdim=True)
        elif case.layout is L.MLA_FP8_DS:  # plus E4M3's subnormal step at the tile's scale
            tile_amax = x.view(-1, 4, 128).abs().amax(-1, keepdim=True)
            tol = (rel * x.view(-1, 4, 128).abs() + tile_amax / 448 * 2.0 ** -9).view(x.shape)
        else:
            tol = rel * x.abs() + 1e-2
        assert bool((err <= tol)[~sat].all()), case.id


def test_read_slots_checks_its_slots() -> None:
    cache = torch.zeros(2, 2, 16, 2, 8)
    with pytest.raises(InvalidArgumentError, match="slots"):
        read_slots(L.SPLIT_NHD, cache, torch.tensor([0, 32]))
    with pytest.raises(InvalidArgumentError, match="slots"):
        read_slots(L.SPLIT_NHD, cache, torch.tensor([-1]))
    with pytest.raises(InvalidArgumentError, match="num_kv_heads"):
        read_slots(L.LEGACY_PAGED, torch.zeros(2, 2, 16 * 2 * 8), torch.tensor([0]))
    with pytest.raises(InvalidArgumentError, match="quant"):
        read_slots(L.PER_TOKEN_HEAD_QUANT, torch.zeros(2, 2, 16, 2, 12, dtype=torch.uint8),
                   torch.tensor([0]))


def test_dequantize_fp8_needs_the_scales() -> None:
    rows = KVRows(torch.zeros(1, 2, 8, dtype=torch.float8_e4m3fn),
                  torch.zeros(1, 2, 8, dtype=torch.float8_e4m3fn))
    with pytest.raises(InvalidArgumentError, match="quant"):
        dequantize(rows)


@pytest.mark.parametrize("case", [c for c in CASES if c.block_size == 16 and not c.hybrid],
                         ids=lambda c: c.id)
def test_reference_write_is_the_torch_writer(case: Case) -> None:
    w = prepare(case, "cpu", seed=1)
    other = w.storage.clone()
    write(w, "torch")
    reference_write(case.layout, w.key, w.value, other.as_strided(w.cache.shape, w.cache.stride()),
                    w.slots, w.quant)
    assert torch.equal(w.storage.view(torch.uint8), other.view(torch.uint8))
