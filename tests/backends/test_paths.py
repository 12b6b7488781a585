"""Path choice: which calls each vendor kernel takes (from its declarations), that the
impl runs the first one that takes a call and falls back otherwise (recording why),
and the per-backend metadata its kernel reads."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from tests.backends.grid import dense, rel_err
from tests.helpers import fill_random_bytes
from vllm.attention import allocate_kv_cache
from vllm.attention.backend import AttentionLayerSpec
from vllm.attention.backends.flashinfer import FLASHINFER_KERNEL, FlashInferBackend
from vllm.attention.backends.rocm_aiter_fa import AITER_FA_VARLEN, RocmAiterFABackend
from vllm.attention.backends.rocm_aiter_unified_attn import AITER_UNIFIED
from vllm.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl
from vllm.attention.backends.vendor_kernels import (
    FLASH_ATTN_2,
    FLASH_ATTN_CUTE,
    VendorCall,
    VendorKernel,
)
from vllm.attention.batch import make_paged_batch
from vllm.attention.layer import Attention
from vllm.attention.ops.paged_kv import PagedKV
from vllm.attention.types import KVCacheDType, KVCacheLayout, KVQuant
from vllm.forward_context import set_forward_context

CPU = torch.device("cpu")


def _call(*, dtype: torch.dtype = torch.bfloat16, cache_dtype: KVCacheDType = "auto",
          block_size: int = 16, layout: KVCacheLayout = KVCacheLayout.SPLIT_NHD,
          per_head: bool = False, sliding_window: int | None = None,
          soft_cap: float | None = None, causal: bool = True,
          tree: bool = False) -> VendorCall:
    h, d = 2, 64
    batch = make_paged_batch([3, 1], [5, 20], block_size=block_size)
    backend = {KVCacheLayout.SPLIT_NHD: TritonAttentionBackend,
               KVCacheLayout.AITER_SHUFFLED: RocmAiterFABackend}[layout]
    cache = allocate_kv_cache(backend, num_blocks=batch.num_blocks, block_size=block_size,
                              num_kv_heads=h, head_size=d, cache_dtype=cache_dtype,
                              model_dtype=dtype, device="cpu")
    scale = torch.ones(h if per_head else 1)
    quant = KVQuant(cache_dtype, scale, scale)
    spec = AttentionLayerSpec(num_heads=4, head_size=d, num_kv_heads=h, scale=0.125,
                              sliding_window=sliding_window, logits_soft_cap=soft_cap,
                              kv_cache_dtype=cache_dtype)
    kv = PagedKV.from_cache(cache, layout, quant, block_size=block_size, num_kv_heads=h,
                            head_size=d)
    meta = TritonAttentionBackend.get_builder_cls()(spec, CPU).build(batch.common)
    q = torch.zeros(4, 4, d, dtype=dtype)
    return VendorCall(spec=spec, query=q, kv_cache=cache, kv=kv, meta=meta,
                      output=torch.empty_like(q), causal=causal, layout=layout,
                      tree_mask=torch.ones(4, 3, dtype=torch.bool) if tree else None)


@pytest.mark.parametrize(("kernel", "call", "needle"), [
    (FLASH_ATTN_CUTE, dict(), None),
    (FLASH_ATTN_CUTE, dict(block_size=32, soft_cap=5.0, sliding_window=9), None),
    (FLASH_ATTN_CUTE, dict(dtype=torch.float32), "dtype=float32, takes bfloat16/float16"),
    (FLASH_ATTN_CUTE, dict(cache_dtype="fp8"), "kv_cache_dtype='fp8', takes auto"),
    (FLASH_ATTN_CUTE, dict(block_size=64), "block_size=64, takes a multiple of 16 up to 48"),
    (FLASH_ATTN_CUTE, dict(tree=True), "a draft-tree mask"),
    (FLASH_ATTN_CUTE, dict(sliding_window=9, causal=False), "sliding_window=9 on non-causal"),
    (FLASH_ATTN_2, dict(), "block_size=16, takes a multiple of 256"),
    (FLASHINFER_KERNEL, dict(cache_dtype="fp8_e5m2"), None),
    (FLASHINFER_KERNEL, dict(cache_dtype="fp8", per_head=True), "per kv head (2), takes one scale"),
    (FLASHINFER_KERNEL, dict(block_size=48), "block_size=48, takes 16, 32, 64"),
    (AITER_UNIFIED, dict(causal=False), "layout=split_nhd"),
    (AITER_FA_VARLEN, dict(layout=KVCacheLayout.AITER_SHUFFLED, cache_dtype="fp8", per_head=True), None),
    (AITER_FA_VARLEN, dict(layout=KVCacheLayout.AITER_SHUFFLED, soft_cap=5.0), "logits_soft_cap=5.0, takes none"),
])
def test_vendor_kernel_takes_or_says_why(kernel: VendorKernel, call: dict[str, object],
                                         needle: str | None) -> None:
    why = kernel.rejects(_call(**call))  # type: ignore[arg-type]
    if needle is None:
        assert why is None
    else:
        assert why is not None and needle in why, why


def test_unified_aiter_is_causal_only() -> None:
    call = dataclasses.replace(_call(), layout=KVCacheLayout.SPLIT_KV_FIRST, causal=False)
    assert AITER_UNIFIED.rejects(call) == "non-causal attention, takes causal only"


@pytest.mark.parametrize(("kernel", "needle"), [
    (FLASH_ATTN_CUTE, "device=cpu, flash_attn needs CUDA"),
    (FLASHINFER_KERNEL, "device=cpu, flashinfer needs CUDA"),
    (AITER_UNIFIED, "device=cpu, aiter needs ROCm"),
])
def test_vendor_kernels_never_import_off_platform(kernel: VendorKernel, needle: str) -> None:
    assert kernel.unavailable_reason(CPU) == needle


# -- dispatch ---------------------------------------------------------------------------

@dataclass(frozen=True)
class _FakeKernel(VendorKernel):
    """Runs 'here' (CPU) and computes with the float64 oracle, counting calls."""

    calls: list[str] = dataclasses.field(default_factory=list)

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None

    def run(self, call: VendorCall) -> None:
        self.calls.append(call.kv.cache_dtype)
        starts = call.meta.query_start_loc_cpu.tolist()
        lens = call.meta.seq_lens_cpu.tolist()
        from vllm.attention.ops.paged_attention import read_request

        for i in range(call.meta.num_reqs):
            k, v = read_request(call.kv, call.meta.block_table[i], int(lens[i]), torch.float64)
            out = dense(call.query[starts[i]:starts[i + 1]], k, v, scale=call.spec.scale,
                        causal=call.causal)
            call.output[starts[i]:starts[i + 1]] = out.to(call.output.dtype)


FAKE = _FakeKernel(name="fake.kernel", module="unused", platform="cuda",
                   layouts=frozenset({KVCacheLayout.SPLIT_NHD}))


class _FakeVendorBackend(TritonAttentionBackend):
    name: ClassVar[str] = "FAKE_VENDOR"
    vendor_kernels = (FAKE,)

    @classmethod
    def get_impl_cls(cls) -> type[_FakeVendorImpl]:
        return _FakeVendorImpl


class _FakeVendorImpl(TritonAttentionImpl):
    backend = _FakeVendorBackend


@pytest.mark.parametrize(("cache_dtype", "path"), [("auto", "fake.kernel"), ("fp8", "torch")])
def test_impl_runs_the_vendor_kernel_or_falls_back(cache_dtype: KVCacheDType, path: str) -> None:
    g = torch.Generator().manual_seed(3)
    batch = make_paged_batch([6, 1, 2], [0, 17, 31], block_size=16, generator=g)
    layer = Attention(num_heads=4, num_kv_heads=2, head_size=64, scale=0.125,
                      backend=_FakeVendorBackend, layer_name="l", kv_cache_dtype=cache_dtype)
    cache = allocate_kv_cache(_FakeVendorBackend, num_blocks=batch.num_blocks, block_size=16,
                              num_kv_heads=2, head_size=64, cache_dtype=cache_dtype,
                              model_dtype=torch.bfloat16, device="cpu")
    fill_random_bytes(cache, 3)
    layer.bind_kv_cache(cache, 16)
    n_ctx = batch.context_slots.numel()
    k = torch.randn(n_ctx, 2, 64, generator=g).bfloat16()
    layer.kv_cache_writer.write(k, k, cache, batch.context_slots, layer.kv_quant)
    n = batch.new_slots.numel()
    q, kn = torch.randn(n, 4, 64, generator=g).bfloat16(), torch.randn(n, 2, 64, generator=g).bfloat16()
    meta = _FakeVendorBackend.get_builder_cls()(layer.spec, CPU).build(batch.common)
    FAKE.calls.clear()
    with set_forward_context(attn_metadata={"l": meta}, slot_mapping={"l": batch.new_slots}):
        out = layer(q, kn, kn)
    assert layer.impl.last_compute_path == path
    if path == "torch":
        assert FAKE.calls == []
        assert layer.impl.last_fallbacks == ["fake.kernel: kv_cache_dtype='fp8', takes auto"]
        assert _FakeVendorBackend.compute_path(CPU) == "fake.kernel"
        assert any("fake.kernel takes dtype" in n for n in _FakeVendorBackend.compute_path_notes(CPU))
    else:
        assert FAKE.calls == ["auto"] and layer.impl.last_fallbacks == []
    assert not torch.isnan(out).any()


# -- per-backend metadata ---------------------------------------------------------------

def test_flashinfer_metadata_is_csr_of_the_used_pages() -> None:
    g = torch.Generator().manual_seed(0)
    bs = 16
    qlens, clens = [5, 1, 1], [0, 31, 32]  # last pages: 5 of 16, full, 1 of 16
    batch = make_paged_batch(qlens, clens, block_size=bs, generator=g)
    spec = AttentionLayerSpec(num_heads=4, head_size=64, num_kv_heads=2, scale=0.125)
    meta = FlashInferBackend.get_builder_cls()(spec, CPU).build(batch.common)
    assert meta.paged_kv_indptr_cpu.tolist() == [0, 1, 3, 6]
    assert meta.paged_kv_last_page_len_cpu.tolist() == [5, 16, 1]
    table = batch.common.block_table
    want = table[0, :1].tolist() + table[1, :2].tolist() + table[2, :3].tolist()
    assert meta.paged_kv_indices.tolist() == want
    assert meta.paged_kv_indices.dtype == torch.int32
    assert not hasattr(meta, "slot_mapping")


def test_aiter_fa_metadata_has_key_offsets() -> None:
    batch = make_paged_batch([4, 1], [0, 20], block_size=16)
    spec = AttentionLayerSpec(num_heads=4, head_size=64, num_kv_heads=2, scale=0.125)
    meta = RocmAiterFABackend.get_builder_cls()(spec, CPU).build(batch.common)
    assert meta.cu_seqlens_k.tolist() == [0, 4, 25] and meta.num_kv_tokens == 25


def test_encoder_only_attends_to_this_steps_tokens() -> None:
    from vllm.attention.registry import get_backend
    from vllm.attention.types import AttentionType

    g = torch.Generator().manual_seed(5)
    for name in ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"):
        b = get_backend(name)
        batch = make_paged_batch([7, 3], [0, 0], block_size=16, generator=g, causal=False)
        layer = Attention(num_heads=4, num_kv_heads=2, head_size=64, scale=0.125, backend=b,
                          layer_name="enc", attn_type=AttentionType.ENCODER_ONLY)
        assert not layer.writes_kv_cache
        meta = b.get_builder_cls()(layer.spec, CPU).build(batch.common)
        q = torch.randn(10, 4, 64, generator=g).half()
        k = torch.randn(10, 2, 64, generator=g).half()
        v = torch.randn(10, 2, 64, generator=g).half()
        with set_forward_context(attn_metadata={"enc": meta}, slot_mapping={"enc": batch.new_slots}):
            out = layer(q, k, v)
        for s, e in ((0, 7), (7, 10)):
            ref = dense(q[s:e], k[s:e], v[s:e], scale=0.125, causal=False)
            assert rel_err(out[s:e], ref) < 5e-3
        assert math.isfinite(float(out.float().sum()))


# -- the portable paths' own choices ------------------------------------------------------

def _flex_layer_step(monkeypatch: pytest.MonkeyPatch) -> tuple[Attention, torch.Tensor]:
    """One FLEX_ATTENTION step through the layer on CPU with the flex path allowed here
    (on CPU the backend otherwise runs torch); returns the layer and the float64 error."""
    from vllm.attention.backends import standard
    from vllm.attention.backends.flex_attention import FlexAttentionBackend

    monkeypatch.setattr(standard, "_flex_unavailable", lambda device: None)
    g = torch.Generator().manual_seed(11)
    batch = make_paged_batch([6, 1], [0, 40], block_size=16, generator=g)
    layer = Attention(num_heads=4, num_kv_heads=2, head_size=64, scale=0.125,
                      backend=FlexAttentionBackend, layer_name="f")
    cache = allocate_kv_cache(FlexAttentionBackend, num_blocks=batch.num_blocks, block_size=16,
                              num_kv_heads=2, head_size=64, model_dtype=torch.float32,
                              device="cpu")
    fill_random_bytes(cache, 4)
    layer.bind_kv_cache(cache, 16)
    k_ctx = torch.randn(batch.context_slots.numel(), 2, 64, generator=g)
    layer.kv_cache_writer.write(k_ctx, k_ctx, cache, batch.context_slots, layer.kv_quant)
    n = batch.new_slots.numel()
    q, k = torch.randn(n, 4, 64, generator=g), torch.randn(n, 2, 64, generator=g)
    meta = FlexAttentionBackend.get_builder_cls()(layer.spec, CPU).build(batch.common)
    with set_forward_context(attn_metadata={"f": meta}, slot_mapping={"f": batch.new_slots}):
        out = layer(q, k, k)
    keys = [torch.cat([k_ctx[:0], k[:6]]), torch.cat([k_ctx, k[6:]])]
    errs = [rel_err(out[s:e], dense(q[s:e], kk.double(), kk.double(), scale=0.125, causal=True))
            for (s, e), kk in zip(((0, 6), (6, 7)), keys)]
    return layer, torch.tensor(errs)


def test_flex_path_says_when_it_ran_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    layer, errs = _flex_layer_step(monkeypatch)
    assert float(errs.max()) < 1e-4
    assert layer.impl.last_compute_path == "flex_attention.eager"  # eager by choice on CPU
    assert layer.impl.last_fallbacks == []


def test_flex_path_records_why_the_compiled_kernel_did_not_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import functools

    from vllm.attention.ops import flex_paged

    class InductorError(RuntimeError):
        pass

    def failing(*args: object, **kwargs: object) -> torch.Tensor:
        raise InductorError("LoweringException: NoValidChoicesError")

    monkeypatch.setattr(flex_paged, "_compiled_flex", lambda: failing)
    monkeypatch.setattr(flex_paged, "flex_paged_attention",
                        functools.partial(flex_paged.flex_paged_attention, compiled=True))
    layer, errs = _flex_layer_step(monkeypatch)
    assert float(errs.max()) < 1e-4
    assert layer.impl.last_compute_path == "flex_attention.eager"
    assert len(layer.impl.last_fallbacks) == 1
    assert "NoValidChoicesError" in layer.impl.last_fallbacks[0]


def test_runnable_paths_and_notes_name_the_portable_paths() -> None:
    from vllm.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.attention.backends.flex_attention import FlexAttentionBackend

    assert TritonAttentionBackend.runnable_paths(CPU) == ["torch"]
    assert FlexAttentionBackend.runnable_paths(CPU) == ["torch"]
    assert FlashAttentionBackend.runnable_paths(CPU) == ["torch"]  # no vendor kernel on CPU
    notes = " ".join(FlexAttentionBackend.compute_path_notes(CPU))
    assert "flex_attention: device=cpu" in notes


@pytest.mark.gpu
def test_cuda_runnable_paths_and_notes() -> None:
    from vllm.attention.backends.flex_attention import FlexAttentionBackend
    from vllm.attention.ops.flash_varlen import flash_varlen_unavailable

    cuda = torch.device("cuda")
    paths = TritonAttentionBackend.runnable_paths(cuda)
    notes = " ".join(TritonAttentionBackend.compute_path_notes(cuda))
    if flash_varlen_unavailable(cuda) is None:
        assert paths[:2] == ["flash_varlen", "triton"] and "flash_varlen takes" in notes
    else:
        assert "flash_varlen (prefill)" in notes
    flex_notes = " ".join(FlexAttentionBackend.compute_path_notes(cuda))
    assert "torch.compile(flex_attention" in flex_notes
    assert FlexAttentionBackend.runnable_paths(cuda)[:2] == ["flex_attention", "flex_attention.eager"]
