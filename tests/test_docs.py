"""Every ```python block in migration_guide.md and docs/*.md runs (each file's
blocks in order, in one namespace), so the documentation cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
DOCS = sorted([*(ROOT / "docs").glob("*.md"), *ROOT.glob("migration_guide.md")])


def code_blocks(path: Path) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(path.read_text())]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_python_blocks_run(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    blocks = code_blocks(path)
    untagged = [code[:60] for lang, code in blocks if lang == ""]
    assert not untagged, f"{path.name}: tag every code block (python, text, bash): {untagged}"
    namespace: dict[str, object] = {"__name__": f"doc_{path.stem}"}
    for lang, code in blocks:
        if lang == "python":
            exec(compile(code, f"{path.name}", "exec", dont_inherit=True), namespace)
