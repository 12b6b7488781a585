"""The out-of-tree backend example: both distributions install, register through the
``vllm.attention_backends`` entry point, and pass ``vllm-attn check`` (the legacy one
through the adapter, with its one warning); the migration changes no result."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from shim import LegacyBackendWarning, adapt_legacy_backend
from vllm.attention import allocate_kv_cache
from vllm.attention.batch import make_paged_batch
from vllm.attention.layer import Attention
from vllm.forward_context import set_forward_context

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "out_of_tree_backend"
WARNING_LINE = re.compile(r"\b\w*Warning: ")
# torch's own notice on machines without a usable CUDA driver (as in pyproject's filterwarnings)
TORCH_NOTICE = "CUDA initialization"


@dataclasses.dataclass(frozen=True)
class Installed:
    site: Path
    """The ``--target`` directory holding the package and its ``.dist-info``."""
    cwd: Path
    """An empty working directory, so nothing resolves from the current directory."""

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``vllm-attn ARGS`` (as ``python -m vllm.cli``) with the install on the path."""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
        env["PYTHONPATH"] = os.pathsep.join([str(self.site), str(ROOT)])
        return subprocess.run(
            [sys.executable, "-m", "vllm.cli", *args, "--device", "cpu"],
            cwd=self.cwd, env=env, capture_output=True, text=True, timeout=120,
        )


def _build_backend_missing() -> str | None:
    """Why ``--no-build-isolation`` cannot build the examples here (None: it can)."""
    try:
        import setuptools
    except ImportError:
        return "setuptools is not installed (the examples build offline, without isolation)"
    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    if (major, minor) < (70, 1) and importlib.util.find_spec("wheel") is None:
        return f"setuptools {setuptools.__version__} needs the wheel package to build wheels"
    return None


def _install(which: str, tmp: Path) -> Installed:
    missing = _build_backend_missing()
    if missing is not None:
        pytest.skip(missing)
    # Build from a copy: setuptools leaves build/ and *.egg-info next to the sources.
    src = shutil.copytree(EXAMPLE / which, tmp / "src")
    site, cwd = tmp / "site", tmp / "cwd"
    cwd.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--no-index", "--quiet", "--disable-pip-version-check", "--target", str(site),
         str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"pip install {which} failed:\n{proc.stdout}\n{proc.stderr}"
    return Installed(site, cwd)


@pytest.fixture(scope="module")
def legacy(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    return _install("legacy", tmp_path_factory.mktemp("oot_legacy"))


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    return _install("migrated", tmp_path_factory.mktemp("oot_migrated"))


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines()
            if WARNING_LINE.search(line) and TORCH_NOTICE not in line]


def _status(stdout: str, name: str) -> str:
    rows = [line.split() for line in stdout.splitlines() if line.split()[:1] == [name]]
    assert len(rows) == 1, f"{name} is not listed once by `vllm-attn backends`:\n{stdout}"
    return rows[0][1]


def test_legacy_is_listed_as_adapted(legacy: Installed) -> None:
    proc = legacy.run("backends")
    assert proc.returncode == 0, proc.stderr
    assert _status(proc.stdout, "OOT_LEGACY") == "adapted"
    assert _status(proc.stdout, "TORCH_REF") == "migrated"


def test_legacy_passes_check_with_one_warning(legacy: Installed) -> None:
    proc = legacy.run("check", "OOT_LEGACY")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^PASS OOT_LEGACY \[cpu\] status=adapted ", proc.stdout, re.M), proc.stdout
    found = _warnings(proc.stderr)
    assert len(found) == 1 and "LegacyBackendWarning" in found[0], proc.stderr
    assert "OOT_LEGACY" in found[0] and "migration_guide.md" in found[0]


def test_migrated_is_listed_as_migrated(migrated: Installed) -> None:
    proc = migrated.run("backends")
    assert proc.returncode == 0, proc.stderr
    assert _status(proc.stdout, "OOT_MIGRATED") == "migrated"
    assert _warnings(proc.stderr) == [], proc.stderr


def test_migrated_passes_check_without_warning(migrated: Installed) -> None:
    proc = migrated.run("check", "OOT_MIGRATED")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^PASS OOT_MIGRATED \[cpu\] status=migrated ", proc.stdout, re.M), proc.stdout
    assert _warnings(proc.stderr) == [], proc.stderr


# -- the migration changes no result ----------------------------------------------------
@pytest.fixture
def example_modules(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """The two backend modules, imported from the example sources."""
    monkeypatch.syspath_prepend(str(EXAMPLE / "legacy"))
    monkeypatch.syspath_prepend(str(EXAMPLE / "migrated"))
    from oot_attn_legacy import backend as legacy_backend
    from oot_attn_migrated import backend as migrated_backend

    return legacy_backend, migrated_backend


def _step(backend: Any, dtype: torch.dtype, sliding_window: int | None) -> tuple[torch.Tensor, ...]:
    """Write two steps (prefill, then decode) through a layer; return outputs and cache."""
    g = torch.Generator().manual_seed(3)
    bs, heads, kv_heads, d = 16, 8, 2, 64
    layer = Attention(num_heads=heads, num_kv_heads=kv_heads, head_size=d, scale=d ** -0.5,
                      backend=backend, layer_name="l0", sliding_window=sliding_window)
    cache = allocate_kv_cache(backend, num_blocks=8, block_size=bs, num_kv_heads=kv_heads,
                              head_size=d, model_dtype=dtype, device="cpu")
    cache.zero_()
    layer.bind_kv_cache(cache, bs)
    outs = []
    for query_lens, context_lens in (([19, 5], [0, 0]), ([1, 1], [19, 5])):
        batch = make_paged_batch(query_lens, context_lens, block_size=bs, generator=g)
        n = batch.common.num_actual_tokens
        q = torch.randn(n, heads, d, generator=g).to(dtype)
        k = torch.randn(n + 2, kv_heads, d, generator=g).to(dtype)  # two padding rows
        v = torch.randn(n + 2, kv_heads, d, generator=g).to(dtype)
        meta = backend.get_builder_cls()(layer.spec, torch.device("cpu")).build(batch.common)
        with set_forward_context(attn_metadata={"l0": meta}, slot_mapping={"l0": batch.new_slots}):
            outs.append(layer(q, k, v))
    return (*outs, cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sliding_window", [None, 7], ids=["full", "sw7"])
def test_migration_is_bit_identical(example_modules: tuple[Any, Any], dtype: torch.dtype,
                                    sliding_window: int | None) -> None:
    legacy_module, migrated_module = example_modules
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LegacyBackendWarning)  # its text is tested above
        adapted = adapt_legacy_backend(legacy_module.LegacyBackend)
    before = _step(adapted, dtype, sliding_window)
    after = _step(migrated_module.MigratedBackend, dtype, sliding_window)
    for b, a in zip(before, after):
        assert torch.equal(b.view(torch.uint8), a.view(torch.uint8))


def test_migrated_example_type_checks_strict() -> None:
    api = pytest.importorskip("mypy.api", reason="mypy is not installed (pip install -e .[dev])")
    out, err, status = api.run([
        "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(ROOT / ".mypy_cache"),
        str(EXAMPLE / "migrated" / "oot_attn_migrated"),
    ])
    assert status == 0, out + err
