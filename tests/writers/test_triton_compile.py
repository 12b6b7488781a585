"""Every writer launch compiles for each GPU target without a GPU: sm_80 (no fp8
hardware), sm_90, sm_100 and gfx942 (MI300, ROCm), each with the flags its launcher
chooses there, and passes ``tools/triton_compile_check.py``'s checks (IEEE ``div.rn``,
hardware conversions where chosen, no FMA in RoPE; for gfx942 no NVIDIA-only flag and
no inline assembly at all).

Skipped (with the reason) where Triton, or its backend for a target, is not installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed: nothing to compile")
pytest.importorskip("triton.backends.compiler",
                    reason="this triton has no backend compiler API")

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ("sm_80", "sm_90", "sm_100", "gfx942")
LINE = re.compile(r"^(ok|FAIL|gap|skip) +(\S+?):? +(.*)$")


@pytest.fixture(scope="module")
def outcome() -> dict[str, list[tuple[str, str]]]:
    """``target -> [(status, rest of the line)]`` of one run of the compile check over
    the writers (a clean subprocess: the interpreter setting of this process must not
    leak into the compiler)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "triton_compile_check.py"),
         "--group", "writers", "--target", ",".join(TARGETS)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
    out: dict[str, list[tuple[str, str]]] = {t: [] for t in TARGETS}
    for line in proc.stdout.splitlines():
        m = LINE.match(line)
        if m is not None and m.group(2) in out:
            out[m.group(2)].append((m.group(1), m.group(3)))
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("target", TARGETS)
def test_writer_launches_compile(target: str, outcome: dict[str, list[tuple[str, str]]]
                                 ) -> None:
    lines = outcome[target]
    skipped = [rest for status, rest in lines if status == "skip"]
    if skipped:
        pytest.skip(f"{target}: {skipped[0]}")
    failed = [rest for status, rest in lines if status == "FAIL"]
    assert not failed, "\n".join(failed[:10])
    compiled = [rest for status, rest in lines if status == "ok"]
    # every kind of writer launch is among them
    for kind in ("tiled-fp8_e4m3", "rope-fp8_e5m2", "tiled-mla-fp8", "rope-mla-fp8",
                 "generic-legacy", "generic-aiter", "per-token-head-int8", "fp8_ds_mla"):
        assert any(kind in rest for rest in compiled), f"no {kind} launch compiled for {target}"


def test_nvidia_only_flags_exactly_where_the_hardware_has_them(
        outcome: dict[str, list[tuple[str, str]]]) -> None:
    """sm_90 and sm_100 compile the hardware fp8 paths, sm_80 and gfx942 none of them."""
    for target, expect in (("sm_80", False), ("sm_90", True), ("sm_100", True),
                           ("gfx942", False)):
        names = [rest for status, rest in outcome[target] if status == "ok"]
        if not names:
            continue  # skipped: its own test says why
        assert any("hw_cvt" in n for n in names) == expect, target
        assert any("fast_div" in n for n in names) == expect, target
