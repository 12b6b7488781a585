"""Typed contracts: pass/ type-checks clean; each fail/ file reports exactly the
errors its ``# E: <code>`` comments mark, under the project's mypy config."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

api = pytest.importorskip("mypy.api", reason="mypy is not installed (pip install -e .[dev])")

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
MARK = re.compile(r"#\s*E:\s*([a-z-]+)")
ERROR = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+): error: .*\[(?P<code>[a-z-]+)\]$")


def _mypy(paths: list[Path]) -> tuple[str, int]:
    out, err, status = api.run([
        "--config-file", str(ROOT / "pyproject.toml"),
        "--cache-dir", str(ROOT / ".mypy_cache"),
        "--no-error-summary", "--show-error-codes", "--hide-error-context",
        *[str(p) for p in paths],
    ])
    return out + err, status


def _expected(path: Path) -> set[tuple[int, str]]:
    found = set()
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        for m in MARK.finditer(line):
            found.add((i, m.group(1)))
    return found


def test_pass_files_type_check_clean() -> None:
    out, status = _mypy(sorted((HERE / "pass").glob("*.py")))
    assert status == 0, out


FAIL_FILES = sorted((HERE / "fail").glob("*.py"))


@pytest.mark.parametrize("path", FAIL_FILES, ids=lambda p: p.stem)
def test_fail_files_report_exactly_the_marked_errors(path: Path) -> None:
    expected = _expected(path)
    assert expected, f"{path.name} marks no expected error"
    out, _ = _mypy([path])
    got = set()
    for line in out.splitlines():
        m = ERROR.match(line.strip())
        if m and Path(m.group("path")).name == path.name:
            got.add((int(m.group("line")), m.group("code")))
    assert got == expected, f"missing: {sorted(expected - got)}, unexpected: {sorted(got - expected)}\n{out}"
