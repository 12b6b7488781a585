"""The backends written against upstream's interfaces (``tests/legacy_backends/upstream``)
migrate with the manual steps the command lists; the steps, done exactly as listed, give
modules that ``--check`` finds identical to the adapted originals. ``mypy --strict``
reports nothing on the originals but their uses of the deprecated legacy surface, and
nothing at all on the migrated modules, which use the new API only."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from shim.adapter import adapt_quietly
from tests.migrate.support import LEGACY, load, marked_lines, mypy_strict, original, run, unmark
from vllm.migrate.check import compare
from vllm.migrate.report import EXIT_MANUAL_STEPS

UPSTREAM = LEGACY / "upstream"


@dataclass(frozen=True)
class Cut:
    """An edit deleting the text from ``start`` up to (not including) ``end``."""

    start: str
    end: str

    def apply(self, code: str) -> str:
        assert code.count(self.start) == 1 and code.count(self.end) == 1, self
        at = code.index(self.start)
        return code[:at] + code[code.index(self.end, at):]


Edit = tuple[str, str] | Cut
Step = tuple[str, list[Edit]]
"""A listed step's "what to do", and the edits a person makes for it: (old text, new
text) pairs and cuts. A step whose statement an earlier step's edit removed has none."""

NO_CONFIG = ("compute it from self.spec (AttentionLayerSpec) or per step in build() from the "
             "CommonAttentionMetadata")
MODEL_CONFIG = """\
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        if model is None:
            raise ValueError("FlashAttentionMetadataBuilder needs vllm_config.model_config")
        self.num_heads_q = model.get_num_attention_heads(parallel)
        self.num_heads_kv = model.get_num_kv_heads(parallel)
        self.headdim = model.get_head_size()
"""
SPEC_HEADS = """\
        self.num_heads_q = spec.num_heads
        self.num_heads_kv = spec.num_kv_heads
        self.headdim = spec.head_size
"""
LAYER_WINDOWS = """\
                   for layer in get_layers_from_vllm_config(self.vllm_config, Attention).values()}
        if len(windows) > 1:
            logger.info_once("layers differ in sliding window: FA3 schedules per call")
            self.aot_schedule = False
        self.aot_sliding_window = windows.pop() if len(windows) == 1 else _NO_WINDOW
"""
"""How both FlashAttention builders pick the window from upstream's layers (after the
line that starts the set)."""
SPEC_WINDOW = """\
        # the builder serves one KV-cache group: its layers share the spec's window
        window = self.spec.sliding_window
        self.aot_sliding_window = _NO_WINDOW if window is None else (window - 1, 0)
"""

LOGGER: Step = (
    "replace init_logger (vllm.logger): use logging.getLogger (upstream's logger adds the "
    "*_once methods)", [
        ("from vllm.logger import init_logger\n", ""),
        ("logger = init_logger(__name__)\n", ""),
    ])
CACHE_CONFIG: Step = (NO_CONFIG, [
    ("        self.cache_config = vllm_config.cache_config\n",
     "        self.cache_dtype = spec.kv_cache_dtype\n"),
    ("        spelled = self.cache_config.cache_dtype\n", "        spelled = self.cache_dtype\n"),
])
KV_CACHE_DTYPE: Step = (NO_CONFIG, [
    ("        self.kv_cache_dtype = kv_cache_spec.dtype\n",
     "        self.kv_cache_dtype = torch.get_default_dtype()  # FA3 scheduling\n"),
])
BLOCK_SIZE: Step = (NO_CONFIG, [
    ("        self.block_size = kv_cache_spec.block_size\n",
     "        self.block_size = 0  # build() takes each step's\n"),
    ("        c = common_attn_metadata\n",
     "        c = common_attn_metadata\n        self.block_size = c.block_size\n"),
])
"""Steps both FlashAttention modules list, done alike."""

