"""The ForwardContext is the only carrier of slot_mapping: no registered backend's
metadata class (or its builder's product) has such a field or attribute."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest

from shim import LegacyBackendWarning
from vllm.attention import registry


def _names() -> list[str]:
    return registry.list_backends()


@pytest.mark.parametrize("name", _names())
def test_metadata_class_has_no_slot_mapping(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LegacyBackendWarning)
        backend = registry.get_backend(name)
    meta = backend.get_metadata_cls()
    for klass in inspect.getmro(meta):
        assert "slot_mapping" not in getattr(klass, "__annotations__", {}), klass
        assert "slot_mapping" not in vars(klass), klass
        assert "slot_mapping" not in (getattr(klass, "__slots__", ()) or ()), klass
    if dataclasses.is_dataclass(meta):
        assert "slot_mapping" not in {f.name for f in dataclasses.fields(meta)}
