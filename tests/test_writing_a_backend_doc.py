"""docs/writing_a_backend.md tables every declaration of AttentionBackend and every
field of CommonAttentionMetadata and AttentionLayerSpec, with type and default; these
tests read the tables back and compare them with the classes, so they cannot go stale."""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from vllm.attention import AttentionBackend, AttentionLayerSpec, CommonAttentionMetadata
from vllm.attention.backend import DECLARATIONS, SizeSpec, dtype_name

DOC = Path(__file__).resolve().parent.parent / "docs" / "writing_a_backend.md"
CELL = re.compile(r"(?<!\\)\|")


def table(first_column: str, first_row: str) -> dict[str, tuple[str, str]]:
    """``name -> (type, default)`` of the doc's table whose header starts with
    ``first_column`` and whose first row names ``first_row``, in the doc's order."""
    lines = DOC.read_text().splitlines()
    for i, line in enumerate(lines):
        if (line.startswith(f"| {first_column} | type | default |")
                and lines[i + 2].startswith(f"| `{first_row}` |")):
            rows: dict[str, tuple[str, str]] = {}
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                name, type_, default = (c.strip().replace("\\|", "|")
                                        for c in CELL.split(row)[1:4])
                rows[name.strip("`")] = (type_, default)
            return rows
    raise AssertionError(f"no table starting with {first_column!r} / {first_row!r} in {DOC}")


def _item(value: object) -> str:
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    return repr(value)


def rendered(value: object) -> str:
    """A default as the tables write it."""
    if value is dataclasses.MISSING:
        return "required"
    if isinstance(value, SizeSpec):
        return value.describe()
    if isinstance(value, Mapping):
        items = sorted((dtype_name(k), v) for k, v in value.items())
        return "`{" + ", ".join(f"{k}: {v:.0e}" for k, v in items) + "}`"
    if isinstance(value, frozenset):
        return "`{" + ", ".join(sorted(_item(v) for v in value)) + "}`"
    return f"`{_item(value)}`"


def test_every_declaration_is_tabled_with_its_type_and_default() -> None:
    annotations = {name: a for name, a in AttentionBackend.__annotations__.items()
                   if a.startswith("ClassVar[")}
    assert tuple(annotations) == DECLARATIONS  # each one is also checked at class creation
    rows = table("declaration", "name")
    assert list(rows) == list(annotations)
    for name, annotation in annotations.items():
        type_, default = rows[name]
        assert type_ == f"`{annotation.removeprefix('ClassVar[')[:-1]}`", name
        assert default == rendered(getattr(AttentionBackend, name, dataclasses.MISSING)), name


@pytest.mark.parametrize(("cls", "first"), [(CommonAttentionMetadata, "query_start_loc"),
                                            (AttentionLayerSpec, "num_heads")],
                         ids=lambda x: getattr(x, "__name__", x))
def test_every_field_is_tabled_with_its_type_and_default(cls: type, first: str) -> None:
    fields = dataclasses.fields(cls)
    rows = table("field", first)
    assert list(rows) == [f.name for f in fields]
    for f in fields:
        type_, default = rows[f.name]
        assert type_ == f"`{f.type}`", f.name
        assert default == rendered(f.default), f.name


def test_the_page_explains_what_a_reader_calls() -> None:
    text = DOC.read_text()
    for needle in ("missing_declarations()", "declaration_problems()",
                   "PagedAttentionMetadata.from_common(common)", "common_fields(common)",
                   "__init_subclass__"):
        assert needle in text, needle
