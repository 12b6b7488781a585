"""The tensor-core MLA decode kernel (``ops/triton_mla_decode.py``) under Triton's CPU
interpreter, small shapes, against a float64 reference over the same cache.

Every cache slot no request owns holds NaN bytes, so a read past a request's last
position (a partial tile, an empty split) shows up as NaN in the output. The cases
cover both latent layouts (one chunk, and two chunks as DeepSeek's 512 takes), TMA
and pointer loads, tiles inside and across pages, one split and many, the value
split, and every cache format the kernel takes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.mla.conftest import HAVE_TRITON
from tests.mla.helpers import FP8_CACHE_DTYPES, latent_decode_reference, shuffled_block_table
from vllm.attention import InvalidArgumentError
from vllm.attention.ops.mla_attention import LatentFormat
from vllm.attention.registry import get_backend

if HAVE_TRITON and not torch.cuda.is_available():
    # at collection, before anything imports triton (see test_triton_interpreter.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

# (request, position) of each decode token: one key only, two tokens of one request,
# a context of exactly four pages, and contexts that end inside a page
TOKENS = [(0, 0), (1, 35), (1, 36), (2, 63), (3, 16)]
SEQ_LENS = [1, 37, 64, 17]


@dataclass(frozen=True)
class Case:
    cache_dtype: str
    dtype: torch.dtype
    L: int
    R: int
    heads: int
    page: int
    splits: int
    block_n: int = 16
    v_split: int = 1
    tma: bool = True
    hw_fp8: bool = True
    latent_chunks: int = 2
    split_scores: bool = False
    fp16_dot: bool = True
    heads_as_n: bool = False

    @property
    def id(self) -> str:
        extra = "".join([f"-bn{self.block_n}" if self.block_n != 16 else "",
                         "-vsplit" if self.v_split == 2 else "",
                         "" if self.tma else "-notma", "" if self.hw_fp8 else "-softfp8",
                         "-onechunk" if self.latent_chunks == 1 else "",
                         "-splitscores" if self.split_scores else "",
                         "" if self.fp16_dot else "-nofp16dot",
                         "-headsN" if self.heads_as_n else ""])
        return (f"{str(self.dtype).split('.')[-1]}-{self.cache_dtype}-L{self.L}R{self.R}"
                f"-H{self.heads}-page{self.page}-s{self.splits}{extra}")

    @property
    def uses_tma(self) -> bool:
        """TMA loads whole tiles inside one page; the launcher halves ``block_n`` (down
        to 16) until a page holds whole tiles."""
        bn = self.block_n
        while self.page % bn and bn > 16:
            bn //= 2
        return self.tma and self.page % bn == 0


CASES = [
    Case("auto", torch.bfloat16, 32, 16, 3, 16, 1),
    Case("auto", torch.float32, 24, 8, 3, 16, 2),
    Case("fp8", torch.float16, 32, 16, 5, 16, 3),
    Case("fp8", torch.float16, 32, 16, 2, 16, 2, hw_fp8=False),
    Case("fp8_e5m2", torch.bfloat16, 32, 16, 2, 32, 2, block_n=32),
    Case("auto", torch.float16, 32, 16, 2, 24, 2),            # tiles cross pages
    Case("auto", torch.bfloat16, 32, 16, 3, 48, 3, block_n=64),  # 48-row pages: tiles of 16
    Case("auto", torch.bfloat16, 32, 16, 2, 16, 4, tma=False),
    Case("auto", torch.bfloat16, 512, 64, 2, 16, 2),          # two latent chunks
    Case("fp8", torch.bfloat16, 512, 64, 2, 16, 1, v_split=2),
    # the sm_90 default: one [., 512] latent operand, the score warps split the keys
    Case("auto", torch.bfloat16, 512, 64, 3, 16, 3, latent_chunks=1, split_scores=True),
    Case("auto", torch.float16, 512, 64, 2, 24, 2, latent_chunks=1, split_scores=True),
    Case("fp8", torch.bfloat16, 512, 64, 3, 16, 2, latent_chunks=1, split_scores=True),
    Case("fp8_e5m2", torch.bfloat16, 512, 64, 2, 16, 1, split_scores=True, tma=False),
    # fp8 with a bfloat16 model: float16 dots (above) or the bfloat16 ones
    Case("fp8", torch.bfloat16, 32, 16, 3, 16, 2, fp16_dot=False),
    # few heads as the N of the MMAs (the sm_90 default at <= 16 heads, non-fp8 caches)
    Case("auto", torch.bfloat16, 512, 64, 3, 16, 3, latent_chunks=1, heads_as_n=True),
    Case("auto", torch.float16, 32, 16, 2, 24, 2, heads_as_n=True),
    Case("auto", torch.float32, 24, 8, 3, 16, 1, heads_as_n=True),
    Case("fp8", torch.bfloat16, 512, 64, 2, 16, 2, v_split=2, heads_as_n=True, tma=False),
]


def _cache(case: Case, fmt: LatentFormat, bt: torch.Tensor, nb: int,
           g: torch.Generator) -> torch.Tensor:
    """NaN bytes everywhere, then random rows at every request's positions."""
    storage = FP8_CACHE_DTYPES.get(case.cache_dtype, case.dtype)
    cache = torch.empty(nb, case.page, case.L + case.R, dtype=storage)
    cache.view(torch.uint8).fill_(0xFF)  # NaN in every float format here
    for r, n in enumerate(SEQ_LENS):
        pos = torch.arange(n)
        rows = torch.randn(n, case.L + case.R, generator=g)
        if case.cache_dtype in FP8_CACHE_DTYPES:
            rows = rows / fmt.k_scale
        cache[bt[r, pos // case.page].long(), pos % case.page] = rows.to(storage)
    return cache


def reference(q: torch.Tensor, cache: torch.Tensor, bt: torch.Tensor, tokens: list[Any],
              fmt: LatentFormat, scale: float) -> torch.Tensor:
    k_scale = float(fmt.k_scale[0]) if fmt.cache_dtype in FP8_CACHE_DTYPES else None
    return latent_decode_reference(q, cache, bt, tokens, fmt.kv_lora_rank, scale, k_scale)


def _inputs(case: Case, seed: int = 0) -> tuple[LatentFormat, torch.Tensor, torch.Tensor,
                                                torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    fmt = LatentFormat(case.cache_dtype, case.L, case.R,  # type: ignore[arg-type]
                       torch.tensor([0.37]), case.dtype)
    bt, nb = shuffled_block_table(SEQ_LENS, case.page, g)  # one block owned by no request
    cache = _cache(case, fmt, bt, nb, g)
    q = torch.randn(len(TOKENS), case.heads, case.L + case.R, generator=g).to(case.dtype)
    req = torch.tensor([r for r, _ in TOKENS], dtype=torch.int32)
    pos = torch.tensor([p for _, p in TOKENS], dtype=torch.int32)
    return fmt, cache, bt, req, pos, q


@pytest.fixture
def tma_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each launch got TMA descriptors."""
    from vllm.attention.ops import triton_mla_decode as tmd

    seen: list[bool] = []
    real = tmd._descriptors

    def spy(*args: Any) -> Any:
        found = real(*args)
        seen.append(found is not None)
        return found

    monkeypatch.setattr(tmd, "_descriptors", spy)
    return seen


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_decode_matches_float64(case: Case, tma_calls: list[bool],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.attention.ops import triton_mla_decode as tmd

    monkeypatch.setattr(tmd, "_hw_fp8", lambda gpu: case.hw_fp8)
    fmt, cache, bt, req, pos, q = _inputs(case)
    before = cache.view(torch.uint8).clone()
    cfg = tmd.MLADecodeConfig(block_h=16, block_n=case.block_n, num_warps=4, num_stages=1,
                              v_split=case.v_split, tma=case.tma,
                              latent_chunks=case.latent_chunks,
                              split_scores=case.split_scores, fp8_fp16_dot=case.fp16_dot,
                              heads_as_n=case.heads_as_n)
    scale = (case.L + case.R) ** -0.5
    out = tmd.mla_decode_mma(q, cache, bt, req, pos, fmt, scale=scale,
                             max_seq_len=max(SEQ_LENS), config=cfg, num_splits=case.splits)
    ref = reference(q, cache, bt, TOKENS, fmt, scale)
    assert torch.equal(cache.view(torch.uint8), before)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < get_backend("TRITON_MLA").tolerances[case.dtype], err
    assert tma_calls == ([True] if case.uses_tma else [])


@pytest.mark.usefixtures("triton_interpreter")
def test_splits_past_the_keys_and_output_dtype() -> None:
    """More splits than a token has key tiles: empty splits weigh nothing; the
    result comes in the requested dtype."""
    from vllm.attention.ops.triton_mla_decode import mla_decode_mma

    case = Case("auto", torch.float16, 32, 16, 2, 16, 8)
    fmt, cache, bt, req, pos, q = _inputs(case, seed=1)
    out = mla_decode_mma(q, cache, bt, req, pos, fmt, scale=0.2, max_seq_len=64, num_splits=8,
                         out_dtype=torch.float16)
    ref = reference(q, cache, bt, TOKENS, fmt, 0.2)
    assert out.dtype == torch.float16
    assert float((out.double() - ref).norm() / ref.norm()) < 5e-3


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("hw_fp8", [True, False], ids=["hwfp8", "softfp8"])
def test_e4m3_every_code_widens_exactly(hw_fp8: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """All 256 E4M3 codes in the latent of one request's rows: the finite ones widen
    exactly (float32 dots in the interpreter, so the result matches float64 to
    rounding), and the NaN code reaches the output as NaN on the software path (the
    interpreter's own E4M3 conversion reads NaN as 480; the GPU test checks the
    hardware path)."""
    from vllm.attention.ops import triton_mla_decode as tmd

    monkeypatch.setattr(tmd, "_hw_fp8", lambda gpu: hw_fp8)
    L, R, page = 32, 16, 16
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]  # 254 codes
    rows = torch.zeros(16, L + R, dtype=torch.uint8)
    rows.view(-1)[: finite.numel()] = finite
    cache = rows.view(1, page, L + R).view(torch.float8_e4m3fn)
    fmt = LatentFormat("fp8", L, R, torch.tensor([0.5]), torch.float32)
    q = torch.randn(1, 2, L + R, generator=torch.Generator().manual_seed(2)) * 1e-3
    bt = torch.zeros(1, 1, dtype=torch.int32)
    one = torch.zeros(1, dtype=torch.int32)
    pos = torch.full((1,), page - 1, dtype=torch.int32)
    out = tmd.mla_decode_mma(q, cache, bt, one, pos, fmt, scale=1.0, max_seq_len=page,
                             num_splits=1)
    ref = reference(q, cache, bt, [(0, page - 1)], fmt, 1.0)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5
    if hw_fp8:
        return
    nan_rows = rows.clone()
    nan_rows[3, 5] = 0x7F
    out = tmd.mla_decode_mma(q, nan_rows.view(1, page, L + R).view(torch.float8_e4m3fn), bt,
                             one, pos, fmt, scale=1.0, max_seq_len=page, num_splits=1)
    assert torch.isnan(out).all()


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("magnitude", [1e-30, 1e-3, 3e4, 1e9])
def test_fp16_dots_scale_the_query_into_range(magnitude: float) -> None:
    """fp8 cache, bfloat16 model: the query is scaled into float16 by a power of two a
    head, so queries far outside float16's range (65504) or deep in its subnormals give
    the same result; a head of zeros (and the masked heads past the layer's) stays
    finite."""
    from vllm.attention.ops import triton_mla_decode as tmd

    case = Case("fp8", torch.bfloat16, 512, 64, 3, 16, 2, latent_chunks=1, split_scores=True)
    fmt, cache, bt, req, pos, q = _inputs(case, seed=5)
    q = (q.double() * magnitude).bfloat16()
    q[:, 1] = 0.0
    scale = (case.L + case.R) ** -0.5 / magnitude
    cfg = tmd.MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1,
                              latent_chunks=1, split_scores=True)
    out = tmd.mla_decode_mma(q, cache, bt, req, pos, fmt, scale=scale,
                             max_seq_len=max(SEQ_LENS), config=cfg, num_splits=2)
    ref = reference(q, cache, bt, TOKENS, fmt, scale)
    assert torch.isfinite(out).all()
    # float16 probabilities: well inside the bfloat16 tolerance
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-3


@pytest.mark.usefixtures("triton_interpreter")
def test_query_parts_taken_as_strided_views() -> None:
    """The absorbed part as the transposed view a batched matmul returns and the rope
    part as a slice of the query, as the layer passes them: the same result."""
    from vllm.attention.ops.triton_mla_decode import mla_decode_mma

    case = Case("auto", torch.float16, 32, 16, 3, 16, 2)
    fmt, cache, bt, req, pos, q = _inputs(case, seed=4)
    whole = mla_decode_mma(q, cache, bt, req, pos, fmt, scale=0.2, max_seq_len=64)
    nope = q[..., :32].transpose(0, 1).contiguous().transpose(0, 1)  # strides (32, T*32, 1)
    wide = torch.cat([torch.zeros_like(q[..., :8]), q], dim=-1)      # rope at an offset
    parts = mla_decode_mma(nope, cache, bt, req, pos, fmt, scale=0.2, max_seq_len=64,
                           q_pe=wide[..., 8 + 32:])
    assert nope.stride(1) == q.shape[0] * 32
    torch.testing.assert_close(parts, whole, rtol=1e-6, atol=1e-6)
    with pytest.raises(InvalidArgumentError, match=r"q_pe: got \(\(5, 3, 8\)"):
        mla_decode_mma(nope, cache, bt, req, pos, fmt, scale=0.2, max_seq_len=64,
                       q_pe=q[..., 32:40])


def test_errors_name_the_argument() -> None:
    from vllm.attention.ops.triton_mla_decode import MLADecodeConfig, mla_decode_mma

    fmt = LatentFormat("fp8_ds_mla", 512, 64, torch.ones(1), torch.bfloat16)
    q = torch.zeros(1, 2, 576, dtype=torch.bfloat16)
    cache = torch.zeros(1, 64, 656, dtype=torch.uint8)
    bt = torch.zeros(1, 1, dtype=torch.int32)
    t = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match="fp8_ds_mla.*per-row kernel"):
        mla_decode_mma(q, cache, bt, t, t, fmt, scale=1.0, max_seq_len=1)
    fmt = LatentFormat("auto", 512, 64, torch.ones(1), torch.bfloat16)
    with pytest.raises(InvalidArgumentError, match=r"q_lat.shape: got \(1, 2, 570\)"):
        mla_decode_mma(q[..., :570], cache[..., :576], bt, t, t, fmt, scale=1.0, max_seq_len=1)
    with pytest.raises(InvalidArgumentError, match="num_splits: got 65"):
        mla_decode_mma(q, torch.zeros(1, 64, 576, dtype=torch.bfloat16), bt, t, t, fmt,
                       scale=1.0, max_seq_len=1, num_splits=65)
    with pytest.raises(InvalidArgumentError, match="block_h: got 24"):
        MLADecodeConfig(block_h=24, block_n=16, num_warps=4, num_stages=1)
    with pytest.raises(InvalidArgumentError, match="v_split: got 3"):
        MLADecodeConfig(block_h=64, block_n=16, num_warps=4, num_stages=1, v_split=3)
    with pytest.raises(InvalidArgumentError, match="latent_chunks: got 1.*v_split=2"):
        MLADecodeConfig(block_h=64, block_n=16, num_warps=4, num_stages=1, v_split=2,
                        latent_chunks=1)


def test_default_launches_by_device_heads_and_cache() -> None:
    from vllm.attention.ops.triton_mla_decode import default_config
    from vllm.attention.writers.kernels.device import GPU

    hopper = GPU("nvidia", (9, 0))
    wide = default_config(torch.bfloat16, hopper)
    assert (wide.block_h, wide.split_scores, wide.latent_chunks) == (64, True, 1)
    # heads as N is wrong on an H200 (docs/mla.md): no default takes it
    for heads in (16, 32, 128):
        for fp8 in (False, True):
            assert not default_config(torch.bfloat16, hopper, num_heads=heads, fp8=fp8).heads_as_n
    assert default_config(torch.bfloat16, GPU("nvidia", (10, 0)), num_heads=16).v_split == 2
    assert default_config(torch.bfloat16, None).block_h == 16


def test_choose_splits_fills_the_device_and_no_more() -> None:
    from vllm.attention.ops.triton_mla_decode import MAX_SPLITS, choose_splits

    deepseek = dict(num_heads=128, kv_lora_rank=512, row_bytes=1152, block_n=64, slots=132)
    # 64 tokens x 2 head tiles already fill 132 SMs to 97 %: a split would only add
    # partial outputs
    assert choose_splits(num_tokens=64, programs_per_split=2, max_seq_len=4096,
                         **deepseek) == 1
    # one long request: split until the 132 SMs are busy (2 programs a split)
    one = choose_splits(num_tokens=1, programs_per_split=2, max_seq_len=32768, **deepseek)
    assert 2 * one >= 0.9 * 132 and one <= MAX_SPLITS
    # a short context is never cut below two tiles a split
    assert choose_splits(num_tokens=1, programs_per_split=2, max_seq_len=200,
                         **deepseek) == 200 // 128
    assert choose_splits(num_tokens=0, programs_per_split=2, max_seq_len=100, **deepseek) == 1
    assert choose_splits(num_tokens=1, programs_per_split=1, max_seq_len=10**6,
                         **deepseek) == MAX_SPLITS


def test_heads_as_n_is_refused_outside_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The heads-as-N launch passes here but computed wrong outputs on an H200: a GPU
    call of it is an error naming the config, raised before anything is launched."""
    from vllm.attention.errors import InvalidArgumentError
    from vllm.attention.ops import triton_mla_decode as m
    from vllm.attention.ops.mla_attention import LatentFormat

    monkeypatch.setattr(m, "_interpreting", lambda: False)  # as on a GPU
    monkeypatch.setattr(m, "_device_facts", lambda device: (132, None))
    monkeypatch.setattr(m, "_kernels", lambda interp: pytest.fail("launched"))
    cfg = m.MLADecodeConfig(block_h=16, block_n=64, num_warps=4, num_stages=2,
                            latent_chunks=1, heads_as_n=True)
    fmt = LatentFormat("auto", 32, 16, torch.ones(1), torch.bfloat16)
    q = torch.randn(2, 4, 48).bfloat16()
    cache = torch.randn(3, 64, 48).bfloat16()
    with pytest.raises(InvalidArgumentError, match="config.heads_as_n"):
        m.mla_decode_mma(q, cache, torch.tensor([[1, 2]], dtype=torch.int32),
                            torch.zeros(2, dtype=torch.int32),
                            torch.tensor([3, 9], dtype=torch.int32), fmt, scale=0.2,
                            max_seq_len=10, config=cfg)