V0_10: list[Step] = [
    ("replace get_layers_from_vllm_config (vllm.config): the new API passes no configuration "
     "object: take what you read from it from the AttentionLayerSpec or the "
     "CommonAttentionMetadata", [
         ("from vllm.config import get_layers_from_vllm_config\n", ""),
         ("from vllm.attention.layer import Attention\n", ""),
         # the cast went with the statement below
         ("from typing import Any, ClassVar, cast\n", "from typing import Any, ClassVar\n"),
         ("""\
        # the layers found are the views legacy impls are called with, holding those impls
        windows = {cast(FlashAttentionImpl, layer.impl).sliding_window
""" + LAYER_WINDOWS, SPEC_WINDOW),
     ]),
    LOGGER,
    (NO_CONFIG, [("        self.vllm_config = vllm_config\n", "")]),
    CACHE_CONFIG,
    (NO_CONFIG, [(MODEL_CONFIG, SPEC_HEADS)]),
    KV_CACHE_DTYPE,
    BLOCK_SIZE,
    (NO_CONFIG, [("""\
        compilation = vllm_config.compilation_config
        self.use_full_cuda_graph = compilation.cudagraph_mode.has_full_cudagraphs()
""", "        self.use_full_cuda_graph = False  # no CUDA graph captures a builder here\n")]),
]


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
        for edit in edits:
            if isinstance(edit, Cut):
                fixed = edit.apply(fixed)
                continue
            old, new = edit
            assert fixed.count(old) == 1, old
            fixed = fixed.replace(old, new)
    assert "# MIGRATE:" not in fixed
    return fixed


def check_same(source: Path, fixed: str, name: str, *, kit_passes: bool = True) -> ModuleType:
    """``--check``'s comparison of the original and the fixed migration; the migrated
    module (loaded beside the original, so its imports resolve alike)."""
    module = load(source, fixed)
    outcome = compare(adapt_quietly(original(source, name)), getattr(module, name))
    assert outcome.ok, outcome.differences
    assert outcome.compared
    if kit_passes:
        assert all(report.ok for report in outcome.reports)
    return module


def test_the_originals_report_only_their_uses_of_the_legacy_surface(tmp_path: Path) -> None:
    """The modules (and their stand-in kernels) are typed to ``--strict``: mypy reports
    nothing on them but the deprecated legacy names they use, which the migration
    replaces."""
    checked = mypy_strict(*sorted(UPSTREAM.glob("*.py")), cwd=tmp_path)
    found = [line for line in checked.stdout.splitlines() if ": error: " in line]
    assert found, checked.stdout + checked.stderr
    assert all(line.endswith("[deprecated]") for line in found), found


def check_types(fixed: str, migrated: Path) -> None:
    """``mypy --strict`` reports nothing on ``fixed``, written to ``migrated``: it uses the
    new API only."""
    migrated.write_text(fixed, encoding="utf-8")
    checked = mypy_strict(migrated)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_flash_attention_v0_10(tmp_path: Path) -> None:
    source = UPSTREAM / "flash_attn_v0_10.py"
    fixed = do_steps(source, tmp_path / "out", V0_10)
    check_same(source, fixed, "FlashAttentionBackend")
    check_types(fixed, tmp_path / f"migrated_{source.name}")


CONFIG_IMPORT = ("replace get_current_vllm_config, get_layers_from_vllm_config (vllm.config): "
                 "the new API passes no configuration object: take what you read from it from "
                 "the AttentionLayerSpec or the CommonAttentionMetadata")
NO_DCP = "the new API has no decode context parallelism: drop that path"
KEY_VALUE = "check key and value for None before this use"

