"""``vllm-attn migrate`` on the command line: what it writes and prints, ``--diff``,
``--check``, manual steps (exit 3) that a person then does, and the input never written."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shim.adapter import adapt_quietly
from tests.migrate.support import (
    EXAMPLES,
    ROOT,
    load,
    marked_lines,
    mypy_strict,
    original,
    run,
    unmark,
)
from vllm.migrate.check import compare
from vllm.migrate.report import EXIT_ERROR, EXIT_MANUAL_STEPS, EXIT_OK


def test_writes_the_migrated_module(tmp_path: Path) -> None:
    source = EXAMPLES["fused"]
    before = source.read_bytes()
    done = run(source, "--out", tmp_path / "out")
    assert done.code == EXIT_OK, done.err
    written = tmp_path / "out" / "fused.py"
    assert "class FusedLegacyBackend(AttentionBackend[FusedLegacyMetadata]):" in \
        written.read_text(encoding="utf-8")
    assert source.read_bytes() == before
    assert done.err.startswith(f"wrote {written}: EXAMPLE_LEGACY_FUSED (FusedLegacyBackend), "
                               "a fused backend with a SPLIT_NHD cache")
    assert done.out == ""  # no manual steps to list


def test_diff_writes_nothing(tmp_path: Path) -> None:
    done = run(EXAMPLES["flagged"], "--out", tmp_path / "out", "--diff")
    assert done.code == EXIT_OK, done.err
    assert not (tmp_path / "out").exists()
    lines = done.out.splitlines()
    assert lines[0] == f"--- {EXAMPLES['flagged']}"
    assert lines[1] == f"+++ {tmp_path / 'out' / 'flagged.py'}"
    assert "-    forward_includes_kv_cache_update = False" in lines
    assert "+class FlaggedLegacyBackend(AttentionBackend[FlaggedLegacyMetadata]):" in lines


def test_never_replaces_the_input(tmp_path: Path) -> None:
    source = tmp_path / "fused.py"
    source.write_bytes(EXAMPLES["fused"].read_bytes())
    done = run(source, "--out", tmp_path)
    assert done.code == EXIT_ERROR
    assert "would replace the input" in done.err and "(nothing written)" in done.err
    assert source.read_bytes() == EXAMPLES["fused"].read_bytes()


def test_check_prints_the_comparison(tmp_path: Path) -> None:
    done = run(EXAMPLES["oot_legacy"], "--out", tmp_path, "--check")
    assert done.code == EXIT_OK, done.out + done.err
    assert "check: same: 9 configurations compared on cpu" in done.err
    assert "kit: original 9 passed, 0 failed, migrated 9 passed, 0 failed" in done.err


MANUAL = '''\
"""A fused legacy backend whose head sizes come from a helper and whose builder reads
upstream's configuration: the two things the command leaves to a person."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm.attention.ops.reference import attend


def head_sizes() -> list[int]:
    return [64, 128]


@dataclass
class Meta:
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_table: torch.Tensor
    num_reqs: int
    slot_mapping: torch.Tensor


class Builder:
    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        self.device = device
        self.num_heads = vllm_config.model_config.num_attention_heads

    def build(self, common_prefix_len: int, common_attn_metadata: Any,
              fast_build: bool = False) -> Meta:
        c = common_attn_metadata
        return Meta(query_start_loc_cpu=c.query_start_loc_cpu, seq_lens_cpu=c.seq_lens_cpu,
                    block_table=c.block_table_tensor, num_reqs=c.num_reqs,
                    slot_mapping=c.slot_mapping)


