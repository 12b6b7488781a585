"""``vllm-attn backends`` and ``check``: devices that are absent or unknown, the kit's
header and summary. (``generate`` is tested in tests/runner/test_cli.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm.cli import main


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine as one without a GPU, whatever it has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.usefixtures("no_cuda")
def test_check_on_absent_cuda_is_one_skip_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "TORCH_REF", "--device", "cuda"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("conformance kit (docs/conformance.md) on cuda: torch ")
    assert lines[0].endswith("; nothing can run there")
    assert lines[1] == "SKIP TORCH_REF [cuda] status=migrated: cuda is not available here"
    assert lines[2] == "0 passed, 0 failed, 1 skipped"


@pytest.mark.usefixtures("no_cuda")
def test_check_on_absent_cuda_still_fails_an_unknown_name(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "TORCH_REF", "NO_SUCH", "--device", "cuda"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("FAIL NO_SUCH: no attention backend named 'NO_SUCH'")
    assert lines[-1] == "0 passed, 1 failed, 1 skipped"


@pytest.mark.usefixtures("no_cuda")
def test_backends_on_absent_cuda_says_why_on_every_row(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--device", "cuda"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert rows and all(" no: torch " in row for row in rows), rows


@pytest.mark.parametrize("command", ["backends", "check"])
def test_unknown_device_type_is_a_usage_error(command: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--device", "tpu"])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == ""
    assert err.splitlines() == [
        f"vllm-attn {command}: error: argument --device: got 'tpu', expected cpu, cuda or "
        "cuda:N (the device types the backends run on)",
        f"(`vllm-attn {command} --help` lists the options)",
    ]


def test_check_says_it_is_the_kit_and_what_ran_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "TORCH_REF", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("conformance kit (docs/conformance.md) on cpu: the backends' CPU paths "
                        "only; their GPU paths (vendor kernels, Triton) run with --device cuda "
                        "on a machine with a GPU")
    assert lines[1].startswith("PASS TORCH_REF [cpu] status=migrated compute=torch")
    assert lines[-1] == "1 passed, 0 failed"


def test_a_reader_that_left_gets_no_traceback() -> None:
    """``vllm-attn backends | head -1``: the pipe closes under the writer (here before
    its first line, so that the write fails whatever the buffering)."""
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-m", "vllm.cli", "backends", "--device", "cpu"],
                            cwd=root, env=dict(os.environ, PYTHONPATH=str(root)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()
