"""The property oracle catches broken writers: each mutant below is a classic cache
write bug, applied around the real writer (the oracle still expects the intended
write); the oracle must reject every one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from tests.property.model import (
    FAMILIES,
    Built,
    RandomChooser,
    WriteCase,
    build,
    check,
    draw_case,
    write,
)
from vllm.attention import KVQuant


def _neighbour(b: Built) -> None:
    """Off by one slot: every kept token lands in the next slot."""
    s = b.slots.clone()
    keep = s >= 0
    s[keep] = (s[keep] + 1) % b.case.num_slots
    write(dataclasses.replace(b, slots=s), "torch")


def _padding_written(b: Built) -> None:
    """Padding not skipped: slot -1 taken as Python's "last" index."""
    s = b.slots.clone()
    s[s < 0] = b.case.num_slots - 1
    write(dataclasses.replace(b, slots=s), "torch")


def _past_cache_wrapped(b: Built) -> None:
    """Slots past the cache not skipped: wrapped around into the cache (what an
    unmasked kernel does with a wrapping offset)."""
    s = b.slots.clone()
    past = s >= b.case.num_slots
    s[past] = s[past] % b.case.num_slots
    write(dataclasses.replace(b, slots=s), "torch")


def _reads_past_num_tokens(b: Built) -> None:
    """``num_tokens`` taken from ``key.shape[0]``: the padded rows get written too."""
    n, rows = b.case.num_tokens, b.key.shape[0]
    used = set(b.slots[b.slots >= 0].tolist())
    free = [s for s in range(b.case.num_slots) if s not in used][: rows - n]
    s = torch.cat([b.slots, torch.tensor(free, dtype=torch.int64)])
    write(dataclasses.replace(b, slots=s), "torch")


def _ignores_strides(b: Built) -> None:
    """Writes a dense copy of the cache, then copies its bytes over the storage as
    if the cache were dense at offset 0."""
    dense = b.cache.clone(memory_format=torch.contiguous_format)
    writer_b = dataclasses.replace(b, cache=dense)
    write(writer_b, "torch")
    flat = dense.reshape(-1)
    b.storage[: flat.numel()] = flat


def _unscaled(b: Built) -> None:
    """fp8 without the scale."""
    ones = torch.ones_like(b.quant.k_scale)
    quant = KVQuant(b.quant.kv_cache_dtype, ones, torch.ones_like(b.quant.v_scale))
    write(dataclasses.replace(b, quant=quant), "torch")


def _stray_byte(b: Built) -> None:
    """A correct write plus one byte changed outside the written slots."""
    write(b, "torch")
    raw = b.storage.view(torch.uint8)
    raw[0] ^= 0x01  # storage_offset > 0: byte 0 lies before the cache view


def _cases(pred: Callable[[WriteCase], bool]) -> WriteCase:
    for seed in range(10_000):
        case = draw_case(RandomChooser(seed), FAMILIES[seed % len(FAMILIES)], max_tokens=64)
        if pred(case):
            return case
    raise AssertionError("no case satisfies the mutant's precondition")


def _kept(case: WriteCase) -> bool:
    return (case.num_tokens > 0 and case.neg_percent < 100 and case.duplicates == 0
            and case.past_percent == 0)


MUTANTS: list[tuple[str, Callable[[Built], None], Callable[[WriteCase], bool]]] = [
    ("neighbour", _neighbour, lambda c: _kept(c) and c.num_slots > c.num_tokens),
    ("padding_written", _padding_written, lambda c: c.num_tokens > 0 and c.neg_percent == 50),
    ("past_cache_wrapped", _past_cache_wrapped,
     lambda c: c.num_tokens > 0 and c.past_percent == 50 and c.neg_percent == 0),
    ("reads_past_num_tokens", _reads_past_num_tokens,
     lambda c: _kept(c) and c.extra_rows > 0 and c.num_slots >= c.num_tokens + c.extra_rows),
    ("ignores_strides", _ignores_strides,
     lambda c: _kept(c) and (c.storage_offset > 0 or any(c.pads))),
    ("unscaled", _unscaled, lambda c: _kept(c) and c.scale_kind.startswith(("tiny", "huge"))),
    ("stray_byte", _stray_byte, lambda c: c.storage_offset > 0),
]


@pytest.mark.parametrize("mutant, pred", [(f, p) for _, f, p in MUTANTS],
                         ids=[name for name, _, _ in MUTANTS])
def test_oracle_rejects_mutant(mutant: Callable[[Built], None],
                               pred: Callable[[WriteCase], bool]) -> None:
    caught = 0
    for seed_shift in range(5):
        case = _cases(lambda c: pred(c) and c.seed % 5 == seed_shift)
        b = build(case)
        mutant(b)
        with pytest.raises(AssertionError):
            check(b)
        caught += 1
    assert caught == 5
