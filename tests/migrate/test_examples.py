"""This package's legacy examples migrate with nothing left to do, and the migration is
proven: ``--check`` finds no difference, the metadata has no ``slot_mapping``, and the
migrated modules pass ``mypy --strict``."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from shim.adapter import adapt_quietly
from tests.migrate.support import EXAMPLES, guide_example, load, mypy_strict, original
from vllm.attention import AttentionBackend, AttentionMetadata
from vllm.migrate.check import compare
from vllm.migrate.report import MigrationResult
from vllm.migrate.rewrite import migrate
from vllm.migrate.source import Target

CASES = [*EXAMPLES, "guide"]
Migrated = dict[str, tuple[Path, MigrationResult]]


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> Migrated:
    paths = dict(EXAMPLES)
    paths["guide"] = guide_example(tmp_path_factory.mktemp("guide"))
    return {name: (path, migrate(Target(path, None))) for name, path in paths.items()}


@pytest.mark.parametrize("name", CASES)
def test_nothing_left_to_do(migrated: Migrated, name: str) -> None:
    _, result = migrated[name]
    assert result.manual_steps == [] and result.exit_code == 0
    assert "# MIGRATE:" not in result.code


@pytest.mark.parametrize("name", CASES)
def test_new_style_without_slot_mapping(migrated: Migrated, name: str) -> None:
    path, result = migrated[name]
    backend = getattr(load(path, result.code), result.class_name)
    assert issubclass(backend, AttentionBackend) and backend.migration == "migrated"
    assert backend.declaration_problems() == []
    meta = backend.get_metadata_cls()
    assert issubclass(meta, AttentionMetadata)
    assert "slot_mapping" not in {f.name for f in dataclasses.fields(meta)}
    impl, builder = backend.get_impl_cls(), backend.get_builder_cls()
    for cls in (impl, builder, meta):
        assert "slot_mapping" not in inspect.getsource(cls), cls
    assert not hasattr(impl, "do_kv_cache_update")
    assert not hasattr(backend, "forward_includes_kv_cache_update")


@pytest.mark.parametrize("name", CASES)
def test_check_finds_no_difference(migrated: Migrated, name: str) -> None:
    path, result = migrated[name]
    outcome = compare(adapt_quietly(original(path, result.class_name)),
                      getattr(load(path, result.code), result.class_name))
    assert outcome.ok, outcome.differences
    assert outcome.compared and all(report.ok for report in outcome.reports)


def test_check_reports_a_wrong_migration(migrated: Migrated) -> None:
    """The comparison fails a migration whose writer or compute differs: another layout
    (cache bytes and capabilities) and a scale off by 1% (outputs)."""
    path, result = migrated["fused"]
    adapted = adapt_quietly(original(path, result.class_name))
    layout = result.code.replace("KVCacheLayout.SPLIT_NHD", "KVCacheLayout.SPLIT_HND")
    wrong = compare(adapted, getattr(load(path, layout), result.class_name))
    assert "kv_cache_layout: original SPLIT_NHD, migrated SPLIT_HND" in wrong.differences
    assert any("the cache after the step differs" in d for d in wrong.differences)
    scale = result.code.replace("scale=self.scale,", "scale=self.scale * 1.01,")
    assert scale != result.code
    off = compare(adapted, getattr(load(path, scale), result.class_name))
    assert any("outputs differ by" in d for d in off.differences), off.differences


def test_mypy_strict(migrated: Migrated, tmp_path: Path) -> None:
    """The migrated legacy examples type-check with the project's configuration (the
    guide's example is left out: its kernel is untyped, before and after)."""
    files = []
    for name in EXAMPLES:
        _, result = migrated[name]
        files.append(tmp_path / f"{name}.py")
        files[-1].write_text(result.code, encoding="utf-8")
    done = mypy_strict(*files)
    assert done.returncode == 0, done.stdout + done.stderr
