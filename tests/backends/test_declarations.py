"""What the nine standard backends declare, and what follows from it: reasons that name
the value and what is allowed, cache shapes and physical orders, writers by layout,
the compute path (and why not a faster one) on this machine, and the kit on CPU."""

from __future__ import annotations

import pytest
import torch

from tests.backends.grid import STANDARD
from vllm.attention import allocate_kv_cache
from vllm.attention.backends.standard import StandardBackend
from vllm.attention.conformance import check_backend
from vllm.attention.errors import InvalidArgumentError
from vllm.attention.registry import get_backend, select_backend
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
