"""Input the command cannot migrate: each is a clear message, exit status 2, and nothing
written."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.migrate.support import EXAMPLES, ROOT, run
from vllm.migrate.report import EXIT_ERROR

FUSED = EXAMPLES["fused"].read_text(encoding="utf-8")

NOT_A_BACKEND = '''\
class Helper:
    def get_name(self) -> str:
        return "not a backend"
'''

SYNTAX_ERROR = FUSED.replace("class FusedLegacyImpl:", "class FusedLegacyImpl(:")

NO_WRITE = FUSED.replace(
    "            key_cache[slots[keep] // bs, slots[keep] % bs] = key[:n][keep]\n"
    "            value_cache[slots[keep] // bs, slots[keep] % bs] = value[:n][keep]\n",
    "            self.write(key, value, slots)\n")

MLA_WRITE = FUSED.replace(
    "            key_cache[slots[keep] // bs, slots[keep] % bs] = key[:n][keep]\n"
    "            value_cache[slots[keep] // bs, slots[keep] % bs] = value[:n][keep]\n",
    "            concat_and_cache_mla(key, value, kv_cache, slots, 'auto', layer._k_scale)\n")

TWO_BACKENDS = FUSED + '''

class AnotherBackend(FusedLegacyBackend):
    @staticmethod
    def get_name() -> str:
        return "ANOTHER"
'''

CASES = {
    "not a backend": (NOT_A_BACKEND, None, "not an attention backend module: no class "
                      "subclasses a legacy AttentionBackend or defines get_name, "
                      "get_impl_cls, get_builder_cls, get_kv_cache_shape"),
    "syntax error": (SYNTAX_ERROR, None, "syntax error"),
    "no write found": (NO_WRITE, None, "FusedLegacyImpl.forward(): found no cache write from "
                       "the slot mapping"),
    "an MLA write": (MLA_WRITE, None, "concat_and_cache_mla, an MLA write"),
    "several backends": (TWO_BACKENDS, None, "the module holds several legacy backends "
                         "(FusedLegacyBackend, AnotherBackend); name the one to migrate"),
    "no such class": (FUSED, "Missing", ":Missing: no class Missing in the module"),
    "not a backend class": (FUSED, "FusedLegacyImpl", ":FusedLegacyImpl is not a legacy "
                            "attention backend"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_module(case: str, tmp_path: Path) -> None:
    text, cls, message = CASES[case]
    source = tmp_path / "legacy.py"
    source.write_text(text, encoding="utf-8")
    done = run(f"{source}:{cls}" if cls else source, "--out", tmp_path / "out")
    assert done.code == EXIT_ERROR, done.err
    assert done.err.startswith("vllm-attn migrate: error: "), done.err
    assert message in done.err, done.err
    assert done.err.rstrip().endswith("(nothing written)")
    assert not (tmp_path / "out").exists()
    assert source.read_text(encoding="utf-8") == text


def test_syntax_error_names_the_line(tmp_path: Path) -> None:
    source = tmp_path / "legacy.py"
    source.write_text(SYNTAX_ERROR, encoding="utf-8")
    line = SYNTAX_ERROR.splitlines().index("class FusedLegacyImpl(:") + 1
    assert f"{source}:{line}:" in run(source, "--out", tmp_path / "out").err


def test_already_new_style(tmp_path: Path) -> None:
    done = run(ROOT / "vllm" / "attention" / "backends" / "torch_ref.py", "--out", tmp_path)
    assert done.code == EXIT_ERROR
    assert "no legacy backend to migrate: TorchRefBackend already subclasses " \
           "vllm.attention.AttentionBackend" in done.err
    named = run(f"{ROOT / 'vllm' / 'attention' / 'backends' / 'torch_ref.py'}:TorchRefBackend",
                "--out", tmp_path)
    assert "TorchRefBackend is already a new-style backend" in named.err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("target", "message"), [
    ("missing.py", "missing.py: no such file"),
    ("notes.txt", "expected the path of a Python file (PATH/module.py)"),
    ("legacy.py:Not-A-Name", "Class is a Python identifier ('Not-A-Name' is not)"),
])
def test_bad_target(target: str, message: str, tmp_path: Path) -> None:
    done = run(tmp_path / target, "--out", tmp_path / "out")
    assert done.code == EXIT_ERROR
    assert message in done.err, done.err
    assert not (tmp_path / "out").exists()
