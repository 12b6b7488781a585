"""The tiled token-major scatter (several tokens per program, loads that do not wait
for the slot): byte-identical to the generic kernel and to the torch reference, also
with BLOCK_T > 1 and a partial last tile. Under Triton's interpreter (integer fp8
rounding); the hardware-conversion variant is compile-checked in
tools/triton_compile_check.py and compared on the GPU by tests/writers."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import every_16_bit_pattern, fill_random_bytes, raw
from vllm.attention import KVQuant
from vllm.attention.types import KVCacheLayout
from vllm.attention.writers import MLALatentCacheWriter, SplitKVCacheWriter, reference_write
from vllm.attention.writers import kernels as tw
from vllm.attention.writers.kernels import scatter

L = KVCacheLayout
pytestmark = pytest.mark.skipif(not tw.triton_importable(),
                                reason="triton is not importable: the kernels cannot run here")
DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
CASES = [(L.SPLIT_NHD, "bf16", "auto", 1), (L.SPLIT_HND, "fp32", "fp8_e4m3", 2),
         (L.SPLIT_KV_FIRST, "fp16", "fp8_e5m2", 1), (L.SPLIT_BLOCK_INTERLEAVED, "bf16",
                                                     "fp8_e4m3", 2)]


@pytest.fixture(params=["tiled-BT8", "generic"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "generic":
        monkeypatch.setenv("VLLM_KV_SCATTER_KERNEL", "generic")
    else:
        monkeypatch.setattr(scatter, "TILED_MIN_TOKENS", 1)  # several tokens per program
    return str(request.param)


def _cache(layout: KVCacheLayout, storage: torch.dtype) -> torch.Tensor:
    from vllm.attention.layouts import kv_cache_shape, kv_cache_stride_order

    shape = kv_cache_shape(layout, 4, 8, 2, 32)
    order = kv_cache_stride_order(layout)
    phys = torch.empty([shape[i] for i in order], dtype=storage)
    fill_random_bytes(phys, 7)
    return phys.permute(*[order.index(i) for i in range(len(order))])


def _scales(kind: str, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V scales: ``random`` (never a power of two), ``pow2`` (every head a power of
    two, the multiply path; the extremes 2**-126 and 2**126 overflow and underflow the
    quotient; positive, as ``KVQuant`` requires of CPU scales), ``mixed`` (one head of
    each: the division path)."""
    if kind == "random":
        return torch.rand(n, generator=g) + 0.5, torch.rand(n, generator=g) + 0.5
    if kind == "pow2":
        k = [1.0] if n == 1 else [0.25, 2.0**-126]
        v = [2.0**-3] if n == 1 else [2.0**126, 4.0]
        return torch.tensor(k), torch.tensor(v)
    return torch.tensor([0.5, 0.3][:n]), torch.tensor([0.7, 2.0][:n])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("scales", ["random", "pow2", "mixed"])
@pytest.mark.parametrize(("layout", "dtype", "cache_dtype", "nscale"), CASES,
                         ids=[f"{c[0].value}-{c[1]}-{c[2]}" for c in CASES])
def test_tiled_equals_reference(layout: KVCacheLayout, dtype: str, cache_dtype: str,
                                nscale: int, scales: str, kernel: str) -> None:
    g = torch.Generator().manual_seed(1)
    t = 13  # a partial last tile of 8
    key = (torch.randn(t + 2, 2, 32, generator=g) * 100).to(DT[dtype])
    value = (torch.randn(t + 2, 2, 32, generator=g) * 100).to(DT[dtype])
    slots = torch.randperm(32, generator=g)[:t]
    slots[[0, 9]] = -1
    if cache_dtype == "auto" and scales != "random":
        pytest.skip("scales are not read for an unquantised cache")
    quant = KVQuant(cache_dtype, *_scales(scales, nscale, g))  # type: ignore[arg-type]
    storage = FP8.get(cache_dtype, DT[dtype])
    got, want = _cache(layout, storage), _cache(layout, storage)
    writer = SplitKVCacheWriter(layout)
    writer.write(key, value, got, slots, quant, path="triton")
    reference_write(layout, key, value, want, slots, quant)
    assert torch.equal(raw(got), raw(want))