FLAGGED: list[Step] = [
    (CONFIG_IMPORT, [("from vllm.config import get_current_vllm_config, "
                      "get_layers_from_vllm_config\n", "")]),
    ("replace CacheDType (vllm.config.cache): use vllm.attention.KVCacheDType",
     [("from vllm.config.cache import CacheDType\n", "")]),
    (f"replace get_dcp_group (vllm.distributed.parallel_state): {NO_DCP}", [
        ("from vllm.distributed.parallel_state import get_dcp_group\n", ""),
        ("""\
        try:
            dcp = get_dcp_group()
            self.dcp_world_size, self.dcp_rank = dcp.world_size, dcp.rank_in_group
        except AssertionError:  # no distributed state (a builder made in a unit test)
            self.dcp_world_size, self.dcp_rank = 1, 0
""", "        self.dcp_world_size, self.dcp_rank = 1, 0  # no context parallelism here\n"),
        Cut("    def _forward_with_dcp(", "    def _forward_encoder_attention("),
    ]),
    LOGGER,
    ("replace Attention (vllm.model_executor.layers.attention): use "
     "vllm.attention.layer.Attention",
     [("from vllm.model_executor.layers.attention import Attention\n", "")]),
    ("replace vllm_is_batch_invariant (vllm.model_executor.layers.batch_invariant): read "
     "your own setting", [
         ("from vllm.model_executor.layers.batch_invariant import vllm_is_batch_invariant\n",
          ""),
         ("import dataclasses\n", "import dataclasses\nimport os\n"),
         ("_NO_WINDOW = (-1, -1)\n", """\
def vllm_is_batch_invariant() -> bool:
    \"\"\"True when ``VLLM_BATCH_INVARIANT=1`` asks for batch-invariant kernels.\"\"\"
    return os.environ.get("VLLM_BATCH_INVARIANT", "0").strip() == "1"


_NO_WINDOW = (-1, -1)
"""),
     ]),
    ("replace DeviceCapability (vllm.platforms.interface): compare "
     "torch.cuda.get_device_capability(device) in device_unsupported_reasons()",
     [("from vllm.platforms.interface import DeviceCapability\n", "")]),
    ("replace MultipleOf (vllm.v1.attention.backend): declare block_sizes as a SizeSpec",
     [("from vllm.v1.attention.backend import (\n    MultipleOf,\n)\n", "")]),
    (f"replace get_dcp_local_seq_lens (vllm.v1.attention.backends.utils): {NO_DCP}", [
        ("from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens\n", ""),
        Cut("        if self.dcp_world_size > 1:\n            # this rank attends",
            "        elif common_prefix_len > 0:"),
        ("        elif common_prefix_len > 0:", "        if common_prefix_len > 0:"),
    ]),
    ("declare block_sizes as class data and delete get_supported_kernel_block_sizes", [
        Cut("    @staticmethod\n    def get_supported_kernel_block_sizes(",
            "    @classmethod\n    def get_impl_cls("),
        ("    head_sizes: ClassVar[SizeSpec] = SizeSpec(multiple_of=8, min=8, max=256)\n",
         "    head_sizes: ClassVar[SizeSpec] = SizeSpec(multiple_of=8, min=8, max=256)\n"
         "    block_sizes: ClassVar[SizeSpec] = SizeSpec(multiple_of=16, min=16)\n"),
    ]),
    ("declare supported_kv_cache_dtypes as class data and delete supports_kv_cache_dtype", [
        Cut("    @classmethod\n    def supports_kv_cache_dtype(",
            "    @classmethod\n    def supports_sink("),
        ("    block_sizes: ClassVar[SizeSpec] = SizeSpec(multiple_of=16, min=16)\n",
         "    block_sizes: ClassVar[SizeSpec] = SizeSpec(multiple_of=16, min=16)\n"
         "    # fp8 needs FA3, which the CPU stand-in kernels are not\n"
         '    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset({"auto"})\n'),
    ]),
    ("express what supports_sink() says as a declaration or delete it", [
        Cut("    @classmethod\n    def supports_sink(",
            "    @classmethod\n    def supports_compute_capability("),
    ]),
    ("return the reason from device_unsupported_reasons()", [("""\
    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return capability >= DeviceCapability(8, 0)
""", """\
    @classmethod
    def device_unsupported_reasons(cls, device: torch.device) -> list[str]:
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
            return [f"{device}: {cls.name} needs compute capability 8.0 or later"]
        return []
""")]),
    ("return its reasons from unsupported_reasons()", [
        Cut("\n    @classmethod\n    def supports_combination(",
            "\n\n@dataclass(frozen=True, kw_only=True)\nclass FlashAttentionMetadata("),
    ]),
    CACHE_CONFIG,
    (NO_CONFIG, [(MODEL_CONFIG, SPEC_HEADS), (
        "        self.cp_kv_cache_interleave_size = parallel.cp_kv_cache_interleave_size\n", "")]),
    KV_CACHE_DTYPE,
    BLOCK_SIZE,
    (NO_CONFIG, [("""\
        compilation = vllm_config.compilation_config
        self.use_full_cuda_graph = compilation.cudagraph_mode.has_full_cudagraphs()
        self.max_cudagraph_size = compilation.max_cudagraph_capture_size
""", """\
        self.use_full_cuda_graph = False  # no CUDA graph captures a builder here
        self.max_cudagraph_size: int | None = None
""")]),
    (NO_CONFIG, [("""\
        self.max_num_splits = (
            vllm_config.attention_config.flash_attn_max_num_splits_for_cuda_graph
            if self.use_full_cuda_graph and self.aot_schedule else 0)
""", "        self.max_num_splits = 0\n")]),
    ("read what you need from self.spec (AttentionLayerSpec) instead", [
        ("        windows = {layer.impl.sliding_window\n" + LAYER_WINDOWS, SPEC_WINDOW)]),
    ("declare the refusal as class data (supports_*, attention_types, "
     "supported_kv_cache_dtypes) or in unsupported_reasons(), then delete it", [
         # the declared cache dtypes leave no fp8 layer to refuse
         Cut('        if (spec.kv_cache_dtype != "auto") and not flash_attn_supports_fp8():',
             "        if sinks is not None:"),
     ]),
    (KEY_VALUE, [(
        "            return self._forward_encoder_attention(query[:n], key[:n], value[:n],",
        "            if key is None or value is None:\n"
        "                raise ValueError(\"encoder attention needs this step's key and value\")\n"
        "            return self._forward_encoder_attention(query[:n], key[:n], value[:n],")]),
    ("set self.dcp_world_size in __init__ (1, 0 or False without context parallelism)", [
        # the impl never runs context-parallel now: its DCP branch goes
        Cut("        if self.dcp_world_size > 1:\n            self._forward_with_dcp(",
            "        flash_attn_varlen_func(\n            q=query[:n],"),
    ]),
    (KEY_VALUE, []),  # the DCP branch it marks went with the step above
]


