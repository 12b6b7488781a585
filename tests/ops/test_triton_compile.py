"""The attention and MLA Triton launches compile for sm_90 without a GPU (a global
name in a kernel signature, say, only fails at real compile time, never under the
interpreter). Runs tools/triton_compile_check.py in a clean subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed: nothing to compile")
pytest.importorskip("triton.backends.nvidia", reason="triton has no NVIDIA backend here")

ROOT = Path(__file__).resolve().parents[2]


def test_attention_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "triton_compile_check.py")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert " 0 failed" in proc.stdout
