"""The same properties for the Triton kernels, run on CPU under Triton's interpreter
(``path="triton"`` on CPU tensors): a few dozen small random writes, every family.

The interpreter runs one program at a time in numpy, so cases are tiny (``small``
sizes: at most 6 tokens, 3 heads, head size 24). Skipped, with the reason, where
Triton is not installed; the compiled kernels get the seeded GPU sweep
(``test_gpu_sweep.py``).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.property.conftest import profile_settings
from tests.property.model import (
    FAMILIES,
    HypothesisChooser,
    RandomChooser,
    draw_case,
    run_case,
)

pytest.importorskip("triton", reason="triton is not installed: the Triton writer kernels "
                                     "cannot run (not even interpreted) here")

PER_FAMILY = 6
"""Examples per family in the ``ci`` profile (1,300 per unit): 42 interpreted writes."""

# numpy, under the interpreter, warns where IEEE arithmetic makes NaN / inf on purpose
# (saturation, NaN inputs, the NaN / inf rows past num_tokens).
pytestmark = [pytest.mark.filterwarnings(f"ignore:{msg}:RuntimeWarning")
              for msg in ("invalid value encountered", "overflow encountered",
                          "divide by zero")]


@pytest.mark.parametrize("family", FAMILIES)
@profile_settings(PER_FAMILY / 1300)
@given(data=st.data())
def test_triton_kernels_interpreted_never_lose_a_byte(family: str, data: st.DataObject) -> None:
    run_case(draw_case(HypothesisChooser(data.draw), family, small=True), "cpu", "triton")


@pytest.mark.parametrize("family", FAMILIES)
def test_slots_past_the_cache_are_skipped_interpreted(family: str) -> None:
    """Unchecked mode: half the tokens name a slot past the cache (``num_slots`` up to
    ``2**62``); the kernels store nothing for them and every other byte is exact (an
    unmasked kernel writes out of bounds, or wraps into another slot)."""
    for seed in range(4):
        case = draw_case(RandomChooser(7000 + seed), family, small=True)
        case = dataclasses.replace(case, num_tokens=max(case.num_tokens, 4),
                                   num_blocks=max(case.num_blocks, 4 // case.block_size + 1),
                                   past_percent=50, neg_percent=0)
        run_case(case, "cpu", "triton")
        run_case(case, "cpu", "torch")
