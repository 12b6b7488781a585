"""A plugin author's mypy run: the example plugin, copied to a directory outside this
repository, type-checks against the *installed* package with the ``[tool.mypy]``
snippet of migration_guide.md as pasted; a contract violation added to it is
reported (so ``vllm``'s types were really read, not skipped)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "examples" / "out_of_tree_backend" / "migrated" / "oot_attn_migrated"
SNIPPET = re.compile(r"^```toml\n(\[tool\.mypy\]\n.*?)^```", re.S | re.M)

KERNELS = '''\
"""A Triton kernel as a plugin writes one (mypy needs no Triton to check it)."""

from collections.abc import Callable
from typing import Any

import triton
import triton.language as tl

jit: Callable[[Callable[..., Any]], Any] = triton.jit


@jit
def scale_kernel(x_ptr: Any, n: Any, BLOCK: tl.constexpr) -> None:
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)
'''

BROKEN = '''\
import torch

from vllm.attention import AttentionImpl
from vllm.attention.backend import AttentionLayerProtocol

from .backend import OOTMetadata


class ReadsSlots(AttentionImpl[OOTMetadata]):
    def forward(self, layer: AttentionLayerProtocol, query: torch.Tensor,
                key: torch.Tensor | None, value: torch.Tensor | None, kv_cache: torch.Tensor,
                attn_metadata: OOTMetadata, output: torch.Tensor) -> torch.Tensor:
        slots = attn_metadata.slot_mapping
        del slots
        return output
'''


def _installed() -> str:
    """How the package is installed, or skip saying why it cannot be tested."""
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install -e '.[dev]')")
    try:
        dist = importlib.metadata.distribution("vllm-kv-writer")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-kv-writer is not installed (pip install -e '.[dev]'): only an "
                    "installed package is what a plugin's mypy sees")
    direct = dist.read_text("direct_url.json")
    info = json.loads(direct) if direct else {}
    if info.get("dir_info", {}).get("editable"):
        where = Path(info["url"].removeprefix("file://")).resolve()
        if where != ROOT:
            pytest.skip(f"vllm-kv-writer is installed editable from {where}, not this checkout")
        return "editable"
    return "site"


def _mypy(plugin_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(ROOT / ".mypy_cache"),
         "--no-color-output", "oot_attn_migrated"],
        cwd=plugin_dir, env=env, capture_output=True, text=True, timeout=600,
    )


@pytest.fixture
def plugin_dir(tmp_path: Path) -> Path:
    assert ROOT not in tmp_path.parents
    snippets = SNIPPET.findall((ROOT / "migration_guide.md").read_text())
    assert len(snippets) == 1, "migration_guide.md has one [tool.mypy] snippet"
    (tmp_path / "pyproject.toml").write_text(snippets[0])
    shutil.copytree(PLUGIN, tmp_path / "oot_attn_migrated",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "oot_attn_migrated" / "kernels.py").write_text(KERNELS)
    return tmp_path


def test_plugin_type_checks_against_the_installed_package(plugin_dir: Path) -> None:
    _installed()
    proc = _mypy(plugin_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("Success: no issues found in 3 source files")


def test_a_contract_violation_in_the_plugin_is_reported(plugin_dir: Path) -> None:
    _installed()
    (plugin_dir / "oot_attn_migrated" / "broken.py").write_text(BROKEN)
    proc = _mypy(plugin_dir)
    errors = [line for line in proc.stdout.splitlines() if ": error: " in line]
    assert proc.returncode == 1 and len(errors) == 1, proc.stdout + proc.stderr
    assert errors[0].startswith("oot_attn_migrated/broken.py:13: error: "
                                '"OOTMetadata" has no attribute "slot_mapping"  [attr-defined]')
