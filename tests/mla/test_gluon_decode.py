"""The Gluon MLA decode (NVIDIA sm_90; 16-bit models, caches in the model's dtype or
scaled fp8): where it is taken and why not elsewhere (CPU), and its outputs against
float64 on the GPU (skipped without an sm_90 GPU): float16 and bfloat16 models, bf16,
E4M3 and E5M2 caches, head counts that fill no tile and several tiles, tails of every
length, one split and many, NaN in every slot no request owns, a cache that stays as it
was, and a query and output with strides."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from tests.mla.helpers import e4m3_query, filled_latent_cache, latent_decode_reference
from vllm.attention.ops.mla_attention import LatentFormat
from vllm.attention.registry import get_backend
from vllm.attention.writers.kernels.device import GPU

if TYPE_CHECKING:
    from vllm.attention.ops.triton_mla_decode import MLADecodeConfig

L, R, PAGE = 512, 64, 64
H90 = GPU("nvidia", (9, 0))


def _reasons(q_dtype: torch.dtype = torch.bfloat16, cache_dtype: torch.dtype = torch.bfloat16,
             page: int = PAGE, L_: int = L, R_: int = R, gpu: GPU | None = H90) -> list[str]:
    from vllm.attention.ops.triton_mla_decode import gluon_unsupported_reasons

    cache = torch.zeros(2, page, L_ + R_, dtype=cache_dtype)
    return gluon_unsupported_reasons(q_dtype, cache, L_, R_, gpu)


def test_gluon_is_the_sm90_default_for_16_bit_caches_only(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    from vllm.attention.ops import triton_mla_decode as tmd

    monkeypatch.setattr(tmd, "_interpreting", lambda: False)
    assert tmd.default_config(torch.bfloat16, H90).gluon
    assert not tmd.default_config(torch.bfloat16, GPU("nvidia", (10, 0))).gluon
    assert not tmd.default_config(torch.bfloat16, GPU("nvidia", (8, 0))).gluon
    assert not tmd.default_config(torch.bfloat16, None).gluon
    assert _reasons() == []
    assert _reasons(torch.float16, torch.float16) == []
    assert _reasons(torch.bfloat16, torch.float8_e4m3fn) == []
    assert _reasons(torch.float16, torch.float8_e5m2) == []


@pytest.mark.parametrize("case, words", [
    (dict(gpu=GPU("nvidia", (10, 0))), "sm_90"),
    (dict(gpu=GPU("amd", (9, 4))), "sm_90"),
    (dict(gpu=None), "sm_90"),
    (dict(cache_dtype=torch.uint8), "cache torch.uint8"),
    (dict(q_dtype=torch.float32, cache_dtype=torch.float8_e4m3fn), "query torch.float32"),
    (dict(q_dtype=torch.float32, cache_dtype=torch.float32), "float32"),
    (dict(q_dtype=torch.float16), "query torch.float16 and cache torch.bfloat16"),
    (dict(page=16), "page size 16"),
    (dict(page=96), "page size 96"),
    (dict(L_=384), "kv_lora_rank=384"),
    (dict(R_=48), "rope_dim=48"),
    (dict(L_=512, R_=256), "shared memory"),
])
def test_gluon_says_why_not(case: dict[str, object], words: str,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.attention.ops import triton_mla_decode as tmd

    monkeypatch.setattr(tmd, "_interpreting", lambda: False)
    reasons = _reasons(**case)  # type: ignore[arg-type]
    assert reasons and any(words in r for r in reasons), reasons


def test_gluon_is_not_taken_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.attention.ops import triton_mla_decode as tmd

    monkeypatch.setattr(tmd, "_interpreting", lambda: True)
    assert any("interpreter" in r for r in _reasons())


def test_fp8_mma_is_opt_in_and_says_why_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp8-MMA kernel (E4M3 query and probabilities) is taken only when asked for,
    for an E4M3 cache of DeepSeek's widths on the lead kernel's devices."""
    import dataclasses

    from vllm.attention.ops import triton_mla_decode as tmd

    monkeypatch.setattr(tmd, "_interpreting", lambda: False)
    e4m3 = torch.zeros(2, PAGE, L + R, dtype=torch.float8_e4m3fn)
    cfg = tmd.default_config(torch.bfloat16, H90)
    assert not cfg.fp8_mma
    assert not tmd.takes_fp8_mma(cfg, torch.bfloat16, e4m3, L, R, H90, scale=1.0)
    on = dataclasses.replace(cfg, fp8_mma=True)
    assert tmd.fp8_mma_unsupported_reasons(e4m3, L, R) == []
    assert (tmd.takes_fp8_mma(on, torch.bfloat16, e4m3, L, R, H90, scale=1.0)
            == tmd.takes_lead(on, torch.bfloat16, e4m3, L, R, H90, scale=1.0))
    assert not tmd.takes_fp8_mma(on, torch.bfloat16, e4m3, L, R, GPU("nvidia", (10, 0)),
                                 scale=1.0)
    e5m2 = e4m3.view(torch.float8_e5m2)
    assert any("float8_e5m2" in r for r in tmd.fp8_mma_unsupported_reasons(e5m2, L, R))
    assert not tmd.takes_fp8_mma(on, torch.bfloat16, e5m2, L, R, H90, scale=1.0)
    narrow = torch.zeros(2, PAGE, 256 + R, dtype=torch.float8_e4m3fn)
    assert any("kv_lora_rank=256" in r for r in tmd.fp8_mma_unsupported_reasons(narrow, 256, R))
    # asked for, it takes precedence over the few-heads kernel at any head count
    assert not tmd.takes_few_heads(on, torch.bfloat16, e4m3, L, R, H90, scale=1.0,
                                   num_heads=16)
    assert tmd.takes_few_heads(cfg, torch.bfloat16, e4m3, L, R, H90, scale=1.0, num_heads=16)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn,
                                         torch.float8_e5m2],
                         ids=lambda x: str(x).replace("torch.", ""))
