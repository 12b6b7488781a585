"""What the nine standard backends declare, and what follows from it: reasons that name
the value and what is allowed, cache shapes and physical orders, writers by layout,
the compute path (and why not a faster one) on this machine, and the kit on CPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.backends.grid import STANDARD
from vllm.attention import allocate_kv_cache
from vllm.attention.backend import (
    AttentionBackend,
    PagedAttentionMetadata,
    SizeSpec,
    exactly,
)
from vllm.attention.backends.torch_ref import TorchRefBackend
from vllm.attention.backends.standard import StandardBackend
from vllm.attention.conformance import check_backend
from vllm.attention.errors import BackendRegistrationError, InvalidArgumentError
from vllm.attention.registry import get_backend, register_backend, select_backend
from vllm.attention.types import AttentionType, KVCacheLayout

CPU = torch.device("cpu")


def _std(name: str) -> type[StandardBackend[object]]:  # type: ignore[type-var]
    b = get_backend(name)
    assert issubclass(b, StandardBackend)
    return b


@pytest.mark.parametrize(("name", "config", "needle"), [
    ("FLASHINFER", dict(block_size=24), "block_size=24, FLASHINFER needs 16, 32, 64"),
    ("FLASH_ATTN", dict(dtype=torch.float32), "dtype=float32, FLASH_ATTN needs one of bfloat16, float16"),
    ("FLASH_ATTN", dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype='fp8_e5m2', FLASH_ATTN needs one of auto, fp8"),
    ("FLASHINFER", dict(head_size=96), "head_size=96, FLASHINFER needs 64, 128, 256"),
    ("TREE_ATTN", dict(sliding_window=64), "sliding_window=64, TREE_ATTN supports only None"),
    ("ROCM_ATTN", dict(block_size=64), "block_size=64, ROCM_ATTN needs 16, 32"),
    ("ROCM_AITER_FA", dict(head_size=72), "head_size=72, ROCM_AITER_FA needs a multiple of 16"),
    ("FLEX_ATTENTION", dict(kv_cache_dtype="fp8"), "kv_cache_dtype='fp8', FLEX_ATTENTION needs one of auto"),
    ("TRITON_ATTN", dict(kv_cache_dtype="fp8_ds_mla"), "kv_cache_dtype='fp8_ds_mla', TRITON_ATTN"),
    ("ROCM_AITER_UNIFIED_ATTN", dict(attn_type=AttentionType.ENCODER), "attn_type=encoder"),
])
def test_reasons_name_value_and_allowed(name: str, config: dict[str, object], needle: str) -> None:
    base: dict[str, object] = dict(dtype=torch.bfloat16, head_size=64, block_size=16)
    reasons = get_backend(name).unsupported_reasons(**{**base, **config})  # type: ignore[arg-type]
    assert any(needle in r for r in reasons), reasons


@pytest.mark.parametrize("name", STANDARD)
def test_supports_its_own_defaults_and_is_never_instantiated(name: str) -> None:
    b = _std(name)
    assert b.supports(dtype=torch.float16, head_size=64, block_size=16, device=CPU)
    assert not b.device_unsupported_reasons(CPU)
    with pytest.raises(TypeError):
        b()
    assert set(b.tolerances) == set(b.supported_dtypes)


EXPECTED = {
    # name: (logical shape for nb=3, bs=16, H=2, D=64, physical axis order)
    "FLASH_ATTN": ((3, 2, 16, 2, 64), (0, 1, 2, 3, 4)),
    "FLASHINFER": ((3, 2, 16, 2, 64), (0, 1, 2, 3, 4)),
    "FLASHINFER_HND": ((3, 2, 16, 2, 64), (0, 1, 3, 2, 4)),
    "TRITON_ATTN": ((3, 2, 16, 2, 64), (0, 1, 2, 3, 4)),
    "FLEX_ATTENTION": ((3, 2, 16, 2, 64), (0, 2, 1, 3, 4)),
    "TREE_ATTN": ((2, 3, 16, 2, 64), (0, 1, 2, 3, 4)),
    "FLASH_ATTN_DIFFKV": ((3, 16, 2, 64), (0, 1, 2, 3)),
    "ROCM_ATTN": ((2, 3, 16 * 2 * 64), (0, 1, 2)),
    "ROCM_AITER_UNIFIED_ATTN": ((2, 3, 16, 2, 64), (0, 1, 2, 3, 4)),
    "ROCM_AITER_FA": ((2, 3, 16, 2, 64), (0, 1, 2, 3, 4)),
}


@pytest.mark.parametrize("name", STANDARD)
def test_cache_shape_and_physical_order(name: str) -> None:
    b = _std(name)
    shape, order = EXPECTED[name]
    cache = allocate_kv_cache(b, num_blocks=3, block_size=16, num_kv_heads=2, head_size=64,
                              model_dtype=torch.float16, device="cpu")
    assert tuple(cache.shape) == shape
    assert cache.permute(*order).is_contiguous()


def test_triton_per_token_head_cache() -> None:
    b = _std("TRITON_ATTN")
    for cd in ("int8_per_token_head", "fp8_per_token_head"):
        assert b.kv_cache_layout_for(cd) is KVCacheLayout.PER_TOKEN_HEAD_QUANT
        cache = allocate_kv_cache(b, num_blocks=3, block_size=16, num_kv_heads=2, head_size=64,
                                  cache_dtype=cd, model_dtype=torch.bfloat16, device="cpu")
        assert tuple(cache.shape) == (3, 2, 16, 2, 68) and cache.dtype == torch.uint8
    assert b.kv_cache_layout_for("fp8") is KVCacheLayout.SPLIT_NHD


@pytest.mark.parametrize("name", STANDARD)
def test_writer_follows_the_layout(name: str) -> None:
    b = _std(name)
    for cd in b.supported_kv_cache_dtypes:
        writer = b.get_kv_cache_writer(cd)
        assert getattr(writer, "layout") is b.kv_cache_layout_for(cd)
    bad = "fp8_ds_mla"
    with pytest.raises(InvalidArgumentError, match=f"cache_dtype: got '{bad}'.*{name}"):
        b.get_kv_cache_writer(bad)


@pytest.mark.parametrize("name", STANDARD)
def test_cpu_path_is_torch_and_says_why(name: str) -> None:
    b = _std(name)
    assert b.compute_path(CPU) == "torch"
    notes = " | ".join(b.compute_path_notes(CPU))
    for kernel in b.vendor_kernels:
        assert f"{kernel.name}: device=cpu" in notes
        assert ("needs ROCm" if kernel.platform == "rocm" else "needs CUDA") in notes
    assert f"{b.portable_path}: device=cpu" in notes
    if b.vendor_kernels:
        assert b.vendor_package is not None


def test_vendor_packages() -> None:
    packages = {n: _std(n).vendor_package for n in STANDARD}
    assert packages["FLASH_ATTN"] == packages["FLASH_ATTN_DIFFKV"] == "flash_attn"
    assert packages["FLASHINFER"] == packages["FLASHINFER_HND"] == "flashinfer"
    assert packages["ROCM_AITER_FA"] == packages["ROCM_AITER_UNIFIED_ATTN"] == "aiter"
    assert packages["TRITON_ATTN"] is packages["ROCM_ATTN"] is packages["TREE_ATTN"] is None


def test_hnd_is_chosen_by_name_only() -> None:
    config = dict(dtype=torch.bfloat16, head_size=128, block_size=16)
    assert select_backend(**config).name == "FLASH_ATTN"  # type: ignore[arg-type]
    assert select_backend(**config, preferred="FLASHINFER_HND").kv_cache_layout is (  # type: ignore[arg-type]
        KVCacheLayout.SPLIT_HND)


@pytest.mark.parametrize("name", STANDARD)
def test_conformance_kit_quick_cpu(name: str) -> None:
    report = check_backend(name, "cpu", max_configs=3)
    assert report.ok, report.failures
    assert report.compute_path == "torch" and len(report.passed) == 3


# -- declarations as plugins write them --------------------------------------------------

PLUGINS = "tests.backends.declared_plugins"


def test_unambiguous_spellings_are_normalised_at_class_creation() -> None:
    from tests.backends.declared_plugins import PlainlySpelled

    assert PlainlySpelled.kv_cache_layout is KVCacheLayout.SPLIT_NHD
    assert PlainlySpelled.head_sizes == exactly(64, 128)
    assert PlainlySpelled.block_sizes == exactly(16, 32)
    assert PlainlySpelled.supported_dtypes == frozenset({torch.float32})
    assert PlainlySpelled.supported_kv_cache_dtypes == frozenset({"auto", "fp8_e4m3"})
    assert dict(PlainlySpelled.tolerances) == {torch.float32: 1e-4}
    assert PlainlySpelled.declaration_problems() == []
    reasons = PlainlySpelled.unsupported_reasons(dtype=torch.float32, head_size=96,
                                                 block_size=16)
    assert reasons == ["head_size=96, PLAINLY_SPELLED needs 64, 128"]


@pytest.mark.parametrize(("declarations", "normal"), [
    (dict(kv_cache_layout="SPLIT_HND"), dict(kv_cache_layout=KVCacheLayout.SPLIT_HND)),
    (dict(head_sizes=128), dict(head_sizes=exactly(128))),
    (dict(head_sizes=range(64, 257, 64)), dict(head_sizes=exactly(64, 128, 192, 256))),
    (dict(supported_dtypes={torch.bfloat16, "torch.float16"}),
     dict(supported_dtypes=frozenset({torch.bfloat16, torch.float16}))),
    (dict(supported_dtypes=torch.float16), dict(supported_dtypes=frozenset({torch.float16}))),
    (dict(supported_kv_cache_dtypes="auto"), dict(supported_kv_cache_dtypes=frozenset({"auto"}))),
    (dict(attention_types=["decoder", AttentionType.ENCODER]),
     dict(attention_types=frozenset({AttentionType.DECODER, AttentionType.ENCODER}))),
    (dict(tolerances={"float32": 1e-3, torch.float16: 1, torch.bfloat16: 0.05}),
     dict(tolerances={torch.float32: 1e-3, torch.float16: 1.0, torch.bfloat16: 0.05})),
])
def test_each_spelling(declarations: dict[str, object], normal: dict[str, object]) -> None:
    cls = type("Spelled", (TorchRefBackend,), {"name": "SPELLED", **declarations})
    for key, want in normal.items():
        got = getattr(cls, key)
        assert (dict(got) if key == "tolerances" else got) == want
    assert cls.declaration_problems() == []


@pytest.mark.parametrize(("declaration", "value", "allowed"), [
    ("name", "", "a non-empty str"),
    ("kv_cache_layout", "split_nhdd", "value or name of one: split_nhd, split_hnd"),
    ("kv_cache_layout", 3, "a KVCacheLayout"),
    ("head_sizes", [64, "128"], "positive ints"),
    ("head_sizes", [], "positive ints"),
    ("block_sizes", 0, "positive ints"),
    ("block_sizes", SizeSpec(values=frozenset()), "a SizeSpec that admits a size"),
    ("block_sizes", SizeSpec(multiple_of=16, min=16, max=8), "max >= min"),
    ("supported_dtypes", [torch.int8], "torch.float32, torch.float16, torch.bfloat16"),
    ("supported_dtypes", frozenset(), "one or more of torch.float32"),
    ("supported_kv_cache_dtypes", ["auto", "FP8"], "one or more of auto, fp8, fp8_e4m3"),
    ("attention_types", ["causal"], "one or more AttentionType members"),
    ("supports_sliding_window", "no", "True or False"),
    ("is_mla", 1, "True or False"),
    ("migration", "ported", "'migrated' or 'adapted'"),
    ("vendor_package", "", "None or the import name"),
    ("tolerances", {torch.float32: float("nan")}, "positive finite float"),
    ("tolerances", 1e-3, "a mapping of model dtype"),
])
def test_bad_declaration_is_a_problem_not_an_import_error(
        declaration: str, value: object, allowed: str) -> None:
    cls = type("Bad", (TorchRefBackend,), {declaration: value})  # creating it never raises
    problems = cls.declaration_problems()
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{declaration}: got {value!r}, expected ")
    assert allowed in problems[0]
    reasons = cls.unsupported_reasons(dtype=torch.float32, head_size=64, block_size=16)
    assert reasons == [f"{getattr(cls, 'name', 'Bad')} is declared wrongly: {problems[0]}"]
    with pytest.raises(BackendRegistrationError, match=f"declared wrongly: {declaration}: got"):
        register_backend(cls)
    report = check_backend(cls, "cpu")
    assert not report.ok and report.failures == [
        f"{report.backend} is declared wrongly: {problems[0]}"]


def test_tolerances_must_cover_the_declared_dtypes() -> None:
    cls = type("Loose", (TorchRefBackend,), {"name": "LOOSE",
                                             "tolerances": {torch.float32: 1e-4}})
    assert cls.declaration_problems() == [
        "tolerances: got {torch.float32: 0.0001}, expected a tolerance for every supported "
        "dtype (missing bfloat16, float16)"]


def test_missing_declarations_are_problems_too() -> None:
    class Bare(AttentionBackend[PagedAttentionMetadata]):
        pass

    assert Bare.missing_declarations() == [
        "name", "kv_cache_layout", "get_builder_cls", "get_impl_cls", "get_kv_cache_writer",
        "get_metadata_cls"]
    problems = Bare.declaration_problems()
    assert problems[:2] == ["name: not declared, expected a non-empty str",
                            "kv_cache_layout: not declared, expected a KVCacheLayout"]
    assert "get_impl_cls: not defined (an abstract classmethod)" in problems


def test_a_late_assignment_is_checked_and_normalised_too() -> None:
    cls = type("Late", (TorchRefBackend,), {"name": "LATE"})
    cls.head_sizes = [64]
    assert cls.declaration_problems() == [] and cls.head_sizes == exactly(64)
    cls.kv_cache_layout = "nhd"
    assert [p.split(":")[0] for p in cls.declaration_problems()] == ["kv_cache_layout"]


@pytest.fixture
def small_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A registry of TORCH_REF and one entry whose class is declared wrongly, so
    ``check --all`` stays quick."""
    from vllm.attention import registry

    monkeypatch.setattr(registry, "_IN_TREE", {
        "BADLY_DECLARED": f"{PLUGINS}:BadlyDeclared",
        "TORCH_REF": "vllm.attention.backends.torch_ref:TorchRefBackend",
    })
    registry._reset_for_tests()
    yield
    registry._reset_for_tests()


def test_check_all_reports_a_bad_declaration_as_that_backends_fail(
        small_registry: None, capsys: pytest.CaptureFixture[str]) -> None:
    from vllm.cli import main

    status = main(["check", "--all", "--device", "cpu", f"{PLUGINS}:BadlyDeclared",
                   f"{PLUGINS}:PlainlySpelled"])
    lines = capsys.readouterr().out.splitlines()
    assert status == 1
    fails = [ln for ln in lines if ln.startswith("FAIL ")]
    # the registered entry and the module:Class target, each one line naming the
    # declarations, the values seen and what is allowed
    assert len(fails) == 2, lines
    for line in fails:
        assert "BadlyDeclared is declared wrongly" in line
        assert "kv_cache_layout: got 'split_nhdd', expected a KVCacheLayout" in line
        assert "head_sizes: got [64, '128'], expected a SizeSpec" in line
    assert fails[1].startswith(f"FAIL {PLUGINS}:BadlyDeclared: backend BadlyDeclared")
    assert any(ln.startswith("PASS TORCH_REF [cpu]") for ln in lines), lines
    assert any(ln.startswith("PASS PLAINLY_SPELLED [cpu]") for ln in lines), lines
    assert lines[-1] == "2 passed, 2 failed"
