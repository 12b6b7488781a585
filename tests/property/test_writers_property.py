"""Property tests of every writer family on CPU (the torch reference path).

Each example is one random write (``tests/property/model.py``): layout and its
physical stride order, paddings and storage offset, input and cache dtypes,
block size, heads and head sizes, 0 to 4096 tokens, padded / strided / duplicated
slot mappings, inputs sliced from fused projections or broadcast, a cache of
random bytes. The oracle checks every byte of the storage. Examples per family:
the ``ci`` profile (``tests/property/conftest.py``) times the weights below.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.property.conftest import profile_settings
from tests.property.model import (
    CASES_RUN,
    FAMILIES,
    HypothesisChooser,
    RandomChooser,
    WriteCase,
    build,
    check,
    draw_case,
    percent,
    run_case,
    write,
)
from vllm.attention import KVCacheWriteError
from vllm.attention.writers.validation import check_slots_in_range

WEIGHTS: dict[str, float] = {
    "split": 2.0,
    "legacy_paged": 1.0,
    "aiter": 1.0,
    "diffkv": 1.0,
    "per_token_head": 1.0,
    "mla_latent": 1.0,
    "fp8_ds_mla": 0.5,
}
"""Units of the profile's ``max_examples`` per family (split covers four layouts)."""


@st.composite
def write_cases(draw: Callable[[Any], Any], family: str) -> WriteCase:
    return draw_case(HypothesisChooser(draw), family)


def _family_test(family: str) -> Callable[..., None]:
    @profile_settings(WEIGHTS[family])
    @given(case=write_cases(family))
    def test(case: WriteCase) -> None:
        run_case(case, "cpu", "torch")

    test.__name__ = f"test_{family}_writer_never_loses_a_byte"
    test.__doc__ = f"Every byte of a random {family} write is the expected one."
    return test


test_split_writer_never_loses_a_byte = _family_test("split")
test_legacy_paged_writer_never_loses_a_byte = _family_test("legacy_paged")
test_aiter_writer_never_loses_a_byte = _family_test("aiter")
test_diffkv_writer_never_loses_a_byte = _family_test("diffkv")
test_per_token_head_writer_never_loses_a_byte = _family_test("per_token_head")
test_mla_latent_writer_never_loses_a_byte = _family_test("mla_latent")
test_fp8_ds_mla_writer_never_loses_a_byte = _family_test("fp8_ds_mla")


def test_every_family_has_a_property_test() -> None:
    assert set(WEIGHTS) == set(FAMILIES)
    names = {f"test_{f}_writer_never_loses_a_byte" for f in FAMILIES}
    assert names <= set(globals())


@st.composite
def checked_cases(draw: Callable[[Any], Any]) -> tuple[WriteCase, int]:
    """A write case and how many of its slots to push past the cache (0 = none)."""
    c = HypothesisChooser(draw)
    case = draw_case(c, c.choice(FAMILIES), max_tokens=512)
    out_of_range = c.integer(1, 3) if case.num_tokens and percent(c, 30) else 0
    return case, out_of_range


@profile_settings(0.5)
@given(checked_cases())
def test_checked_mode_rejects_exactly_the_bad_mappings(drawn: tuple[WriteCase, int]) -> None:
    """Checked mode (the layer's validate-then-write, ``check_slots_in_range``) never
    rejects a valid mapping, always rejects duplicates and slots past the cache, and
    a rejected write leaves the storage byte-identical."""
    case, out_of_range = drawn
    b = build(case)
    slots = b.slots
    if out_of_range:
        gen = torch.Generator().manual_seed(case.seed ^ 0x5EED)
        at = torch.randint(0, case.num_tokens, (out_of_range,), generator=gen)
        slots = slots.clone()
        slots[at] = case.num_slots + torch.randint(0, 1 << 20, (out_of_range,), generator=gen)
    kept = slots[slots >= 0]
    should_reject = bool((kept >= case.num_slots).any()) or kept.unique().numel() != kept.numel()
    if should_reject:
        with pytest.raises(KVCacheWriteError, match=r"slot_mapping: got .*(duplicate|slot\(s\) up to)"):
            check_slots_in_range(slots, case.num_slots)
        assert torch.equal(b.storage.view(torch.uint8), b.before.view(torch.uint8))
        CASES_RUN[f"checked-reject/{case.family}"] += 1
        return
    check_slots_in_range(slots, case.num_slots)
    write(b, "torch")
    check(b)
    CASES_RUN[f"checked-accept/{case.family}"] += 1


@pytest.mark.parametrize("family", FAMILIES)
def test_empty_and_all_padding_writes_change_nothing(family: str) -> None:
    """``num_tokens = 0`` and an all-negative mapping (a CUDA-graph filler step) are
    no-ops, on every family (a regression: the legacy paged and AITER references
    used to fail to reshape zero kept rows)."""
    for seed in range(40):
        case = draw_case(RandomChooser(seed), family, max_tokens=64)
        for neg, n in ((100, case.num_tokens), (0, 0)):
            run_case(dataclasses.replace(case, neg_percent=neg, num_tokens=n, duplicates=0),
                     "cpu", "torch")


@pytest.mark.parametrize("family", FAMILIES)
def test_duplicate_slots_unchecked_touch_no_other_slot(family: str) -> None:
    """Unchecked duplicates (``docs/errors.md``): the duplicated slot holds, element by
    element, one of its tokens' values; every other slot and byte is exact."""
    for seed in range(25):
        case = draw_case(RandomChooser(1000 + seed), family, max_tokens=64)
        n = max(case.num_tokens, 4)
        num_blocks = max(case.num_blocks, -(-n // case.block_size))
        run_case(dataclasses.replace(case, num_tokens=n, num_blocks=num_blocks,
                                     duplicates=1 + seed % 2, neg_percent=0), "cpu", "torch")
