"""Every layout's torch reference writer on CPU, checked by the independent oracle
(``tests/writers/oracle.py``): layout x input dtype x cache dtype x block size x
scale shape, plus views of a larger (hybrid) buffer."""

from __future__ import annotations

import zlib

import pytest

from tests.writers.oracle import Case, all_cases, check, prepare, write

CASES = all_cases()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_reference_writer(case: Case) -> None:
    w = prepare(case, "cpu", seed=zlib.crc32(case.id.encode()))
    write(w, "torch")
    check(w)
