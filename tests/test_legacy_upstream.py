"""Legacy backends written against upstream's interface (``tests/legacy_backends/upstream/``:
upstream's framework imports, class and method names, signatures, metadata fields and
framework calls), run unchanged: through the registry, the conformance kit and
``vllm-attn check``, with the cache bytes and outputs of this package's migrated backend of
the same layout."""

from __future__ import annotations

import contextlib
import importlib
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from shim import LegacyBackendWarning, LegacyGeneration, adapt_legacy_backend
from tests.helpers import raw
from vllm import cli
from vllm.attention import AttentionType, KVCacheLayout, allocate_kv_cache, registry
from vllm.attention.batch import make_paged_batch
from vllm.attention.conformance import check_backend, null_block
from vllm.attention.layer import Attention
from vllm.attention.ops.reference import attend
from vllm.forward_context import set_forward_context

UPSTREAM = "tests.legacy_backends.upstream"
V0_10 = f"{UPSTREAM}.flash_attn_v0_10:FlashAttentionBackend"
FLAGGED = f"{UPSTREAM}.flash_attn_flagged:FlashAttentionBackend"
TORCHTITAN = f"{UPSTREAM}.torchtitan_varlen"
SPLIT_KV_FIRST_IN_TREE = "ROCM_AITER_UNIFIED_ATTN"
"""Our migrated backend of the FlashAttention layout ``(2, nb, bs, H, D)`` (its portable
torch path on CPU), with the sliding window and soft cap upstream's FlashAttention has."""


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Legacy backends warn once at first use; these tests look at other things."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LegacyBackendWarning)
        yield


