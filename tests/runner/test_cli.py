"""``vllm-attn generate``: JSON shape, text prompts, legacy warnings, strict mode, errors."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shim import LegacyBackendWarning
from tests.runner.conftest import MAX_NEW, PROMPTS, HFCheckpoint
from vllm.cli import main
from vllm.runner.cli import ProgressBar

ROOT = Path(__file__).resolve().parents[2]
FUSED = "tests.legacy_backends.fused:FusedLegacyBackend"
FLAGGED = "tests.legacy_backends.flagged:FlaggedLegacyBackend"


@pytest.fixture
def isolated_legacy_warnings() -> Iterator[None]:
    """Forget which legacy backends warned, before and after: later tests elsewhere
    expect a first warning of their own."""
    from shim.warnings import _reset_for_tests

    _reset_for_tests()
    yield
    _reset_for_tests()


def _ids_args(prompts: list[list[int]]) -> list[str]:
    args: list[str] = []
    for p in prompts:
        args += ["--prompt-token-ids", ",".join(map(str, p))]
    return args


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["generate", "--no-progress", "--max-model-len", "128", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output_shape_and_order(hf_llama: HFCheckpoint,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "--model", str(hf_llama.path), "--backend", "TORCH_REF",
                          *_ids_args(PROMPTS), "--max-tokens", str(MAX_NEW), "--output", "json")
    assert code == 0, err
    result = json.loads(out)  # exactly one JSON document on stdout
    assert set(result) == {"backend", "dtype", "outputs", "tokens_per_s"}
    assert result["backend"] == "TORCH_REF" and result["dtype"] == "float32"
    assert isinstance(result["tokens_per_s"], float) and result["tokens_per_s"] > 0
    assert [o["prompt_token_ids"] for o in result["outputs"]] == PROMPTS
    assert [o["token_ids"] for o in result["outputs"]] == hf_llama.expected(PROMPTS)
    assert all(set(o) == {"prompt_token_ids", "token_ids", "text"} and isinstance(o["text"], str)
               for o in result["outputs"])
    assert "tokens/s" in err.splitlines()[-1]


def test_text_prompt_through_tokenizer_json(hf_llama: HFCheckpoint,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "--model", str(hf_llama.path), "--backend", "TORCH_REF",
                          "--prompt", "w5 w17 w33 w9", "--max-tokens", str(MAX_NEW))
    assert code == 0, err
    want = " ".join(f"w{t}" for t in hf_llama.expected(PROMPTS[:1])[0] if t > 2)
    assert out == f"Prompt: 'w5 w17 w33 w9', Generated text: {want!r}\n"


def test_out_of_tree_module_class_backend(hf_llama: HFCheckpoint,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "--model", str(hf_llama.path), "--backend",
                          "vllm.attention.backends.torch_ref:TorchRefBackend",
                          *_ids_args(PROMPTS[:1]), "--max-tokens", str(MAX_NEW),
                          "--output", "json")
    assert code == 0, err
    result = json.loads(out)
    assert result["backend"] == "TORCH_REF"
    assert result["outputs"][0]["token_ids"] == hf_llama.expected(PROMPTS[:1])[0]


def test_prompt_text_needs_a_tokenizer(tmp_path: Path, hf_llama: HFCheckpoint,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    for f in ("config.json", "model.safetensors"):
        (tmp_path / f).write_bytes((hf_llama.path / f).read_bytes())
    code, out, err = _run(capsys, "--model", str(tmp_path), "--prompt", "w5")
    assert code == 2 and err == (f"vllm-attn generate: error: --prompt: got 'w5', expected "
                                 f"--prompt-token-ids: {tmp_path} has no tokenizer.json\n")
    code, out, err = _run(capsys, "--model", str(tmp_path), "--prompt-token-ids", "5,6",
                          "--max-tokens", "2", "--output", "json")
    assert code == 0 and json.loads(out)["outputs"][0]["text"] is None


def test_random_model_runs_with_no_checkpoint(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "--prompt", "hello", "--max-tokens", "3", "--output", "json",
                          "--backend", "TORCH_REF")
    assert code == 0, err
    result = json.loads(out)
    assert result["outputs"][0]["prompt_token_ids"][0] == 1  # the byte tokenizer's BOS
    assert len(result["outputs"][0]["token_ids"]) <= 3


@pytest.mark.parametrize("target", [FUSED, FLAGGED])
@pytest.mark.usefixtures("isolated_legacy_warnings")
def test_legacy_backend_warns_once_and_reports(target: str, hf_llama: HFCheckpoint,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.warns(LegacyBackendWarning) as record:
        code, out, err = _run(capsys, "--model", str(hf_llama.path), "--backend", target,
                              *_ids_args(PROMPTS), "--max-tokens", str(MAX_NEW),
                              "--output", "json")
    assert code == 0, err
    legacy = [w for w in record if issubclass(w.category, LegacyBackendWarning)]
    assert len(legacy) == 1, [str(w.message) for w in legacy]
    assert "migration_guide.md" in str(legacy[0].message)
    assert [o["token_ids"] for o in json.loads(out)["outputs"]] == hf_llama.expected(PROMPTS)
    summary = [line for line in err.splitlines() if line.startswith("deprecations:")]
    assert len(summary) == 1 and "1 adapted legacy backend" in summary[0]


def test_legacy_warning_once_in_a_real_process(hf_llama: HFCheckpoint) -> None:
    """Default warning filters, stderr as a user sees it: one warning, one summary line."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "vllm.cli", "generate", "--model", str(hf_llama.path),
         "--backend", FUSED, *_ids_args(PROMPTS), "--max-tokens", "4", "--max-model-len", "64"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("LegacyBackendWarning") == 1, proc.stderr
    assert proc.stderr.count("deprecations: 1 adapted legacy backend") == 1
    assert len(proc.stdout.splitlines()) == len(PROMPTS)  # one line a request


