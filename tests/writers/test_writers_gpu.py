"""The writers on CUDA: the Triton kernels (the default there) and the torch
reference, each against the independent oracle; the two byte-identical on
rounding edges; int64 addressing past 2**31 elements; CUDA-graph capture.

Marked ``gpu``: skipped (with the reason) without CUDA. The Triton tests also skip,
with the reason, where Triton is not importable.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.helpers import any_scale_quant, every_16_bit_pattern, fill_random_bytes
from tests.writers.oracle import Case, L, all_cases, check, edge_values, prepare, write
from vllm.attention import KVQuant
from vllm.attention.writers import (
    FP8DsMLACacheWriter,
    MLALatentCacheWriter,
    PerTokenHeadKVCacheWriter,
    SplitKVCacheWriter,
    mla_writer_for_layout,
    writer_for_layout,
)
from vllm.attention.writers.kernels import triton_importable
from vllm.attention.writers.readback import read_slots

pytestmark = pytest.mark.gpu

CASES = all_cases()
needs_triton = pytest.mark.skipif(not triton_importable(),
                                  reason="triton is not importable: no Triton kernels to test")


def _writer_path(case: Case) -> str:
    dev = torch.device("cuda")
    if case.mla:
        return mla_writer_for_layout(case.layout).path(dev)  # type: ignore[attr-defined, no-any-return]
    return writer_for_layout(case.layout).path(dev)  # type: ignore[attr-defined, no-any-return]


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_triton_writer_cuda(case: Case) -> None:
    assert _writer_path(case) == "triton"
    w = prepare(case, "cuda", seed=zlib.crc32(case.id.encode()))
    write(w, None)
    check(w)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_torch_reference_cuda(case: Case) -> None:
    w = prepare(case, "cuda", seed=zlib.crc32(case.id.encode()))
    write(w, "torch")
    check(w)


@needs_triton
@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_rounding_edges_cuda(cache_dtype: str) -> None:
    d = 128
    x = edge_values()
    rows = -(-x.numel() // d)
    key = torch.cat([x, torch.ones(rows * d - x.numel())]).view(rows, 1, d)
    fp8 = torch.float8_e4m3fn if cache_dtype == "fp8_e4m3" else torch.float8_e5m2
    writer = SplitKVCacheWriter(L.SPLIT_NHD)
    slots = torch.arange(rows, dtype=torch.int64)
    out = {}
    for device, path in (("cpu", "torch"), ("cuda", "torch"), ("cuda", "triton")):
        quant = KVQuant(cache_dtype, torch.ones(1, device=device),  # type: ignore[arg-type]
                        torch.ones(1, device=device))
        cache = torch.zeros(rows, 2, 1, 1, d, dtype=torch.uint8, device=device).view(fp8)
        writer.write(key.to(device), key.to(device), cache, slots.to(device), quant,
                     path=path)  # type: ignore[arg-type]
        out[(device, path)] = cache.view(torch.uint8).cpu()
    assert torch.equal(out[("cpu", "torch")], out[("cuda", "torch")])
    assert torch.equal(out[("cpu", "torch")], out[("cuda", "triton")])


@needs_triton
@pytest.mark.parametrize("cache_dtype", ["int8_per_token_head", "fp8_per_token_head"])
def test_per_token_head_edges_cuda(cache_dtype: str) -> None:
    h, d = 8, 16
    x = edge_values()
    key = x[: x.numel() // (h * d) * (h * d)].view(-1, h, d)
    rows = key.shape[0]
    slots = torch.arange(rows, dtype=torch.int64)
    out = {}
    for device, path in (("cpu", "torch"), ("cuda", "torch"), ("cuda", "triton")):
        quant = KVQuant(cache_dtype, torch.ones(1, device=device),  # type: ignore[arg-type]
                        torch.ones(1, device=device))
        cache = torch.zeros(rows, 2, 1, h, d + 4, dtype=torch.uint8, device=device)
        PerTokenHeadKVCacheWriter().write(key.to(device), key.to(device), cache,
                                          slots.to(device), quant, path=path)  # type: ignore[arg-type]
        out[(device, path)] = cache.cpu()
    assert torch.equal(out[("cpu", "torch")], out[("cuda", "torch")])
    assert torch.equal(out[("cpu", "torch")], out[("cuda", "triton")])


@needs_triton
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_fp8_ds_mla_edges_cuda(in_dtype: torch.dtype) -> None:
    x = edge_values()
    x = x[: x.numel() // 512 * 512].view(-1, 512).to(in_dtype)
    pe = edge_values()[: x.shape[0] * 64].view(-1, 64).to(in_dtype)
    rows = x.shape[0]
    slots = torch.arange(rows, dtype=torch.int64)
    out = {}
    for device, path in (("cpu", "torch"), ("cuda", "torch"), ("cuda", "triton")):
        quant = KVQuant("fp8_ds_mla", torch.ones(1, device=device), torch.ones(1, device=device))
        cache = torch.zeros(rows, 1, 656, dtype=torch.uint8, device=device)
        FP8DsMLACacheWriter().write(x.to(device), pe.to(device), cache, slots.to(device), quant,
                                    path=path)  # type: ignore[arg-type]
        out[(device, path)] = cache.cpu()
    assert torch.equal(out[("cpu", "torch")], out[("cuda", "torch")])
    assert torch.equal(out[("cpu", "torch")], out[("cuda", "triton")])


@needs_triton
def test_cache_past_2_pow_31_elements() -> None:
    """Slots whose element offset does not fit in int32 land where they should."""
    bs, h, d = 16, 8, 128
    per_block = 2 * bs * h * d
    nb = 2**31 // per_block + 4
    cache = torch.zeros(nb, 2, bs, h, d, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    slots = torch.tensor([0, nb * bs - 1, (nb - 2) * bs + 3, -1], device="cuda")
    key = torch.randn(4, h, d, device="cuda", dtype=torch.bfloat16)
    value = torch.randn(4, h, d, device="cuda", dtype=torch.bfloat16)
    quant = KVQuant("fp8_e4m3", torch.ones(1, device="cuda"), torch.ones(1, device="cuda"))
    SplitKVCacheWriter(L.SPLIT_NHD).write(key, value, cache, slots, quant)
    got = read_slots(L.SPLIT_NHD, cache, slots[:3])
    want_k = key[:3].float().clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    want_v = value[:3].float().clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(got[0].view(torch.uint8), want_k)
    assert torch.equal(got[1].view(torch.uint8), want_v)
    # and nothing else: every other byte of the 2 GiB cache is still zero
    nonzero = int(cache.view(torch.uint8).count_nonzero())
    assert nonzero == int(want_k.count_nonzero()) + int(want_v.count_nonzero())
    del cache
    torch.cuda.empty_cache()


@needs_triton
def test_triton_write_captures_in_a_cuda_graph() -> None:
    """The Triton write has no host sync: it can be captured and replayed with new slots."""
    case = Case(L.SPLIT_NHD, "bf16", "fp8_e4m3", 16, "scale_per_head")
    w = prepare(case, "cuda", seed=3)
    writer = writer_for_layout(case.layout)
    slots = w.slots.clone()
    writer.write(w.key, w.value, w.cache, slots, w.quant)  # compile outside the capture
    w.storage.copy_(w.before)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        writer.write(w.key, w.value, w.cache, slots, w.quant)
    w.storage.copy_(w.before)
    graph.replay()
    check(w)
    other = prepare(case, "cuda", seed=4)  # same shapes, other slots
    slots.copy_(other.slots)
    w.storage.copy_(w.before)
    w.slots = other.slots
    graph.replay()
    check(w)


def _division_scales(gen: torch.Generator) -> list[float]:
    """Scales that stress a per-element division: log-uniform ones, powers of two (the
    multiply path), mantissas next to 1 and 2, and values whose reciprocals round badly."""
    # two chunks of 4 heads (the kernel multiplies when every head's scale is a power of
    # two with a normal reciprocal), one with an out-of-range power (2**127: divides)
    special = [1.0, 2.0**-126, 2.0**126, -0.5, 2.0**127, 1.0, 2.0**-3, 64.0]
    special += [1.0, 2.0**-20, 2.0**12, 3.0, 0.1, 1 / 3, 7.0, 448.0 / 3]
    special += [float(torch.nextafter(torch.tensor(v), torch.tensor(0.0)))
                for v in (1.0, 2.0, 4.0)]
    special += [float(torch.nextafter(torch.tensor(v), torch.tensor(10.0)))
                for v in (1.0, 2.0, 0.5)]
    # both edges of FAST_DIV's moderate range, 2**-30 <= s < 2**30 (_scale_kind; a
    # negative one is divided by IEEE division)
    special += [1.5 * 2.0**-30, -1.75 * 2.0**29, 1.25 * 2.0**-31,
                float(torch.nextafter(torch.tensor(2.0**30), torch.tensor(0.0)))]
    special += [float(v) for v in (10.0 ** (torch.rand(48, generator=gen) * 8 - 4))]
    # reciprocals that overflow (zero, subnormal: the per-element fallback), a subnormal
    # with a finite reciprocal, and near the top of the float32 range
    special += [0.0, 1e-39, 2.0**-127, 1e38, 3e38]
    return [float(torch.tensor(v, dtype=torch.float32)) for v in special]


@needs_triton
@pytest.mark.parametrize("scales_per", ["head", "tensor"])
@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("in_dtype", ["bf16", "fp16", "fp32"])
def test_fast_division_is_byte_identical_exhaustively(in_dtype: str, cache_dtype: str,
                                                      scales_per: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiled kernel's quantiser (a multiply by the reciprocal when every scale is a
    power of two; else, for scales of moderate size, FAST_DIV: one reciprocal per head
    plus a Markstein FMA correction; or the IEEE division per element) stores exactly
    the bytes of the torch reference computed on the CPU: every bf16 / fp16 bit pattern
    (and 2**20 random fp32 patterns, specials included) against 79 scales, four heads
    at a time (8 of them in two all-power-of-two chunks) or one ``[1]`` scale at a time
    (``SCALAR_S``); with FAST_DIV on and off, and with the hardware conversion's own NaN
    (HW_NAN, where claimed) and the select after it."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{in_dtype}{cache_dtype}".encode()))
    heads = 4
    if in_dtype == "fp32":
        bits = torch.randint(-(2**31), 2**31 - 1, (2**20,), generator=gen, dtype=torch.int64)
        x = bits.to(torch.int32).view(torch.float32).view(-1, heads, 128)
    else:
        x = every_16_bit_pattern({"bf16": torch.bfloat16, "fp16": torch.float16}[in_dtype],
                                  heads)
    value = x.flip(0).contiguous()
    n = x.shape[0]
    storage = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[cache_dtype]
    scales = _division_scales(gen)
    for fast, hw_nan in (("1", ""), ("0", ""), ("1", "0")):
        monkeypatch.setenv("VLLM_KV_FAST_DIV", fast)
        monkeypatch.setenv("VLLM_KV_HW_NAN", hw_nan)
        w = SplitKVCacheWriter(L.SPLIT_NHD)
        step = heads if scales_per == "head" else 1
        for i in range(0, len(scales), step):
            chunk = (scales[i:i + step] + scales[:step])[:step]
            ks = torch.tensor(chunk, dtype=torch.float32)
            vs = ks.flip(0).contiguous()
            slots = torch.randperm(n + 16, generator=gen)[:n]
            cache = torch.zeros(-(-(n + 16) // 16), 2, 16, heads, 128, dtype=storage)
            want = cache.clone()
            SplitKVCacheWriter(L.SPLIT_NHD).write(x, value, want, slots,
                                                  any_scale_quant(cache_dtype, ks, vs),
                                                  path="torch")
            got = cache.cuda()
            w.write(x.cuda(), value.cuda(), got, slots.cuda(),
                    KVQuant(cache_dtype, ks.cuda(), vs.cuda()))
            diff = (got.cpu().view(torch.uint8) != want.view(torch.uint8)).nonzero()
            assert diff.numel() == 0, (
                f"FAST_DIV={fast} HW_NAN={hw_nan or 'default'} scales {chunk}: "
                f"{diff.shape[0]} byte(s) differ, first at "
                f"{diff[0].tolist()}")


@needs_triton
@pytest.mark.parametrize("tokens_per_program", ["one", "several"])
def test_mla_fp8_write_is_byte_identical_exhaustively(tokens_per_program: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The MLA latent fp8 write (one scale for both parts, loaded and inverted once:
    SAME_SCALE; slots addressed without a division: SLOT_LINEAR) stores exactly the
    reference's bytes: every bf16 pattern spread over the 512 latent and 64 rope values
    of 114 tokens, against every scale of the split test, one and several tokens a
    program, with FAST_DIV on and off."""
    from vllm.attention.writers.kernels import scatter

    if tokens_per_program == "several":
        monkeypatch.setattr(scatter, "TILED_MIN_TOKENS", 1)
    gen = torch.Generator().manual_seed(11)
    x = every_16_bit_pattern(torch.bfloat16, 1).reshape(-1)
    n = -(-x.numel() // 576)
    x = torch.cat([x, x[: n * 576 - x.numel()]]).view(n, 576)
    kv_c, k_pe = x[:, :512].contiguous(), x[:, 512:].contiguous().view(n, 1, 64)
    for fast in ("1", "0"):
        monkeypatch.setenv("VLLM_KV_FAST_DIV", fast)
        w = MLALatentCacheWriter()
        for scale in _division_scales(gen):
            slots = torch.randperm(n + 16, generator=gen)[:n]
            cache = torch.zeros(-(-(n + 16) // 16), 16, 576, dtype=torch.float8_e4m3fn)
            fill_random_bytes(cache, n)
            want = cache.clone()
            s = torch.tensor([scale])
            MLALatentCacheWriter().write(kv_c, k_pe, want, slots,
                                         any_scale_quant("fp8_e4m3", s, s), path="torch")
            got = cache.cuda()
            sd = s.cuda()
            w.write(kv_c.cuda(), k_pe.cuda(), got, slots.cuda(), KVQuant("fp8_e4m3", sd, sd))
            diff = (got.cpu().view(torch.uint8) != want.view(torch.uint8)).nonzero()
            assert diff.numel() == 0, (f"FAST_DIV={fast} scale {scale}: {diff.shape[0]} "
                                       f"byte(s) differ, first at {diff[0].tolist()}")


@needs_triton
@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_hardware_conversion_nan_claim(cache_dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where :func:`~vllm.attention.writers.kernels.hardware_fp8_nan` claims it, the
    hardware conversion alone stores every NaN as 0x7F: float32 NaNs of both signs
    (quiet, signalling, all-ones and random payloads) written with HW_NAN forced on,
    through the multiply (scale 1.0), FAST_DIV (0.37) and IEEE-division (2**127) paths,
    every byte 0x7F. Where it is not claimed, the probe's finding is the skip reason."""
    from vllm.attention.writers import kernels as tw

    dev = torch.device("cuda")
    if not tw.hardware_fp8(dev):
        pytest.skip("no hardware fp8 conversion here (sm_89+)")
    claimed = tw.hardware_fp8_nan(dev)
    monkeypatch.setenv("VLLM_KV_HW_NAN", "1")
    g = torch.Generator().manual_seed(5)
    payload = torch.randint(1, 2**23, (2044,), generator=g, dtype=torch.int64)
    fixed = torch.tensor([0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0x7FA00000], dtype=torch.int64)
    bits = torch.cat([fixed, 0x7F800000 | payload])
    bits = torch.cat([bits, bits | 0x80000000]).to(torch.uint32).view(torch.int32)
    x = bits.view(torch.float32).view(-1, 4, 128)  # 4096 NaNs: [8, 4, 128]
    n = x.shape[0]
    storage = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[cache_dtype]
    seen: set[int] = set()
    for scale in (1.0, 0.37, 2.0**127):
        s = torch.full((4,), scale, device=dev)
        cache = torch.zeros(1, 2, 16, 4, 128, dtype=storage, device=dev)
        SplitKVCacheWriter(L.SPLIT_NHD).write(x.to(dev), x.to(dev), cache,
                                              torch.arange(n, device=dev),
                                              KVQuant(cache_dtype, s, s.clone()))  # type: ignore[arg-type]
        seen |= set(cache[:, :, :n].view(torch.uint8).unique().tolist())
    canonical = seen == {0x7F}
    cap = torch.cuda.get_device_capability()
    if claimed:
        assert canonical, f"sm_{cap[0]}{cap[1]}: claimed, but NaNs stored as {sorted(seen)}"
    else:
        pytest.skip(f"sm_{cap[0]}{cap[1]}: HW_NAN not claimed; the conversion stored NaNs as "
                    f"{sorted(hex(b) for b in seen)}")


@needs_triton
def test_fast_reciprocal_is_the_division_for_every_scale_it_serves() -> None:
    """``_reciprocal`` with FAST_RCP (the hardware approximation and two FMA steps,
    without ``div.rn``'s range check and slow-path branch) gives the correctly rounded
    ``1 / s`` for every float32 scale it is used for: every mantissa of the exponents of
    ``_scale_kind`` 1 (2**-30 <= |s| < 2**30), both signs, and every power of two of
    kind 0; bit for bit against the IEEE division on the GPU (itself checked against
    the CPU's on a random sample) and against ``div_rn`` in the same kernel."""
    from tests.writers._rcp_probe import reciprocal_kernel

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    sample = torch.randint(97 << 23, 157 << 23, (1 << 20,), generator=gen,
                           dtype=torch.int64).to(torch.int32).view(torch.float32)
    assert torch.equal((1.0 / sample.to(dev)).cpu().view(torch.int32),
                       (1.0 / sample).view(torch.int32)), "torch's CUDA division is not IEEE"

    def check(bits: torch.Tensor) -> None:
        s = bits.to(torch.int32).view(torch.float32)
        for sign in (0, -(2**31)):
            x = (s.view(torch.int32) | sign).view(torch.float32) if sign else s
            n = x.numel()
            got = torch.empty_like(x)
            slow = torch.empty_like(x)
            grid = (-(-n // 1024),)
            reciprocal_kernel[grid](x, got, n, FAST=True, BLOCK=1024)
            reciprocal_kernel[grid](x, slow, n, FAST=False, BLOCK=1024)
            want = (1.0 / x).view(torch.int32)
            for name, r in (("fast", got), ("div_rn", slow)):
                bad = (r.view(torch.int32) != want).nonzero()
                assert bad.numel() == 0, (
                    f"{name}: {bad.shape[0]} reciprocals differ, first 1/{x[bad[0, 0]].item()!r}"
                    f" = {r[bad[0, 0]].item()!r}, IEEE {(1.0 / x[bad[0, 0]]).item()!r}")

    check(torch.arange(1, 254, device=dev, dtype=torch.int64) << 23)  # kind 0
    end, step = 157 << 23, 1 << 26
    for start in range(97 << 23, end, step):  # kind 1, in 8 chunks
        check(torch.arange(start, min(start + step, end), device=dev, dtype=torch.int64))
