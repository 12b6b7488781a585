"""Hypothesis profiles for the writer property tests, and a summary of the cases run.

Profiles (pick one with ``HYPOTHESIS_PROFILE``; ``ci`` is the default):

* ``ci``: derandomized (the same examples every run, no example database), no
  deadline, ``too_slow`` suppressed; 1,300 examples per unit of test weight:
  10,400 Hypothesis examples over the seven writer families (9,750 writes, 650
  checked-mode calls), plus 735 fixed-seed cases and 42 interpreted Triton
  writes, about 11,200 checked cases in all. ``pytest tests/property`` takes
  50-60 s on the 2-core CI machine (shared with other jobs; one torch thread).
* ``dev``: the same, a tenth of the examples (a quick local run).
* ``thorough``: randomized, ten times ``ci`` (a nightly or pre-release run).

The profiles are registered here and read by the tests through
:func:`tests.property.conftest.profile_settings`; none is loaded globally, so
Hypothesis tests elsewhere keep their own settings.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from tests.helpers import torch_threads
from tests.property.model import CASES_RUN

_COMMON = dict(deadline=None, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

settings.register_profile("ci", derandomize=True, max_examples=1300, **_COMMON)  # type: ignore[arg-type]
settings.register_profile("dev", derandomize=True, max_examples=130, **_COMMON)  # type: ignore[arg-type]
settings.register_profile("thorough", derandomize=False, max_examples=13000, **_COMMON)  # type: ignore[arg-type]

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")


def profile_settings(weight: float) -> settings:
    """The active profile with ``max_examples`` scaled by ``weight``."""
    base = settings.get_profile(PROFILE)
    return settings(base, max_examples=max(1, round(base.max_examples * weight)))


@pytest.fixture(autouse=True, scope="package")
def _single_threaded_torch() -> Iterator[None]:
    with torch_threads(1):
        yield


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not CASES_RUN:
        return
    total = sum(CASES_RUN.values())
    parts = ", ".join(f"{k}: {v}" for k, v in sorted(CASES_RUN.items()))
    terminalreporter.write_line(
        f"writer property cases checked: {total} (profile {PROFILE}; {parts})"
    )
