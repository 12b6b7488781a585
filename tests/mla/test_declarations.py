"""The eight MLA backends' declarations: capabilities as data, reasons, shapes, writers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.mla.helpers import MLA_NAMES
from vllm.attention import InvalidArgumentError, allocate_kv_cache
from vllm.attention.backends.mla.common import MLAMetadata, MLASparseMetadata
from vllm.attention.registry import get_backend, select_backend
from vllm.attention.types import KVCacheLayout

BLOCK_SIZES = {  # name -> (admitted, refused)
    "FLASHMLA": ((64,), (16, 32, 128)),
    "CUTLASS_MLA": ((128,), (16, 64)),
    "FLASHINFER_MLA": ((32, 64), (16, 128)),
    "FLASHMLA_SPARSE": ((64,), (16, 32)),
    "ROCM_AITER_MLA_SPARSE": ((1, 64), (16, 32)),
    "ROCM_AITER_MLA": ((1, 3, 16, 24, 128), ()),
    "TRITON_MLA": ((16, 32, 48, 128), (8, 24)),
    "FLASH_ATTN_MLA": ((16, 32, 48, 128), (8, 24)),
}
CACHE_DTYPES = {
    "FLASHMLA": {"auto", "fp8"}, "CUTLASS_MLA": {"auto", "fp8"},
    "FLASHINFER_MLA": {"auto", "fp8"}, "TRITON_MLA": {"auto", "fp8"},
    "FLASH_ATTN_MLA": {"auto"}, "ROCM_AITER_MLA": {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"},
    "FLASHMLA_SPARSE": {"auto", "fp8_ds_mla"}, "ROCM_AITER_MLA_SPARSE": {"auto", "fp8"},
}
SPARSE = {"FLASHMLA_SPARSE", "ROCM_AITER_MLA_SPARSE"}


@pytest.mark.parametrize("name", MLA_NAMES)
def test_declarations(name: str) -> None:
    b = get_backend(name)
    assert b.name == name and b.is_mla
    assert b.is_sparse == (name in SPARSE)
    assert b.kv_cache_layout is KVCacheLayout.MLA_LATENT
    assert set(b.supported_kv_cache_dtypes) == CACHE_DTYPES[name]
    ok, refused = BLOCK_SIZES[name]
    assert all(b.block_sizes.admits(bs) for bs in ok)
    assert not any(b.block_sizes.admits(bs) for bs in refused)
    meta = b.get_metadata_cls()
    assert issubclass(meta, MLASparseMetadata if name in SPARSE else MLAMetadata)
    assert "slot_mapping" not in {f.name for f in dataclasses.fields(meta)}


@pytest.mark.parametrize("name", MLA_NAMES)
def test_unsupported_reasons_name_value_and_allowed(name: str) -> None:
    b = get_backend(name)
    ok_bs = BLOCK_SIZES[name][0][0]
    assert b.unsupported_reasons(dtype=torch.bfloat16, head_size=576, block_size=ok_bs,
                                 use_mla=True, use_sparse=b.is_sparse) == []
    reasons = b.unsupported_reasons(dtype=torch.bfloat16, head_size=576, block_size=ok_bs,
                                    kv_cache_dtype="fp8_per_token_head", use_mla=False,
                                    sliding_window=8)
    text = " | ".join(reasons)
    assert "kv_cache_dtype='fp8_per_token_head'" in text and "auto" in text
    assert "use_mla=False" in text and "sliding_window=8" in text
    if BLOCK_SIZES[name][1]:
        bad = BLOCK_SIZES[name][1][0]
        (reason,) = b.unsupported_reasons(dtype=torch.bfloat16, head_size=576,
                                          block_size=bad, use_mla=True,
                                          use_sparse=b.is_sparse)
        assert f"block_size={bad}" in reason and name in reason


def test_select_backend_for_mla_says_why_not() -> None:
    chosen = select_backend(dtype=torch.bfloat16, head_size=576, block_size=128, use_mla=True)
    assert chosen.is_mla and chosen.block_sizes.admits(128)
    sparse = select_backend(dtype=torch.bfloat16, head_size=576, block_size=64, use_mla=True,
                            use_sparse=True, kv_cache_dtype="fp8_ds_mla")
    assert sparse.name == "FLASHMLA_SPARSE"


@pytest.mark.parametrize("name,cache_dtype,dtype,shape", [
    ("FLASHMLA", "auto", torch.bfloat16, (3, 64, 576)),
    ("FLASHMLA", "fp8", torch.float8_e4m3fn, (3, 64, 576)),
    ("ROCM_AITER_MLA", "fp8_e5m2", torch.float8_e5m2, (3, 16, 576)),
    ("FLASHMLA_SPARSE", "fp8_ds_mla", torch.uint8, (3, 64, 656)),
])
def test_allocate(name: str, cache_dtype: str, dtype: torch.dtype,
                  shape: tuple[int, ...]) -> None:
    b = get_backend(name)
    cache = allocate_kv_cache(b, num_blocks=3, block_size=shape[1], num_kv_heads=1,
                              head_size=576, cache_dtype=cache_dtype, model_dtype=torch.bfloat16,
                              device="cpu")
    assert tuple(cache.shape) == shape and cache.dtype == dtype and cache.is_contiguous()
    layout = b.kv_cache_layout_for(cache_dtype)  # type: ignore[arg-type]
    assert layout is (KVCacheLayout.MLA_FP8_DS if cache_dtype == "fp8_ds_mla"
                      else KVCacheLayout.MLA_LATENT)
    with pytest.raises(InvalidArgumentError, match="num_kv_heads"):
        b.get_kv_cache_shape(3, shape[1], 2, 576)


@pytest.mark.parametrize("name", MLA_NAMES)
def test_writer_per_cache_dtype(name: str) -> None:
    b = get_backend(name)
    for cd in b.supported_kv_cache_dtypes:
        writer = b.get_kv_cache_writer(cd)
        expected = "FP8DsMLACacheWriter" if cd == "fp8_ds_mla" else "MLALatentCacheWriter"
        assert type(writer).__name__ == expected
    with pytest.raises(InvalidArgumentError, match="cache_dtype: got 'int8_per_token_head'"):
        b.get_kv_cache_writer("int8_per_token_head")


@pytest.mark.parametrize("name", MLA_NAMES)
def test_compute_path_on_cpu_is_torch_and_says_why(name: str) -> None:
    b = get_backend(name)
    cpu = torch.device("cpu")
    assert b.compute_path(cpu) == "torch"
    notes = b.compute_path_notes(cpu)
    assert any("triton" in n for n in notes)
    vendor = b.get_impl_cls().vendor
    if vendor is not None:
        assert any(n.startswith(vendor.name + ":") and "device cpu" in n for n in notes)


def test_cli_backends_lists_all_eight_with_their_path() -> None:
    from vllm.cli import backend_rows

    rows = {r["name"]: r for r in backend_rows(torch.device("cpu"))}
    for name in MLA_NAMES:
        assert rows[name]["compute"] == "torch"
        assert rows[name]["here"].startswith("yes")


@pytest.mark.parametrize("hip, major", [(None, 9), ("6.2", None)])
def test_vendor_capability_is_nvidia_only(hip: str | None, major: int | None,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The vendor MLA kernels ask one question, the device module's: an MI300 (ROCm
    torch reports ``cuda`` and capability 9.4) is no sm_90."""
    from vllm.attention.ops import mla_vendor
    from vllm.attention.writers.kernels import device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(device, "_capability", lambda index: (9, 4 if hip else 0))
    monkeypatch.setattr(torch.version, "hip", hip)
    assert mla_vendor._cuda_major(torch.device("cuda")) == major
    assert mla_vendor._cuda_major(torch.device("cpu")) is None


