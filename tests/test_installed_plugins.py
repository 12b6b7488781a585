"""An installed legacy plugin never breaks a test run, and warns once where it is
defined, not at the console script's line.

The plugin is "installed" the way an installer leaves it: a ``*.dist-info`` folder with
an ``entry_points.txt`` on ``sys.path`` (``importlib.metadata`` finds it there), here the
example legacy distribution of ``examples/out_of_tree_backend/legacy``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "examples" / "out_of_tree_backend" / "legacy"


@pytest.fixture
def plugin_env(tmp_path: Path) -> dict[str, str]:
    dist = tmp_path / "oot_attn_legacy-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: oot-attn-legacy\n"
                                   "Version: 0.1.0\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.attention_backends]\nOOT_LEGACY = oot_attn_legacy.backend:LegacyBackend\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(PLUGIN), str(ROOT),
                                         env.get("PYTHONPATH", "")])
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_plugin_is_seen(plugin_env: dict[str, str]) -> None:
    code = ("from vllm.attention import registry; "
            "assert 'OOT_LEGACY' in registry.list_backends(), registry.list_backends()")
    proc = _run(["-W", "error", "-c", code], plugin_env)
    assert proc.returncode == 0, proc.stderr


def test_collection_and_registry_tests_pass_with_a_legacy_plugin_installed(
        plugin_env: dict[str, str]) -> None:
    collect = _run(["-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                    "tests"], plugin_env)
    assert collect.returncode == 0, collect.stdout[-3000:] + collect.stderr[-3000:]
    assert "error" not in collect.stdout.splitlines()[-1], collect.stdout[-2000:]
    run = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_no_slot_mapping.py",
                "tests/test_readme_table.py", "tests/test_registry.py"], plugin_env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def test_check_warns_once_at_the_backend_definition(plugin_env: dict[str, str]) -> None:
    proc = _run(["-m", "vllm.cli", "check", "OOT_LEGACY"], plugin_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "LegacyBackendWarning" in ln]
    assert len(lines) == 1, proc.stderr
    assert str(PLUGIN / "oot_attn_legacy" / "backend.py") in lines[0], lines[0]
    assert "sys.exit" not in proc.stderr