def test_few_heads_is_the_default_up_to_32_heads_and_says_why_not(
        cache_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers of at most 32 heads take the heads-as-N kernel wherever the lead kernel
    would run; more heads, or widths its MMAs do not take, keep the lead kernel, and
    the reasons name the value."""
    import dataclasses

    from vllm.attention.ops import triton_mla_decode as tmd

    monkeypatch.setattr(tmd, "_interpreting", lambda: False)
    cfg = tmd.default_config(torch.bfloat16, H90)
    assert cfg.few_heads

    def takes(heads: int, L_: int = L, R_: int = R, c: tmd.MLADecodeConfig = cfg,
              gpu: GPU = H90) -> bool:
        cache = torch.zeros(2, PAGE, L_ + R_, dtype=cache_dtype)
        return tmd.takes_few_heads(c, torch.bfloat16, cache, L_, R_, gpu, scale=1.0,
                                   num_heads=heads)

    for heads in (1, 16, 20, 32):
        assert takes(heads), heads
        assert tmd.few_heads_unsupported_reasons(heads, L, R) == []
    # past 32 heads only where asked for (few_heads_64), and only an E4M3 cache with a
    # bfloat16 query (64 heads a program)
    e4m3 = cache_dtype == torch.float8_e4m3fn
    wide = dataclasses.replace(cfg, few_heads_64=True)
    for heads in (33, 64, 128, 130):
        assert not takes(heads), heads
        assert takes(heads, c=wide) == e4m3, heads
        assert tmd.few_heads_unsupported_reasons(heads, L, R, fp8=True, e4m3_bf16=True) == []
    assert any("33 heads" in r and "E4M3" in r
               for r in tmd.few_heads_unsupported_reasons(33, L, R, fp8=True))
    f16 = torch.zeros(2, PAGE, L + R, dtype=cache_dtype)
    assert not tmd.takes_few_heads(wide, torch.float16, f16, L, R, H90, scale=1.0,
                                   num_heads=128)
    assert not takes(16, c=dataclasses.replace(cfg, few_heads=False))
    # the opt-in fp8-MMA kernel, where it applies (E4M3), takes precedence
    assert takes(16, c=dataclasses.replace(cfg, fp8_mma=True)) == (
        cache_dtype != torch.float8_e4m3fn)
    assert not takes(16, c=dataclasses.replace(cfg, lead=False))
    assert not takes(16, gpu=GPU("nvidia", (10, 0)))
    assert not takes(16, L_=64)
    assert any("kv_lora_rank=64" in r for r in tmd.few_heads_unsupported_reasons(16, 64, R))
    assert not takes(16, R_=8)
    assert any("rope_dim=8" in r for r in tmd.few_heads_unsupported_reasons(16, L, 8))
    # an fp8 cache's latent is read 128 columns a half at a time: 128 is too few there
    fp8 = cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    assert takes(16, L_=128) == (not fp8)
    assert tmd.few_heads_unsupported_reasons(16, 128, R) == []
    assert any("kv_lora_rank=128 with an fp8 cache" in r
               for r in tmd.few_heads_unsupported_reasons(16, 128, R, fp8=True))
    assert tmd.few_heads_unsupported_reasons(16, 256, R, fp8=True) == []


# -- on the GPU ------------------------------------------------------------------------

SEQ_LENS = [4096, 1, 63, 64, 65, 127, 3001, 200]
K_SCALE = 0.37
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _case(heads: int, dtype: torch.dtype, cache_dtype: str, seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    # NaN in every slot no request owns
    cache, bt, tokens = filled_latent_cache(
        SEQ_LENS, PAGE, L + R, FP8.get(cache_dtype, dtype), g, spare=2,
        k_scale=K_SCALE if cache_dtype in FP8 else None)
    # the query as the layer has it: a strided view of a wider buffer
    wide = torch.randn(len(tokens), heads, L + R + 8, generator=g).to(dtype).cuda()
    return dict(cache=cache, bt=bt, tokens=tokens, q=wide[..., :L + R],
                req=torch.tensor([r for r, _ in tokens], dtype=torch.int32, device="cuda"),
                pos=torch.tensor([p for _, p in tokens], dtype=torch.int32, device="cuda"))


def _assert_near(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """``out`` within ``tol`` of the float64 ``ref`` as a whole (relative Frobenius
    error), and every token's every head within 4 x: no row may be off while the whole
    is within tolerance."""
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < tol, (err, tol)
    rows = ((out.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max()
    assert float(rows) < 4 * tol, (float(rows), tol)


SCALE = 192 ** -0.5


def _decode(x: dict[str, object], dtype: torch.dtype, cache_dtype: str, splits: int | None,
            cfg: MLADecodeConfig | None) -> torch.Tensor:
    """The decode of case ``x`` with ``cfg`` (None: the device's default), the query's
    latent and rope parts as separate strided views (as the layer passes them)."""
    from vllm.attention.ops import triton_mla_decode as tmd

    q: torch.Tensor = x["q"]  # type: ignore[assignment]
    fmt = LatentFormat(cache_dtype, L, R, torch.tensor(
        [K_SCALE if cache_dtype in FP8 else 1.0], device="cuda"), dtype)
    return tmd.mla_decode_mma(q[..., :L], x["cache"], x["bt"], x["req"], x["pos"], fmt,  # type: ignore[arg-type]
                              scale=SCALE, max_seq_len=max(SEQ_LENS), num_splits=splits,
                              out_dtype=dtype, q_pe=q[..., L:], config=cfg)


def _reference(x: dict[str, object], cache_dtype: str,
               query: torch.Tensor | None = None) -> torch.Tensor:
    """The float64 decode of case ``x`` (of ``query`` in place of its own, if given)."""
    return latent_decode_reference(x["q"] if query is None else query, x["cache"], x["bt"],  # type: ignore[arg-type]
                                   x["tokens"], L, SCALE,  # type: ignore[arg-type]
                                   K_SCALE if cache_dtype in FP8 else None)


def _decode_against_float64(x: dict[str, object], dtype: torch.dtype, cache_dtype: str,
                            splits: int | None, cfg: MLADecodeConfig | None) -> None:
    """:func:`_decode` within the backend's tolerance of float64, the cache untouched."""
    cache: torch.Tensor = x["cache"]  # type: ignore[assignment]
    before = cache.view(torch.uint8).clone()
    out = _decode(x, dtype, cache_dtype, splits, cfg)
    ref = _reference(x, cache_dtype)
    assert torch.equal(cache.view(torch.uint8), before)
    assert torch.isfinite(out).all()
    _assert_near(out, ref, get_backend("TRITON_MLA").tolerances[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the Gluon kernel runs on NVIDIA sm_90 only")
@pytest.mark.parametrize("splits", [None, 1, 3, 64], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("heads", [16, 20, 128, 130])
@pytest.mark.parametrize("dtype, cache_dtype, lead", [
    (torch.bfloat16, "auto", True), (torch.float16, "auto", True),
    (torch.bfloat16, "fp8", True), (torch.float16, "fp8", True),
    (torch.float16, "fp8_e5m2", True), (torch.bfloat16, "auto", False), (torch.float16, "auto", False),
    (torch.bfloat16, "fp8", False), (torch.float16, "fp8_e5m2", False)],
    ids=lambda x: str(x).replace("torch.", "") if not isinstance(x, bool)
    else ("lead" if x else "split-scores"))
def test_gluon_against_float64(dtype: torch.dtype, cache_dtype: str, lead: bool, heads: int,
                               splits: int | None) -> None:
    import dataclasses

    from vllm.attention.ops import triton_mla_decode as tmd

    x = _case(heads, dtype, cache_dtype, seed=heads + (splits or 0))
    cache: torch.Tensor = x["cache"]  # type: ignore[assignment]
    gpu = tmd.gpu_of(cache.device)
    assert tmd.gluon_unsupported_reasons(dtype, cache, L, R, gpu) == []
    # (the few-heads kernel, the default for at most 32 heads, has its own test)
    cfg = dataclasses.replace(tmd.default_config(dtype, gpu), lead=lead, few_heads=False)
    # the default takes the lead-warpgroup kernel (and lead=False the split-scores one)
    assert tmd.takes_lead(cfg, dtype, cache, L, R, gpu, scale=1.0) == lead
    assert not tmd.takes_few_heads(cfg, dtype, cache, L, R, gpu, scale=1.0, num_heads=heads)
    _decode_against_float64(x, dtype, cache_dtype, splits, cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the Gluon kernel runs on NVIDIA sm_90 only")
@pytest.mark.parametrize("splits", [None, 1, 3, 64], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("heads", [1, 16, 20, 32])
@pytest.mark.parametrize("dtype, cache_dtype", [
    (torch.bfloat16, "auto"), (torch.float16, "auto"), (torch.bfloat16, "fp8"),
    (torch.float16, "fp8"), (torch.bfloat16, "fp8_e5m2")],
    ids=lambda x: str(x).replace("torch.", ""))
def test_few_heads_against_float64(dtype: torch.dtype, cache_dtype: str, heads: int,
                                   splits: int | None) -> None:
    """The few-heads kernel (the heads as the MMAs' N) within the backend's tolerance
    of float64, with every row checked, the cache untouched."""
    from vllm.attention.ops import triton_mla_decode as tmd

    x = _case(heads, dtype, cache_dtype, seed=2000 + heads + (splits or 0))
    cache: torch.Tensor = x["cache"]  # type: ignore[assignment]
    gpu = tmd.gpu_of(cache.device)
    assert tmd.takes_few_heads(tmd.default_config(dtype, gpu), dtype, cache, L, R, gpu,
                               scale=1.0, num_heads=heads)
    _decode_against_float64(x, dtype, cache_dtype, splits, None)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the Gluon kernel runs on NVIDIA sm_90 only")
@pytest.mark.parametrize("dtype, cache_dtype, heads", [
    *[(d, c, h) for h in (16, 32) for d, c in (
        (torch.bfloat16, "fp8"), (torch.float16, "fp8"), (torch.float16, "fp8_e5m2"),
        (torch.float16, "auto"))],
    (torch.bfloat16, "fp8", 64), (torch.bfloat16, "fp8", 128)],
    ids=lambda x: str(x).replace("torch.", ""))
def test_few_heads_is_as_accurate_as_the_lead_kernel(dtype: torch.dtype, cache_dtype: str,
                                                     heads: int) -> None:
    """The few-heads kernel's error against float64 is the lead kernel's on the same
    inputs (both dot the stored values exactly with the query the model gives), within
    1.5 x: a score path that rounds the query (two E4M3 parts hold 8 of a float16
    query's 11 significant bits) shows here, where the backend's tolerance still holds."""
    import dataclasses

    from vllm.attention.ops import triton_mla_decode as tmd

    x = _case(heads, dtype, cache_dtype, seed=3000 + heads)
    cache: torch.Tensor = x["cache"]  # type: ignore[assignment]
    gpu = tmd.gpu_of(cache.device)
    few = dataclasses.replace(tmd.default_config(dtype, gpu), few_heads_64=heads > 32)
    lead = dataclasses.replace(few, few_heads=False)
    assert tmd.takes_few_heads(few, dtype, cache, L, R, gpu, scale=1.0, num_heads=heads)
    assert tmd.takes_lead(lead, dtype, cache, L, R, gpu, scale=1.0)
    assert not tmd.takes_few_heads(lead, dtype, cache, L, R, gpu, scale=1.0,
                                   num_heads=heads)
    ref = _reference(x, cache_dtype)
    errs = [float((_decode(x, dtype, cache_dtype, None, cfg).double() - ref).norm()
                  / ref.norm()) for cfg in (few, lead)]
    assert errs[0] <= 1.5 * errs[1], f"few-heads {errs[0]:.3e}, lead {errs[1]:.3e}"


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the Gluon kernel runs on NVIDIA sm_90 only")
@pytest.mark.parametrize("splits", [None, 1, 3, 64], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("heads", [33, 64, 128, 130])
def test_few_heads_64_against_float64(heads: int, splits: int | None) -> None:
    """Past 32 heads, asked for (``few_heads_64``; an E4M3 cache, a bfloat16 query), the
    few-heads kernel takes 64 heads a program, the heads past the layer's masked:
    within the backend's tolerance of float64 with every row checked, the cache
    untouched."""
    import dataclasses

    from vllm.attention.ops import triton_mla_decode as tmd

    x = _case(heads, torch.bfloat16, "fp8", seed=4000 + heads + (splits or 0))
    cache: torch.Tensor = x["cache"]  # type: ignore[assignment]
    gpu = tmd.gpu_of(cache.device)
    cfg = dataclasses.replace(tmd.default_config(torch.bfloat16, gpu), few_heads_64=True)
    assert tmd.takes_few_heads(cfg, torch.bfloat16, cache, L, R, gpu, scale=1.0,
                               num_heads=heads)
    _decode_against_float64(x, torch.bfloat16, "fp8", splits, cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the Gluon kernel runs on NVIDIA sm_90 only")
@pytest.mark.parametrize("splits", [None, 1, 3, 64], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("heads", [16, 20, 128, 130])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16],
                         ids=lambda x: str(x).replace("torch.", ""))
def test_fp8_mma_against_float64(dtype: torch.dtype, heads: int, splits: int | None) -> None:
    """The fp8-MMA kernel (E4M3 query and probabilities): against float64 on the query
    it rounds (what is left is the probabilities' rounding) and on the exact query."""
    import dataclasses

    from vllm.attention.ops import triton_mla_decode as tmd

    x = _case(heads, dtype, "fp8", seed=1000 + heads + (splits or 0))
    cache: torch.Tensor = x["cache"]  # type: ignore[assignment]
    q: torch.Tensor = x["q"]  # type: ignore[assignment]
    gpu = tmd.gpu_of(cache.device)
    cfg = dataclasses.replace(tmd.default_config(dtype, gpu), fp8_mma=True)
    assert tmd.takes_fp8_mma(cfg, dtype, cache, L, R, gpu, scale=1.0)
    assert not tmd.takes_few_heads(cfg, dtype, cache, L, R, gpu, scale=1.0, num_heads=heads)
    before = cache.view(torch.uint8).clone()
    out = _decode(x, dtype, "fp8", splits, cfg)
    assert torch.equal(cache.view(torch.uint8), before)
    assert torch.isfinite(out).all()
    for query, tol in ((e4m3_query(q), tmd.FP8_MMA_P_TOLERANCE),
                       (q, tmd.FP8_MMA_TOLERANCE)):
        _assert_near(out, _reference(x, "fp8", query), tol)