@pytest.mark.parametrize("raw, on", [(None, None), ("", None), (" ", None), ("0", False),
                                     ("off", False), ("1", True), ("true", True),
                                     (" On ", True)])
def test_fp8_mma_default_from_the_environment(raw: str | None, on: bool | None,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``VLLM_MLA_FP8_MMA`` sets ``MLACommonImpl.fp8_mma`` for the layers built after it
    (None, unset: each backend's default); a value it does not know is refused, naming
    the variable."""
    from tests.mla.helpers import make_spec

    if raw is None:
        monkeypatch.delenv("VLLM_MLA_FP8_MMA", raising=False)
    else:
        monkeypatch.setenv("VLLM_MLA_FP8_MMA", raw)
    impl = get_backend("TRITON_MLA").get_impl_cls()(make_spec(cache_dtype="fp8"))
    assert impl.fp8_mma is on


@pytest.mark.parametrize("raw", [None, "0", "1"])
@pytest.mark.parametrize("heads", [16, 32, 33, 128])
@pytest.mark.parametrize("name", ["TRITON_MLA", "FLASHMLA"])
def test_fp8_mma_backend_defaults(name: str, heads: int, raw: str | None,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, FLASHMLA asks for the fp8-MMA kernel past 32 heads (upstream's FLASHMLA
    decodes an fp8 cache with an fp8 query) and TRITON_MLA never (upstream's widens the
    cache, exact dots); the variable or the attribute overrides both at any head count.
    Only where it asks, and only with an E4M3 cache, is the decode held to the fp8-MMA
    tolerance."""
    from tests.mla.helpers import make_spec
    from vllm.attention.ops.triton_mla_decode import FP8_MMA_TOLERANCE

    if raw is None:
        monkeypatch.delenv("VLLM_MLA_FP8_MMA", raising=False)
    else:
        monkeypatch.setenv("VLLM_MLA_FP8_MMA", raw)
    default = name == "FLASHMLA" and heads > 32
    want = default if raw is None else raw == "1"
    cls = get_backend(name).get_impl_cls()
    for cache_dtype in ("auto", "fp8", "fp8_e4m3"):
        impl = cls(make_spec(n=heads, cache_dtype=cache_dtype))
        assert impl.uses_fp8_mma() is want
        fp8 = cache_dtype != "auto"
        assert impl.compute_tolerance(2e-2) == (FP8_MMA_TOLERANCE if want and fp8 else 2e-2)
        assert impl.compute_tolerance(0.5) == 0.5
        impl.fp8_mma = not want  # the attribute wins over the variable and the default
        assert impl.uses_fp8_mma() is (not want)
        impl.fp8_mma = None
        assert impl.uses_fp8_mma() is default


def test_fp8_mma_environment_refuses_what_it_does_not_know(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.mla.helpers import make_spec

    monkeypatch.setenv("VLLM_MLA_FP8_MMA", "tru")
    with pytest.raises(InvalidArgumentError, match="VLLM_MLA_FP8_MMA: got 'tru'"):
        get_backend("FLASHMLA").get_impl_cls()(make_spec(cache_dtype="fp8"))