@pytest.fixture
def torchtitan() -> Iterator[Any]:
    """torchtitan's module imported afresh: its ``@register_backend(CUSTOM)`` registers
    it; the registration is removed afterwards."""
    sys.modules.pop(TORCHTITAN, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # importing and registering are silent
        module = importlib.import_module(TORCHTITAN)
    try:
        yield module
    finally:
        registry.unregister_backend("CUSTOM")
        sys.modules.pop(TORCHTITAN, None)


# -- the legacy surface: upstream's import paths -------------------------------------------

SURFACE = {
    "vllm.attention.backends.abstract": [
        "AttentionBackend", "AttentionImpl", "AttentionMetadata", "AttentionType",
        "AttentionLayer", "MLAAttentionImpl", "is_quantized_kv_cache"],
    "vllm.v1.attention.backend": [
        "AttentionBackend", "AttentionImpl", "AttentionMetadata", "AttentionType",
        "AttentionLayer", "MLAAttentionImpl", "is_quantized_kv_cache",
        "AttentionMetadataBuilder", "CommonAttentionMetadata", "AttentionCGSupport",
        "MultipleOf"],
    "vllm.v1.attention.backends.utils": [
        "AttentionMetadataBuilder", "CommonAttentionMetadata", "AttentionCGSupport",
        "get_kv_cache_layout", "split_decodes_and_prefills",
        "reorder_batch_to_split_decodes_and_prefills", "get_dcp_local_seq_lens"],
    "vllm.v1.attention.backends.registry": ["AttentionBackendEnum", "register_backend"],
    "vllm.v1.kv_cache_interface": ["AttentionSpec", "FullAttentionSpec"],
    "vllm.config": ["VllmConfig", "get_current_vllm_config", "get_layers_from_vllm_config"],
    "vllm.config.cache": ["CacheDType"],
    "vllm.logger": ["init_logger"],
    "vllm.utils": ["cdiv"],
    "vllm.utils.math_utils": ["cdiv"],
    "vllm.platforms": ["current_platform"],
    "vllm.platforms.interface": ["DeviceCapability"],
    "vllm.distributed.parallel_state": ["get_dcp_group"],
    "vllm.model_executor.layers.attention": ["Attention"],
    "vllm.model_executor.layers.batch_invariant": ["vllm_is_batch_invariant"],
    "vllm._custom_ops": ["reshape_and_cache_flash", "reshape_and_cache"],
}


@pytest.mark.parametrize("module", sorted(SURFACE))
def test_upstream_paths_export_upstream_names(module: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the surface is deprecated for mypy, silent at runtime
        found = importlib.import_module(module)
    missing = [n for n in SURFACE[module] if not hasattr(found, n)]
    assert not missing, f"{module} lacks {missing}"


def test_both_lines_share_one_set_of_bases() -> None:
    import vllm.attention.backends.abstract as v0
    import vllm.v1.attention.backend as v1
    from vllm.distributed.parallel_state import get_dcp_group

    for name in SURFACE["vllm.attention.backends.abstract"]:
        assert getattr(v0, name) is getattr(v1, name), name
    assert (get_dcp_group().world_size, get_dcp_group().rank_in_group) == (1, 0)


# -- through the registry and the kit ------------------------------------------------------


@pytest.mark.parametrize("target, name, generation", [
    (V0_10, "FLASH_ATTN_VLLM_V1", LegacyGeneration.FUSED),
    (FLAGGED, "FLASH_ATTN", LegacyGeneration.FLAGGED),
], ids=["v0_10_fused", "flagged"])
def test_module_class_loads_adapted_through_the_registry(target: str, name: str,
                                                         generation: LegacyGeneration) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # loading is silent: the warning comes at first use
        backend = registry.get_backend(target)
    assert backend.migration == "adapted" and backend.name == name
    assert backend.legacy_generation is generation
    assert backend.kv_cache_layout is KVCacheLayout.SPLIT_KV_FIRST
    assert backend.supported_dtypes == {torch.float16, torch.bfloat16}
    assert backend.supports_sliding_window and backend.supports_logits_soft_cap
    # fp8 is declared unsupported (FlashAttention 2 has no fp8 cache), so it is refused by name
    reasons = backend.unsupported_reasons(dtype=torch.bfloat16, head_size=64, block_size=16,
                                          kv_cache_dtype="fp8")
    assert len(reasons) == 1 and "kv_cache_dtype='fp8'" in reasons[0]


def test_torchtitan_registers_itself_as_custom(torchtitan: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backend = registry.get_backend("CUSTOM")
    assert backend.legacy_cls is torchtitan.PyTorchVarlenAttentionBackend
    assert backend.legacy_generation is LegacyGeneration.FLAGGED  # do_kv_cache_update inherited
    assert backend.get_impl_cls().legacy_impl_cls is torchtitan.PyTorchVarlenAttentionImpl
    assert "CUSTOM" in registry.list_backends()


def test_upstream_encoder_attention_is_not_this_packages_encoder() -> None:
    """Upstream's ENCODER reads the step's K/V and keeps no cache: an adapted backend
    admits ENCODER_ONLY (that meaning here), not ENCODER (attention over the paged cache)."""
    backend = registry.get_backend(FLAGGED)
    assert AttentionType.ENCODER not in backend.attention_types
    assert {AttentionType.DECODER, AttentionType.ENCODER_ONLY} <= backend.attention_types


@pytest.mark.parametrize("target", [V0_10, FLAGGED], ids=["v0_10_fused", "flagged"])
def test_kit_passes(target: str) -> None:
    with _quiet():
        report = check_backend(target)
    assert report.ok, report.failures
    assert report.skipped == []  # fp8 never enters the grid: it is declared unsupported
    assert any(c.endswith("-sw21") for c in report.passed)
    assert any(c.endswith("-softcap") for c in report.passed)
    assert any("-gqa8" in c for c in report.passed)


@pytest.mark.parametrize("target", [V0_10, FLAGGED], ids=["v0_10_fused", "flagged"])
def test_vllm_attn_check_passes(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    with _quiet():
        code = cli.main(["check", "-v", target])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"^PASS FLASH_ATTN\S* \[cpu\] status=adapted ", out, re.M), out


def test_torchtitan_kit_names_what_fails_and_why(torchtitan: Any) -> None:
    """torchtitan calls torch's varlen_attn_out without ``enable_gqa``, which torch 2.13
    requires for GQA/MQA; the kit reports each such configuration with torch's error, and
    the one with as many kv heads as query heads passes."""
    with _quiet():
        report = check_backend("CUSTOM", thorough=True)
    assert [c.split("-")[-1] for c in report.passed] == ["gqa1"]
    assert report.failures and all(
        "raised in forward(): ValueError: Expect query and key/value to have the same "
        "number of heads" in f for f in report.failures), report.failures


def test_torchtitan_vllm_attn_check_fails_with_the_reason(
        torchtitan: Any, capsys: pytest.CaptureFixture[str]) -> None:
    with _quiet():
        code = cli.main(["check", "CUSTOM"])
    out = capsys.readouterr().out
    assert code == 1
    assert re.search(r"^FAIL CUSTOM \[cpu\] status=adapted .* configs=0/", out, re.M), out
    assert "Try setting enable_gqa=True for GQA" in out


# -- bytes and outputs against the migrated backend of the same layout ---------------------

BS, D = 16, 64

STEPS = {
    # query_lens, context_lens, positions set to -1 among the real tokens, -1 padding rows
    "prefill": ([5, 19], [0, 0], [], 0),
    "decode": ([1, 1, 1], [4, 16, 33], [], 0),
    "padded": ([3, 1, 2], [5, 15, 20], [1, 4], 3),
}


def _run_step(backend: Any, cache: torch.Tensor, step: str, *, num_heads: int,
              num_kv_heads: int, dtype: torch.dtype, sliding_window: int | None = None,
              logits_soft_cap: float | None = None) -> tuple[torch.Tensor, int]:
    """One step through an :class:`Attention` layer: the context is written first (by
    the layer's writer), then the step's tokens by the layer itself. Returns the output
    and the number of real tokens."""
    query_lens, context_lens, skipped, pad = STEPS[step]
    g = torch.Generator().manual_seed(7)
    batch = make_paged_batch(query_lens, context_lens, block_size=BS, generator=g)
    n = batch.common.num_actual_tokens
    slots = batch.new_slots.clone()
    slots[skipped] = -1  # tokens another rank owns, or rejected drafts: never written
    slots = torch.cat([slots, torch.full((pad,), -1, dtype=torch.int64)])
    rows = slots.shape[0]
    q = torch.randn(rows, num_heads, D, generator=g).to(dtype)
    k = torch.randn(rows, num_kv_heads, D, generator=g).to(dtype)
    v = torch.randn(rows, num_kv_heads, D, generator=g).to(dtype)
    kc = torch.randn(batch.context_slots.numel(), num_kv_heads, D, generator=g).to(dtype)
    vc = torch.randn(batch.context_slots.numel(), num_kv_heads, D, generator=g).to(dtype)
    name = f"{backend.name}.layers.0.attn"
    with _quiet():
        layer = Attention(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=D,
                          scale=D ** -0.5, backend=backend, layer_name=name,
                          sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    layer.bind_kv_cache(cache, BS)
    layer.kv_cache_writer.write(kc, vc, cache, batch.context_slots, layer.kv_quant)
    meta = backend.get_builder_cls()(layer.spec, torch.device("cpu")).build(batch.common)
    with set_forward_context(attn_metadata={name: meta}, slot_mapping={name: slots}):
        out = layer(q, k, v)
    return out, n


def _same_finite_caches(backends: list[Any], dtype: torch.dtype, num_kv_heads: int
                        ) -> list[torch.Tensor]:
    """One cache per backend, all holding the same finite values (a skipped slot is read
    back as whatever it held) and a zeroed null block."""
    caches = [allocate_kv_cache(b, num_blocks=12, block_size=BS, num_kv_heads=num_kv_heads,
                                head_size=D, model_dtype=dtype, device="cpu")
              for b in backends]
    base = torch.randn(caches[0].shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    for b, c in zip(backends, caches):
        c.copy_(base)
        null_block(b, c).zero_()
    return caches


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


CASES = [
    pytest.param(V0_10, 4, 2, None, None, id="v0_10_fused-gqa"),
    pytest.param(V0_10, 4, 2, 7, 10.0, id="v0_10_fused-gqa-sw7-softcap"),
    pytest.param(FLAGGED, 4, 2, None, None, id="flagged-gqa"),
    pytest.param(FLAGGED, 4, 2, 7, 10.0, id="flagged-gqa-sw7-softcap"),
    pytest.param("CUSTOM", 2, 2, None, None, id="torchtitan-mha"),
]


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("target, num_heads, num_kv_heads, window, cap", CASES)
def test_cache_bytes_and_outputs_equal_the_migrated_backend(
        request: pytest.FixtureRequest, target: str, num_heads: int, num_kv_heads: int,
        window: int | None, cap: float | None, step: str) -> None:
    if target == "CUSTOM":
        request.getfixturevalue("torchtitan")
    dtype = torch.bfloat16
    legacy = registry.get_backend(target)
    migrated = registry.get_backend(SPLIT_KV_FIRST_IN_TREE)
    assert legacy.kv_cache_layout is migrated.kv_cache_layout
    caches = _same_finite_caches([legacy, migrated], dtype, num_kv_heads)
    outs = [_run_step(b, c, step, num_heads=num_heads, num_kv_heads=num_kv_heads,
                      dtype=dtype, sliding_window=window, logits_soft_cap=cap)
            for b, c in zip((legacy, migrated), caches)]
    (got, n), (want, _) = outs
    assert torch.equal(raw(caches[0]), raw(caches[1])), "cache bytes differ"
    err = _rel_err(got[:n], want[:n])
    assert err <= migrated.tolerances[dtype], f"relative error {err:.2e}"


def test_torchtitan_ignores_sliding_window_and_soft_cap(torchtitan: Any) -> None:
    """Its forward passes window (-1, 0) and no soft cap whatever the layer asks: the
    output is attention without them (what the kit reports as "the impl ignores it")."""
    dtype = torch.bfloat16
    legacy = registry.get_backend("CUSTOM")
    migrated = registry.get_backend(SPLIT_KV_FIRST_IN_TREE)
    caches = _same_finite_caches([legacy, migrated, migrated], dtype, 2)
    got, n = _run_step(legacy, caches[0], "prefill", num_heads=2, num_kv_heads=2,
                       dtype=dtype, sliding_window=7, logits_soft_cap=10.0)
    plain, _ = _run_step(migrated, caches[1], "prefill", num_heads=2, num_kv_heads=2,
                         dtype=dtype)
    asked, _ = _run_step(migrated, caches[2], "prefill", num_heads=2, num_kv_heads=2,
                         dtype=dtype, sliding_window=7, logits_soft_cap=10.0)
    assert _rel_err(got[:n], plain[:n]) <= migrated.tolerances[dtype]
    assert _rel_err(got[:n], asked[:n]) > 0.1


def test_flagged_encoder_only_attends_over_the_steps_own_kv() -> None:
    """Upstream's encoder path (no cache) runs for an ENCODER_ONLY layer."""
    backend = registry.get_backend(FLAGGED)
    g = torch.Generator().manual_seed(5)
    query_lens = [7, 20, 1]
    batch = make_paged_batch(query_lens, [0, 0, 0], block_size=BS, generator=g, causal=False)
    n = batch.common.num_actual_tokens
    q, k, v = (torch.randn(n, h, D, generator=g).bfloat16() for h in (4, 2, 2))
    with _quiet():
        layer = Attention(num_heads=4, num_kv_heads=2, head_size=D, scale=D ** -0.5,
                          backend=backend, layer_name="enc.0",
                          attn_type=AttentionType.ENCODER_ONLY)
    meta = backend.get_builder_cls()(layer.spec, torch.device("cpu")).build(batch.common)
    with set_forward_context(attn_metadata={"enc.0": meta}, slot_mapping={}):
        got = layer(q, k, v)
    starts = [0, 7, 27, 28]
    want = torch.cat([attend(q[a:b].double(), k[a:b].double(), v[a:b].double(),
                             scale=D ** -0.5, causal=False)
                      for a, b in zip(starts, starts[1:])])
    assert _rel_err(got, want) <= backend.tolerances[torch.bfloat16]


# -- the first-use warning -----------------------------------------------------------------


def _line_of(module: str, text: str) -> tuple[str, int]:
    path = importlib.import_module(module).__file__
    assert path is not None
    lines = Path(path).read_text().splitlines()
    return path, next(i for i, line in enumerate(lines, 1) if line.startswith(text))


def _first_use_warnings(backend: Any) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for i in range(2):  # two layers: one warning
            Attention(num_heads=4, num_kv_heads=2, head_size=D, scale=0.125, backend=backend,
                      layer_name=f"first_use.{i}")
    return [w for w in record if issubclass(w.category, LegacyBackendWarning)]


@pytest.mark.usefixtures("fresh_legacy_warnings")
@pytest.mark.parametrize("target", [V0_10, FLAGGED], ids=["v0_10_fused", "flagged"])
def test_one_warning_at_first_use_points_at_the_class(target: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backend = registry.get_backend(target)
    record = _first_use_warnings(backend)
    assert len(record) == 1
    module, cls = target.split(":")
    assert (record[0].filename, record[0].lineno) == _line_of(module, f"class {cls}(")
    text = str(record[0].message)
    assert f"{module}.{cls}" in text and "migration_guide.md" in text


@pytest.mark.usefixtures("fresh_legacy_warnings")
def test_torchtitan_warns_once_at_its_register_backend_line(torchtitan: Any) -> None:
    backend = registry.get_backend("CUSTOM")
    record = _first_use_warnings(backend)
    assert len(record) == 1
    assert (record[0].filename, record[0].lineno) == _line_of(
        TORCHTITAN, "@register_backend(AttentionBackendEnum.CUSTOM)")
    assert "PyTorchVarlenAttentionBackend" in str(record[0].message)


# -- a write that wraps the pad slot -------------------------------------------------------


def _wrapping_backend() -> type:
    """The v0.10 FlashAttention with one more write in front of its own: a plain scatter
    that does not skip -1, so a padding slot lands on the cache's last slot."""
    from tests.legacy_backends.upstream import flash_attn_v0_10 as fa

    class WrappingImpl(fa.FlashAttentionImpl):
        def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: Any,
                    output: torch.Tensor | None = None, output_scale: Any = None,
                    output_block_scale: Any = None) -> torch.Tensor:
            slots = attn_metadata.slot_mapping
            n, bs = slots.shape[0], kv_cache.shape[2]
            kv_cache[0][slots // bs, slots % bs] = key[:n]
            kv_cache[1][slots // bs, slots % bs] = value[:n]
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)

    class WrappingBackend(fa.FlashAttentionBackend):
        @staticmethod
        def get_name() -> str:
            return "WRAPS_THE_PAD_SLOT"

        @staticmethod
        def get_impl_cls() -> type:
            return WrappingImpl

    return WrappingBackend


def test_a_write_that_wraps_the_pad_slot_fails_the_kit_naming_the_slot() -> None:
    with _quiet():
        backend = adapt_legacy_backend(_wrapping_backend())
        report = check_backend(backend, max_configs=1)
    assert not report.ok
    named = [re.search(r"legacy write: forward\(\) wrote slot (\d+) \(block (\d+), offset "
                       r"(\d+)\), which no token maps to", f) for f in report.failures]
    assert named and all(named), report.failures
    for m in named:
        assert m is not None
        slot, block, offset = (int(x) for x in m.groups())
        assert offset == BS - 1 and slot == block * BS + offset  # -1 wrapped to the last slot