class Impl:
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: Any, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = "decoder",
                 kv_sharing_target_layer_name: str | None = None) -> None:
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: Meta,
                output: torch.Tensor) -> torch.Tensor:
        k_pages, v_pages = kv_cache.unbind(1)
        bs = k_pages.shape[1]
        slots = attn_metadata.slot_mapping
        keep = slots >= 0
        where = (slots[keep] // bs, slots[keep] % bs)
        k_pages.index_put_(where, key[: len(slots)][keep])
        v_pages.index_put_(where, value[: len(slots)][keep])
        starts = attn_metadata.query_start_loc_cpu.tolist()
        lens = attn_metadata.seq_lens_cpu.tolist()
        for i in range(attn_metadata.num_reqs):
            qs, qe, n = starts[i], starts[i + 1], lens[i]
            ids = attn_metadata.block_table[i, : -(-n // bs)].long()
            k = k_pages[ids].flatten(0, 1)[:n].float()
            v = v_pages[ids].flatten(0, 1)[:n].float()
            out = attend(query[qs:qe].float(), k, v, scale=self.scale, causal=True,
                         sliding_window=self.sliding_window,
                         logits_soft_cap=self.logits_soft_cap)
            output[qs:qe] = out.to(output.dtype)
        return output


class ManualBackend:
    @staticmethod
    def get_name() -> str:
        return "MANUAL_EXAMPLE"

    @staticmethod
    def get_impl_cls() -> type[Impl]:
        return Impl

    @staticmethod
    def get_builder_cls() -> type[Builder]:
        return Builder

    @staticmethod
    def get_metadata_cls() -> type[Meta]:
        return Meta

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        return head_sizes()
'''

HEAD_SIZES_METHOD = '''
    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        return head_sizes()
'''

STEPS = {
    "compute it from self.spec (AttentionLayerSpec) or per step in build() from the "
    "CommonAttentionMetadata": [
        ("self.num_heads = vllm_config.model_config.num_attention_heads",
         "self.num_heads = spec.num_heads"),
    ],
    "declare head_sizes as class data and delete get_supported_head_sizes": [
        (HEAD_SIZES_METHOD, ""),
        ("    kv_cache_layout: ClassVar[KVCacheLayout] = KVCacheLayout.SPLIT_NHD\n",
         "    kv_cache_layout: ClassVar[KVCacheLayout] = KVCacheLayout.SPLIT_NHD\n"
         "    head_sizes: ClassVar[SizeSpec] = SizeSpec(values=frozenset({64, 128}))\n"),
    ],
}
"""Each step the command lists for MANUAL (in the order of the module), and the edits a
person makes for it."""


def test_manual_steps_are_listed_and_doing_them_finishes_the_migration(tmp_path: Path) -> None:
    source = tmp_path / "src" / "manual.py"
    source.parent.mkdir()
    source.write_text(MANUAL, encoding="utf-8")
    done = run(source, "--out", tmp_path / "out")
    assert done.code == EXIT_MANUAL_STEPS, done.err
    written = tmp_path / "out" / "manual.py"
    code = written.read_text(encoding="utf-8")
    listed = done.out.splitlines()
    assert [line.split(": ", 1)[1] for line in listed] == list(STEPS)
    assert [line.split(": ", 1)[0] for line in listed] == [
        f"{written}:{n}" for n in marked_lines(code)]
    assert "2 manual steps left" in done.err
    # the write went, with what only served it
    assert "index_put_" not in code and "slot_mapping" not in code

    fixed = unmark(code)
    for edits in STEPS.values():
        for old, new in edits:
            assert fixed.count(old) == 1, old
            fixed = fixed.replace(old, new)
    assert "# MIGRATE:" not in fixed
    written.write_text(fixed, encoding="utf-8")
    assert mypy_strict(written).returncode == 0, mypy_strict(written).stdout
    outcome = compare(adapt_quietly(original(source, "ManualBackend")),
                      load(source, fixed).ManualBackend)
    assert outcome.ok, outcome.differences


def test_without_libcst_the_command_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "libcst" else real(name, *a))
    done = run(EXAMPLES["fused"], "--out", "unused")
    assert done.code == EXIT_ERROR
    assert "pip install 'vllm-kv-writer[migrate]'" in done.err
    assert not Path("unused").exists()


def test_the_package_imports_without_libcst() -> None:
    """``vllm``, ``vllm.cli`` and ``vllm.migrate`` import, and ``migrate`` answers, in a
    process where ``libcst`` cannot be imported."""
    script = textwrap.dedent(f"""
        import sys
        sys.modules["libcst"] = None  # import libcst -> ImportError
        import vllm.migrate, vllm.migrate.command
        from vllm.cli import main
        sys.exit(main(["migrate", {str(EXAMPLES['fused'])!r}, "--diff"]))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, check=False)
    assert done.returncode == EXIT_ERROR, done.stderr
    assert "libcst is not installed" in done.stderr
