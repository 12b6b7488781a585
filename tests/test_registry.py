"""Registry: lookup, selection with reasons, plugins, automatic adaptation."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from importlib import metadata

import pytest
import torch

from shim import LegacyBackendWarning
from vllm.attention import (
    BackendNotFoundError,
    NoBackendError,
    PluginLoadError,
    UnsupportedBackendError,
)
from vllm.attention import registry
from vllm.attention.errors import BackendRegistrationError
from vllm.attention.layer import Attention
from vllm.attention.backends.torch_ref import TorchRefBackend


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    registry._reset_for_tests()
    yield
    registry._reset_for_tests()


def _fake_entry_points(monkeypatch: pytest.MonkeyPatch, *eps: tuple[str, str]) -> None:
    fakes = [metadata.EntryPoint(n, v, registry.ENTRY_POINT_GROUP) for n, v in eps]

    def entry_points(*, group: str) -> list[metadata.EntryPoint]:
        return fakes if group == registry.ENTRY_POINT_GROUP else []

    monkeypatch.setattr(registry.importlib_metadata, "entry_points", entry_points)


def test_get_and_list(clean_registry: None) -> None:
    assert "TORCH_REF" in registry.list_backends()
    assert registry.get_backend("TORCH_REF") is TorchRefBackend
    with pytest.raises(BackendNotFoundError, match="'NOPE'.*TORCH_REF"):
        registry.get_backend("NOPE")
    assert registry.get_backend(
        "vllm.attention.backends.torch_ref:TorchRefBackend") is TorchRefBackend


def test_module_class_that_fails_to_import(clean_registry: None) -> None:
    with pytest.raises(PluginLoadError, match="no_such_module.*ModuleNotFoundError"):
        registry.get_backend("no_such_module:Backend")


def test_select_names_preferred_backend_and_its_reasons(clean_registry: None) -> None:
    with pytest.raises(UnsupportedBackendError, match="TORCH_REF.*use_mla=True"):
        registry.select_backend(dtype=torch.float32, head_size=64, block_size=16,
                                use_mla=True, preferred="TORCH_REF")
    assert registry.select_backend(dtype=torch.float32, head_size=64, block_size=16,
                                   preferred="TORCH_REF") is TorchRefBackend


def test_select_lists_every_candidate_when_none_fits(clean_registry: None) -> None:
    with pytest.raises(NoBackendError) as info:
        registry.select_backend(dtype=torch.float64, head_size=7, block_size=3)
    text = str(info.value)
    for name in registry.list_backends():
        if name != "TORCH_REF":
            assert f"  {name}:" in text
    assert "dtype=float64" in text or len(registry.list_backends()) == 1


@pytest.mark.usefixtures("fresh_legacy_warnings")
def test_plugins_from_entry_points_and_broken_plugin(clean_registry: None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_entry_points(
        monkeypatch,
        ("EXAMPLE_LEGACY_FLAGGED", "tests.legacy_backends.flagged:FlaggedLegacyBackend"),
        ("BROKEN_PLUGIN", "tests.no_such_plugin_module:Backend"),
    )
    assert {"EXAMPLE_LEGACY_FLAGGED", "BROKEN_PLUGIN"} <= set(registry.list_backends())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # loading an entry point is silent: listing never warns
        adapted = registry.get_backend("EXAMPLE_LEGACY_FLAGGED")
        registry.list_entries()
    assert adapted.migration == "adapted" and adapted.name == "EXAMPLE_LEGACY_FLAGGED"
    # the first use warns, once, pointing at the backend's own definition
    with pytest.warns(LegacyBackendWarning) as record:
        Attention(num_heads=2, head_size=8, scale=1.0, backend=adapted, layer_name="p0")
        Attention(num_heads=2, head_size=8, scale=1.0, backend=adapted, layer_name="p1")
    assert len(record) == 1
    assert record[0].filename.endswith("legacy_backends/flagged.py")
    with pytest.raises(PluginLoadError, match="BROKEN_PLUGIN.*tests.no_such_plugin_module"):
        registry.get_backend("BROKEN_PLUGIN")
    rows = {e.name: e for e in registry.list_entries()}
    assert rows["BROKEN_PLUGIN"].cls is None and rows["BROKEN_PLUGIN"].error
    # the registry keeps working after a broken plugin
    assert registry.get_backend("TORCH_REF") is TorchRefBackend


def test_register_adapts_legacy_and_rejects_duplicates(clean_registry: None) -> None:
    from tests.legacy_backends.fused import FusedLegacyBackend

    class _FusedTwin(FusedLegacyBackend):
        pass

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LegacyBackendWarning)
        adapted = registry.register_backend(FusedLegacyBackend)
    assert registry.get_backend("EXAMPLE_LEGACY_FUSED") is adapted
    with pytest.raises(BackendRegistrationError, match=r"already registered.*name='MY_"):
        registry.register_backend(_FusedTwin)
    renamed = registry.register_backend(_FusedTwin, name="EXAMPLE_LEGACY_TWIN")
    assert renamed.name == "EXAMPLE_LEGACY_TWIN" and registry.get_backend("EXAMPLE_LEGACY_TWIN")
    class Twin(TorchRefBackend):
        pass

    with pytest.raises(BackendRegistrationError, match="already registered"):
        registry.register_backend(Twin)
    with pytest.raises(BackendRegistrationError, match="expected an AttentionBackend"):
        registry.register_backend(int)


def test_backends_are_never_instantiated() -> None:
    with pytest.raises(TypeError, match="never instantiated"):
        TorchRefBackend()