@pytest.mark.usefixtures("isolated_legacy_warnings")
def test_strict_backends_refuses_legacy(hf_llama: HFCheckpoint,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    # filterwarnings=error: a warning escaping here would fail the test
    code, out, err = _run(capsys, "--model", str(hf_llama.path), "--backend", FUSED,
                          "--strict-backends", "--prompt-token-ids", "5,6")
    assert code == 2 and out == ""
    assert "--strict-backends" in err and "EXAMPLE_LEGACY_FUSED" in err
    assert "migration_guide.md" in err


@pytest.mark.parametrize("args, match", [
    (["--prompt-token-ids", "1,x"], "--prompt-token-ids: got '1,x'"),
    (["--backend", "NO_SUCH"], "no attention backend named 'NO_SUCH'"),
    (["--backend", "FLASHMLA", "--model", "random"], "FLASHMLA cannot serve.*use_mla=False"),
    (["--model", "/nonexistent"], "--model: got '/nonexistent'"),
])
def test_bad_arguments_exit_2_naming_the_argument(args: list[str], match: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("vllm-attn generate: error:")
    assert re.search(match, err), err


def _fp32_backends() -> list[str]:
    from vllm.attention.registry import get_backend, list_backends

    return [n for n in list_backends() if torch.float32 in get_backend(n).supported_dtypes]


def test_default_backend_serves_float32_on_cpu_and_equals_hf(
        hf_llama: HFCheckpoint, capsys: pytest.CaptureFixture[str]) -> None:
    """--help says ``auto`` is float32 on CPU: the default choice serves it (a faster
    backend that only runs 16-bit is not chosen), and the tokens are transformers'."""
    code, out, err = _run(capsys, "--model", str(hf_llama.path), *_ids_args(PROMPTS),
                          "--max-tokens", str(MAX_NEW), "--output", "json", "--device", "cpu")
    assert code == 0, err
    result = json.loads(out)
    assert result["dtype"] == "float32" and result["backend"] in _fp32_backends()
    assert f"backend {result['backend']} (migrated), llama, float32," in err
    assert [o["token_ids"] for o in result["outputs"]] == hf_llama.expected(PROMPTS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_default_backend_serves_the_dtype_asked_for(
        dtype: str, capsys: pytest.CaptureFixture[str]) -> None:
    from vllm.attention.registry import get_backend, list_backends

    code, out, err = _run(capsys, "--prompt-token-ids", "1,5,9", "--max-tokens", "2",
                          "--dtype", dtype, "--output", "json", "--device", "cpu")
    assert code == 0, err
    result = json.loads(out)
    assert result["dtype"] == dtype
    # the first in priority order that runs it (none of these is refused on CPU here)
    first = next(n for n in list_backends() if n != "TORCH_REF"
                 and getattr(torch, dtype) in get_backend(n).supported_dtypes
                 and not get_backend(n).is_mla and get_backend(n).migration == "migrated")
    assert result["backend"] == first


def test_named_16_bit_backend_says_what_dtype_it_serves(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "--backend", "FLASH_ATTN", "--prompt-token-ids", "1,5",
                          "--max-tokens", "2", "--output", "json", "--device", "cpu")
    assert code == 0, err
    assert json.loads(out)["dtype"] == "bfloat16"
    assert ("note: FLASH_ATTN does not run float32 (what --dtype auto is on cpu); "
            "serving bfloat16") in err
    code, out, err = _run(capsys, "--backend", "FLASH_ATTN", "--dtype", "float32",
                          "--prompt-token-ids", "1,5", "--device", "cpu")
    assert code == 2 and out == ""
    assert re.search(r"FLASH_ATTN cannot serve this model \(llama, dtype=float32.*dtype", err)


# -- devices and malformed input: a message and exit code 2, never a traceback ---------
def _usage_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--no-progress", *args])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == ""
    assert len(err.splitlines()) == 2 and "Traceback" not in err, err
    return err


def test_device_of_a_type_the_backends_do_not_run_on(capsys: pytest.CaptureFixture[str]) -> None:
    for device in ("tpu", "cuda:x", "mps"):
        err = _usage_error(capsys, "--device", device)
        assert err.startswith(f"vllm-attn generate: error: argument --device: got '{device}', "
                              "expected cpu, cuda or cuda:N"), err


def test_cuda_without_cuda(monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _usage_error(capsys, "--device", "cuda", "--prompt-token-ids", "1,2")
    assert re.match(r"vllm-attn generate: error: argument --device: got 'cuda', but torch "
                    r"\S+ (is a CPU-only build|sees no CUDA device .*) \(use --device cpu\)$",
                    err.splitlines()[0]), err


def test_cuda_index_past_the_devices(monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = _usage_error(capsys, "--device", "cuda:7")
    assert "got 'cuda:7', but this machine has 1 CUDA device(s): cuda:0 to cuda:0" in err


def test_cuda_without_cuda_in_a_real_process() -> None:
    """What a user's shell shows: two lines, exit code 2 (``CUDA_VISIBLE_DEVICES=""``
    hides any GPU this machine has)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "vllm.cli", "generate", "--device", "cuda"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 2, proc.stderr
    assert "argument --device: got 'cuda', but torch" in proc.stderr


@pytest.mark.parametrize("text, match", [
    ('{"architectures": ["LlamaForCausalLM"],', "got 'invalid JSON \\(Expecting property name "
                                                 "enclosed in double quotes at line 1 column 40\\)'"),
    ("[1, 2]", "got 'list', expected a JSON object"),
    ("", "got 'invalid JSON \\(Expecting value at line 1 column 1\\)'"),
])
def test_malformed_config_json(tmp_path: Path, text: str, match: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(text)
    code, out, err = _run(capsys, "--model", str(tmp_path), "--prompt-token-ids", "1")
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.startswith(f"vllm-attn generate: error: {tmp_path / 'config.json'}: "), err
    assert re.search(match, err), err
    assert len(err.splitlines()) == 1


# -- what generate shows -----------------------------------------------------------------
def test_default_run_shows_the_built_in_prompt_and_says_the_model_is_random(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "--max-tokens", "4", "--device", "cpu")
    assert code == 0, err
    assert out.startswith("Prompt: 'Hello, my name is', Generated text: '")
    assert len(out.splitlines()) == 1  # quoted: whatever bytes come out stay on the line
    assert "note: the seeded random llama model: its weights are random" in err


def test_token_id_output_without_a_tokenizer_is_labelled(
        tmp_path: Path, hf_llama: HFCheckpoint, capsys: pytest.CaptureFixture[str]) -> None:
    for f in ("config.json", "model.safetensors"):
        (tmp_path / f).write_bytes((hf_llama.path / f).read_bytes())
    code, out, err = _run(capsys, "--model", str(tmp_path), "--prompt-token-ids", "5,17,33,9",
                          "--max-tokens", "3")
    assert code == 0, err
    want = hf_llama.expected(PROMPTS[:1])[0][:3]
    assert out == f"Prompt token ids: [5, 17, 33, 9], Generated token ids: {want}\n"


@pytest.mark.parametrize("setup, why", [
    ("missing", "{dir} has no tokenizer.json"),
    ("sentencepiece", "{dir} has no tokenizer.json (its tokenizer.model is a SentencePiece "
                      "file, which the runner does not read)"),
    ("broken", "{dir}/tokenizer.json could not be read by the 'tokenizers' package: "),
    ("no_package", "reading tokenizer.json needs the 'tokenizers' package, which is not "
                   "installed"),
])
def test_tokenizer_error_says_what_is_wrong(setup: str, why: str, tmp_path: Path,
                                            hf_llama: HFCheckpoint,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    for f in ("config.json", "model.safetensors"):
        (tmp_path / f).write_bytes((hf_llama.path / f).read_bytes())
    if setup == "sentencepiece":
        (tmp_path / "tokenizer.model").write_bytes(b"\x00")
    elif setup == "broken":
        (tmp_path / "tokenizer.json").write_text('{"model": 3}')
    elif setup == "no_package":
        (tmp_path / "tokenizer.json").write_text((hf_llama.path / "tokenizer.json").read_text())
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: None if name == "tokenizers" else real(name, *a))
    code, out, err = _run(capsys, "--model", str(tmp_path), "--prompt", "w5")
    assert code == 2 and out == ""
    assert err.startswith("vllm-attn generate: error: --prompt: got 'w5', expected "
                          "--prompt-token-ids: " + why.format(dir=tmp_path)), err
    assert "pip install" not in err or setup == "no_package"


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["check", "--help"],
                                  ["backends", "--help"]])
def test_help_has_no_rst_markup(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out = capsys.readouterr().out
    assert exc.value.code == 0 and out.startswith("usage: vllm-attn")
    assert "``" not in out


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_fills_with_tokens_not_finished_requests() -> None:
    """One request of 16 tokens: the bar moves with every token, not only at the end."""
    stream = _Terminal()
    bar = ProgressBar(16, stream, enabled=True)
    drawn = []
    for tokens in range(1, 17):
        bar._last = 0.0  # every step drawn (the bar redraws at most every 0.1 s)
        bar.update(0 if tokens < 16 else 1, 1, tokens)
        drawn.append(stream.getvalue().rsplit("\r", 1)[-1])
    assert drawn[7].startswith("generate [" + "#" * 12 + "." * 12 + "] 8/16 tokens, 0/1 requests")
    assert drawn[-1].startswith("generate [" + "#" * 24 + "] 16/16 tokens, 1/1 requests")
    assert len({line.split("]")[0] for line in drawn}) > 8  # it moved as tokens came


def test_progress_bar_full_when_requests_end_early() -> None:
    stream = io.StringIO()  # not a terminal: drawn once, at close
    bar = ProgressBar(32, stream, enabled=True)
    bar.update(0, 2, 3)
    bar.update(2, 2, 5)  # both stopped at EOS
    assert stream.getvalue() == ""
    bar.close()
    assert stream.getvalue().startswith("generate [" + "#" * 24 + "] 5/32 tokens, 2/2 requests")