def _mla_caches(view: str, storage: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Two equal ``[3, 8, 80]`` MLA cache views of random bytes and their base tensors:
    ``contiguous`` and ``padded-rows`` (rows 80 of 96 wide) have each block follow the
    last (the kernel's SLOT_LINEAR), ``strided-blocks`` (every other block of a larger
    tensor) does not."""
    shape = {"contiguous": (3, 8, 80), "padded-rows": (3, 8, 96), "strided-blocks": (6, 8, 80)}
    base = torch.empty(shape[view], dtype=storage)
    fill_random_bytes(base, 3)
    other = base.clone()

    def cut(b: torch.Tensor) -> torch.Tensor:
        return b[..., :80] if view == "padded-rows" else b[::2] if view == "strided-blocks" else b

    return cut(base), cut(other), base, other


@pytest.mark.parametrize("view", ["contiguous", "padded-rows", "strided-blocks"])
@pytest.mark.parametrize(("cache_dtype", "scale"), [("auto", 0.3), ("fp8_e4m3", 0.3),
                                                   ("fp8_e4m3", 1.0), ("fp8_e4m3", 0.125)])
def test_tiled_mla_latent_equals_reference(cache_dtype: str, scale: float, kernel: str,
                                           view: str) -> None:
    g = torch.Generator().manual_seed(2)
    t = 11
    kv_c = torch.randn(t, 64, generator=g).to(torch.bfloat16)
    k_pe = torch.randn(t, 16, generator=g).to(torch.bfloat16)
    slots = torch.randperm(24, generator=g)[:t]
    slots[3] = -1
    quant = KVQuant(cache_dtype, torch.tensor([scale]), torch.tensor([scale]))  # type: ignore[arg-type]
    storage = torch.bfloat16 if cache_dtype == "auto" else torch.float8_e4m3fn
    got, want, got_base, want_base = _mla_caches(view, storage)
    MLALatentCacheWriter().write(kv_c, k_pe, got, slots, quant, path="triton")
    reference_write(L.MLA_LATENT, kv_c, k_pe, want, slots, quant)
    assert torch.equal(raw(got_base), raw(want_base))  # the padding and other blocks too


def test_kernel_choice() -> None:
    from vllm.attention.layouts import legacy_paged_views, split_kv_views

    cache = torch.zeros(2, 2, 16, 2, 8)
    k, v = split_kv_views(cache, L.SPLIT_HND)
    token_major = (tw.ScatterTarget.token_major(k), tw.ScatterTarget.token_major(v))
    assert tw.scatter_kernel_for(*token_major) == "tiled"
    k5, v4 = legacy_paged_views(torch.zeros(2, 2, 16 * 2 * 8), 2, 8)
    assert tw.scatter_kernel_for(tw.ScatterTarget.x_split_key(k5),
                                 tw.ScatterTarget.head_major_value(v4)) == "generic"
    # SLOT_LINEAR: blocks one after another (split K-first, MLA, padded rows), not when
    # K and V blocks interleave (split NHD) or blocks are strided
    assert not token_major[0].slot_linear
    kf = split_kv_views(torch.zeros(2, 2, 16, 2, 8), L.SPLIT_KV_FIRST)[0]
    assert tw.ScatterTarget.token_major(kf).slot_linear
    for mla, linear in ((torch.zeros(3, 8, 80), True), (torch.zeros(3, 8, 96)[..., :80], True),
                        (torch.zeros(6, 8, 80)[::2], False)):
        assert tw.ScatterTarget.token_major(mla[..., None, :64]).slot_linear is linear
    assert tw.tokens_per_program(1, 1024) == 1
    assert tw.tokens_per_program(65536, 1024) == 2  # split bf16 and fp8, H=8, D=128
    assert tw.tokens_per_program(65536, 512) == 4  # MLA latent bf16 and fp8
    assert tw.tokens_per_program(65536, 64) == 16
    assert not tw.hardware_fp8(torch.device("cpu"))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_scalar_scale_every_bf16_pattern(monkeypatch: pytest.MonkeyPatch) -> None:
    """One scale for every head (``SCALAR_S``): every bf16 bit pattern against powers of
    two (multiplied by the reciprocal), their out-of-range neighbours and other scales
    (divided), byte for byte with the reference. A quotient multiplied where it must be
    divided rounds differently for some inputs at 7.0 (the GPU test does every scale of
    ``tests/writers/test_writers_gpu.py``)."""
    monkeypatch.setattr(scatter, "TILED_MIN_TOKENS", 1)  # several tokens per program: faster here
    cache_dtype = "fp8_e4m3"
    x = every_16_bit_pattern(torch.bfloat16, 4)
    value = x.flip(0).contiguous()
    n = x.shape[0]
    g = torch.Generator().manual_seed(5)
    for scale in (1.0, 2.0**-126, 2.0**127, 7.0):
        slots = torch.randperm(n + 8, generator=g)[:n]
        storage = FP8[cache_dtype]
        got = torch.zeros(-(-(n + 8) // 8), 2, 8, 4, 128, dtype=storage)
        want = got.clone()
        quant = KVQuant(cache_dtype, torch.tensor([scale]), torch.tensor([scale]))  # type: ignore[arg-type]
        SplitKVCacheWriter(L.SPLIT_NHD).write(x, value, got, slots, quant, path="triton")
        reference_write(L.SPLIT_NHD, x, value, want, slots, quant)
        diff = (raw(got) != raw(want)).nonzero()
        assert diff.numel() == 0, f"scale {scale}: {diff.shape[0]} byte(s) differ"


def test_mla_writer_launch_loads_its_one_scale_once() -> None:
    """The MLA writer's launch declares SAME_SCALE (its k_scale serves both parts) and,
    on a contiguous cache, SLOT_LINEAR; the split writer's declares neither."""
    from vllm.attention.writers.launch_cache import signature_of, write_meta

    s = torch.tensor([0.37])
    quant = KVQuant("fp8_e4m3", s, s)
    kv_c, k_pe = torch.randn(3, 64).to(torch.bfloat16), torch.randn(3, 1, 16).to(torch.bfloat16)
    cache = torch.zeros(2, 8, 80, dtype=torch.float8_e4m3fn)
    slots = torch.tensor([0, 5, 9])
    w = MLALatentCacheWriter()
    w.write(kv_c, k_pe, cache, slots, quant, path="triton")
    run = w._runners.get(signature_of(write_meta(kv_c, k_pe, slots), cache, quant, "triton"))
    assert isinstance(run, tw.CachedLaunch)
    live = (kv_c.unsqueeze(1), k_pe, cache, slots, s, s)
    consts = run._build(live).constexprs
    assert consts["SAME_SCALE"] and consts["SLOT_LINEAR"]
    key, value = torch.randn(3, 2, 32).to(torch.bfloat16), torch.randn(3, 2, 32).to(torch.bfloat16)
    split_cache = torch.zeros(2, 2, 8, 2, 32, dtype=torch.float8_e4m3fn)
    sw = SplitKVCacheWriter(L.SPLIT_NHD)
    sw.write(key, value, split_cache, slots, quant, path="triton")
    srun = next(iter(sw._runners.values()))
    assert isinstance(srun, tw.CachedLaunch)
    sconsts = srun._build((key, value, split_cache, slots, s, s)).constexprs
    assert not sconsts["SAME_SCALE"] and not sconsts["SLOT_LINEAR"]


@pytest.mark.parametrize("hints", [1, 4, 5])
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_e4m3"])
def test_cache_hints_store_the_same_bytes(cache_dtype: str, hints: int) -> None:
    """``CACHE_HINTS`` (L2 eviction hints on the row loads and cache stores, a launch
    variant ``tune_writers.py`` times) changes no byte: the MLA latent launch with them
    against the reference writer, over a cache of random bytes."""
    import dataclasses

    from vllm.attention.layouts import mla_latent_views

    g = torch.Generator().manual_seed(6)
    t = 9
    kv_c = torch.randn(t, 1, 64, generator=g).to(torch.bfloat16)
    k_pe = torch.randn(t, 1, 16, generator=g).to(torch.bfloat16)
    slots = torch.randperm(24, generator=g)[:t]
    slots[4] = -1
    scale = torch.tensor([0.3])
    quant = KVQuant(cache_dtype, scale, scale)  # type: ignore[arg-type]
    storage = torch.bfloat16 if cache_dtype == "auto" else torch.float8_e4m3fn
    got, want, got_base, want_base = _mla_caches("contiguous", storage)
    latent, rope = mla_latent_views(got, 64)
    base = tw.scatter_kv_launch(kv_c, k_pe, tw.ScatterTarget.token_major(latent.unsqueeze(2)),
                                tw.ScatterTarget.token_major(rope.unsqueeze(2)), slots,
                                0 if cache_dtype == "auto" else 1, scale, scale,
                                same_scale=True)
    assert base.kernel == "scatter_kv_tiled_kernel" and base.constexprs["CACHE_HINTS"] == 0
    dataclasses.replace(base, constexprs={**base.constexprs, "CACHE_HINTS": hints}).run()
    reference_write(L.MLA_LATENT, kv_c[:, 0], k_pe, want, slots, quant)
    assert torch.equal(raw(got_base), raw(want_base))
