"""README's backend table is the registry's, and the same on every machine."""

from __future__ import annotations

import warnings

from pathlib import Path

import pytest
import torch

from vllm.attention import InvalidArgumentError, docs_table, registry

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def test_readme_table_is_current() -> None:
    text = README.read_text(encoding="utf-8")
    assert docs_table.replace_table(text, docs_table.render_table()) == text, (
        f"README.md's backend table is stale: regenerate it with `{docs_table.REGENERATE}`"
    )


def test_every_in_tree_backend_has_one_row() -> None:
    table = docs_table.render_table()
    names = [line.split("|")[1].strip() for line in table.splitlines()[2:]]
    assert names == [registry.get_backend(n).name for n in registry._IN_TREE]


def test_table_does_not_depend_on_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    here = docs_table.render_table()
    # As if on a ROCm or CUDA GPU machine: nothing in the table moves.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert docs_table.render_table() == here


@pytest.mark.usefixtures("fresh_legacy_warnings")
def test_plugins_and_registrations_do_not_enter_the_table() -> None:
    from shim import LegacyBackendWarning
    from tests.legacy_backends.fused import FusedLegacyBackend

    before = docs_table.render_table()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LegacyBackendWarning)  # registering is silent
        registry.register_backend(FusedLegacyBackend, replace=True)
    try:
        assert docs_table.render_table() == before
        row = docs_table.backend_row(registry.get_backend("EXAMPLE_LEGACY_FUSED"))
        assert row["status"] == "adapted" and row["CPU path"] == "legacy `forward()`"
    finally:
        registry.unregister_backend("EXAMPLE_LEGACY_FUSED")


def test_write_and_check(tmp_path: Path) -> None:
    doc = tmp_path / "README.md"
    doc.write_text(f"# x\n\n{docs_table.START}\nold\n{docs_table.END}\n\ntail\n")
    assert docs_table.main(["--check", str(doc)]) == 1
    assert docs_table.main(["--write", str(doc)]) == 0
    assert docs_table.main(["--check", str(doc)]) == 0
    text = doc.read_text()
    assert "old" not in text and text.endswith(f"{docs_table.END}\n\ntail\n")
    assert "| TORCH_REF | migrated | `split_nhd` |" in text


def test_missing_markers_are_an_error() -> None:
    with pytest.raises(InvalidArgumentError, match="backends:start"):
        docs_table.replace_table("# no markers\n", "| t |\n")