def test_flash_attention_flagged(tmp_path: Path) -> None:
    source = UPSTREAM / "flash_attn_flagged.py"
    fixed = do_steps(source, tmp_path / "out", FLAGGED)
    check_same(source, fixed, "FlashAttentionBackend")
    check_types(fixed, tmp_path / f"migrated_{source.name}")


def test_torchtitan_varlen(tmp_path: Path) -> None:
    """torchtitan's plugin subclasses the flagged FlashAttention of another module: it
    migrates on its own, and its first step points it at that module's migration."""
    from vllm.attention import registry

    base = UPSTREAM / "flash_attn_flagged.py"
    source = UPSTREAM / "torchtitan_varlen.py"
    try:
        flagged_fixed = do_steps(base, tmp_path / "base", FLAGGED)
        flagged = check_same(base, flagged_fixed, "FlashAttentionBackend")
        legacy_import = "from tests.legacy_backends.upstream.flash_attn_flagged import ("
        steps: list[Step] = [
            (f"migrate it too (vllm-attn migrate {os.path.relpath(base)}) and import "
             "FlashAttentionBackend, FlashAttentionImpl, FlashAttentionMetadata from the "
             "migrated module", [(legacy_import, "from MIGRATED_FLAGGED import (")]),
            ("replace AttentionBackendEnum (vllm.v1.attention.backends.registry): the new "
             "registry takes the backend's own name; register_backend "
             "(vllm.v1.attention.backends.registry): register with "
             "vllm.attention.registry.register_backend(cls), under cls.name", [
                 ("from vllm.v1.attention.backends.registry import AttentionBackendEnum, "
                  "register_backend\n", ""),
                 # importing a module registers nothing: its user calls
                 # registry.register_backend(PyTorchVarlenAttentionBackend)
                 ("@register_backend(AttentionBackendEnum.CUSTOM)\n", ""),
             ]),
            ("set self.dcp_world_size in __init__ (1, 0 or False without context "
             "parallelism)", [
                 # (the marked statement lists what the plugin refuses)
                 ("            (self.dcp_world_size != 1, \"decode context parallelism\"),\n",
                  ""),
             ]),
        ]
        fixed = do_steps(source, tmp_path / "out", steps)
        module = check_same(source, fixed.replace("MIGRATED_FLAGGED", flagged.__name__),
                            "PyTorchVarlenAttentionBackend", kit_passes=False)
        assert issubclass(module.PyTorchVarlenAttentionBackend, flagged.FlashAttentionBackend)
        types = tmp_path / "types"  # the two migrated modules side by side, as mypy sees them
        types.mkdir()
        (types / "migrated_flash_attn_flagged.py").write_text(flagged_fixed, encoding="utf-8")
        check_types(fixed.replace("MIGRATED_FLAGGED", "migrated_flash_attn_flagged"),
                    types / f"migrated_{source.name}")
    finally:
        registry.unregister_backend("CUSTOM")  # the original registers itself on import
