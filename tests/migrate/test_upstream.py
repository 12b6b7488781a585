"""The backends written against upstream's interfaces (``tests/legacy_backends/upstream``)
migrate with the manual steps the command lists; the steps, done exactly as listed, give
modules that ``--check`` finds identical to the adapted originals, and that ``mypy
--strict`` reports nothing new on (these modules are not typed to ``--strict`` themselves:
each error it reports on a migrated module it reports on the original too, and none of
them is about the new API)."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import pytest

from shim.adapter import adapt_quietly
from tests.migrate.support import LEGACY, marked_lines, mypy_strict, run
from vllm.migrate.check import compare, load_module
from vllm.migrate.report import EXIT_MANUAL_STEPS

UPSTREAM = LEGACY / "upstream"
Step = tuple[str, list[tuple[str, str]]]
"""A listed step's "what to do", and the edits (old text, new text) a person makes."""

NO_CONFIG = ("compute it from self.spec (AttentionLayerSpec) or per step in build() from the "
             "CommonAttentionMetadata")

V0_10: list[Step] = [
    ("replace get_layers_from_vllm_config (vllm.config): the new API passes no configuration "
     "object: take what you read from it from the AttentionLayerSpec or the "
     "CommonAttentionMetadata", [
         ("from vllm.config import get_layers_from_vllm_config\n", ""),
         ("from vllm.attention.layer import Attention\n", ""),
         ("""\
        windows = {layer.impl.sliding_window
                   for layer in get_layers_from_vllm_config(self.vllm_config, Attention).values()}
        if len(windows) > 1:
            logger.info_once("layers differ in sliding window: FA3 schedules per call")
            self.aot_schedule = False
        self.aot_sliding_window = windows.pop() if len(windows) == 1 else _NO_WINDOW
""", """\
        # the builder serves one KV-cache group: its layers share the spec's window
        window = self.spec.sliding_window
        self.aot_sliding_window = _NO_WINDOW if window is None else (window - 1, 0)
"""),
     ]),
    ("replace init_logger (vllm.logger): use logging.getLogger (upstream's logger adds the "
     "*_once methods)", [
         ("from vllm.logger import init_logger\n", ""),
         ("logger = init_logger(__name__)\n", ""),
     ]),
    (NO_CONFIG, [("        self.vllm_config = vllm_config\n", "")]),
    (NO_CONFIG, [
        ("        self.cache_config = vllm_config.cache_config\n",
         "        self.cache_dtype = spec.kv_cache_dtype\n"),
        ("        spelled = self.cache_config.cache_dtype\n", "        spelled = self.cache_dtype\n"),
    ]),
    (NO_CONFIG, [("""\
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        self.num_heads_q = model.get_num_attention_heads(parallel)
        self.num_heads_kv = model.get_num_kv_heads(parallel)
        self.headdim = model.get_head_size()
""", """\
        self.num_heads_q = spec.num_heads
        self.num_heads_kv = spec.num_kv_heads
        self.headdim = spec.head_size
""")]),
    (NO_CONFIG, [("        self.kv_cache_dtype = kv_cache_spec.dtype\n",
                  "        self.kv_cache_dtype = torch.get_default_dtype()  # FA3 scheduling\n")]),
    (NO_CONFIG, [
        ("        self.block_size = kv_cache_spec.block_size\n",
         "        self.block_size = 0  # build() takes each step's\n"),
        ("        c = common_attn_metadata\n",
         "        c = common_attn_metadata\n        self.block_size = c.block_size\n"),
    ]),
    (NO_CONFIG, [("""\
        compilation = vllm_config.compilation_config
        self.use_full_cuda_graph = compilation.cudagraph_mode.has_full_cudagraphs()
""", "        self.use_full_cuda_graph = False  # no CUDA graph captures a builder here\n")]),
    ("check key and value for None before this use", [(
        "            return self._forward_encoder_attention(query[:n], key[:n], value[:n],",
        "            if key is None or value is None:\n"
        "                raise ValueError(\"encoder attention needs this step's key and value\")\n"
        "            return self._forward_encoder_attention(query[:n], key[:n], value[:n],")]),
]


def unmark(code: str) -> str:
    """``code`` without its ``# MIGRATE:`` marker comments."""
    lines = code.splitlines(keepends=True)
    drop: set[int] = set()
    for start in marked_lines(code):
        i = start - 1
        drop.add(i)
        while i + 1 < len(lines) and lines[i + 1].strip().startswith("#   "):
            i += 1
            drop.add(i)
    return "".join(line for i, line in enumerate(lines) if i not in drop)


def do_steps(source: Path, out: Path, steps: list[Step]) -> str:
    """Migrate ``source`` into ``out``, check the listed steps are ``steps`` (each at its
    marker), and return the module with them done."""
    done = run(source, "--out", out)
    assert done.code == EXIT_MANUAL_STEPS, done.err
    written = out / source.name
    code = written.read_text(encoding="utf-8")
    listed = [line.split(": ", 1) for line in done.out.splitlines()]
    assert [todo for _, todo in listed] == [todo for todo, _ in steps]
    assert [where for where, _ in listed] == [f"{written}:{n}" for n in marked_lines(code)]
    fixed = unmark(code)
    for _, edits in steps:
        for old, new in edits:
            assert fixed.count(old) == 1, old
            fixed = fixed.replace(old, new)
    assert "# MIGRATE:" not in fixed
    return fixed


def check_same(source: Path, fixed: str, name: str, migrated: ModuleType | None = None) -> None:
    original = getattr(load_module(source, source.read_text(encoding="utf-8"), "_original"),
                       name)
    module = migrated or load_module(source, fixed, "_migrated")
    outcome = compare(adapt_quietly(original), getattr(module, name))
    assert outcome.ok, outcome.differences
    assert outcome.compared and all(report.ok for report in outcome.reports)


_LOCATION = re.compile(r"^[^:]+:\d+: (?:error|note): ")


def errors(path: Path) -> list[str]:
    lines = mypy_strict(path).stdout.splitlines()
    return sorted(_LOCATION.sub("", line) for line in lines if ": error: " in line)


def check_types(source: Path, fixed: str, folder: Path) -> None:
    """mypy reports nothing on the migrated module that it does not on the original, and
    nothing the new API would (deprecated legacy names, overrides, slot_mapping)."""
    original, migrated = folder / f"original_{source.name}", folder / f"migrated_{source.name}"
    original.write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    migrated.write_text(fixed, encoding="utf-8")
    before, after = errors(original), errors(migrated)
    new = [e for e in after if e not in before]
    assert new == [], new
    contract = [e for e in after if "[deprecated]" in e or "[override]" in e
                or "slot_mapping" in e]
    assert contract == [], contract


def test_flash_attention_v0_10(tmp_path: Path) -> None:
    source = UPSTREAM / "flash_attn_v0_10.py"
    fixed = do_steps(source, tmp_path / "out", V0_10)
    check_same(source, fixed, "FlashAttentionBackend")
    check_types(source, fixed, tmp_path)
