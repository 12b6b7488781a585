"""Fused RoPE + write: byte-identical to rotating with the torch oracle, then writing
with the torch reference writer; the oracle itself checked against two other
formulations; the layer's positions/rope path; errors named before anything is written.

The Triton kernel runs on CPU tensors under Triton's interpreter (``path="triton"``),
skipped with the reason where Triton is not importable (CI).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch

from tests.helpers import every_16_bit_pattern, fill_random_bytes, raw
from tests.mla.helpers import make_spec
from tests.mla.helpers import setup as mla_setup
from vllm.attention import InvalidArgumentError, InvalidTypeError, KVQuant, allocate_kv_cache
from vllm.attention.backends.torch_ref import TorchRefBackend
from vllm.attention.backends.triton_attn import TritonAttentionBackend
from vllm.attention.batch import make_paged_batch
from vllm.attention.layer import Attention
from vllm.attention.layouts import kv_cache_shape, kv_cache_stride_order
from vllm.attention.rope import RoPE, apply_rope, rotate_reference
from vllm.attention.types import KVCacheLayout, cache_storage_dtype
from vllm.attention.writers import MLALatentCacheWriter, SplitKVCacheWriter, reference_write
from vllm.attention.writers.kernels import triton_importable
from vllm.forward_context import set_forward_context
from vllm.runner.config import RopeConfig
from vllm.runner.layers import Rotary

L = KVCacheLayout
DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PATHS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not triton_importable(), reason="triton is not importable: the kernel cannot run here"))]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@dataclass(frozen=True)
class RopeCase:
    layout: KVCacheLayout
    dtype: str
    cache_dtype: str
    style: str
    rotary_dim: int
    table: str = "fp32"
    query: bool = True
    per_head_scale: bool = False
    pow2_scale: bool = False  # powers of two: the quantiser multiplies instead of dividing

    @property
    def id(self) -> str:
        q = "" if self.query else "-noq"
        sc = ("-hscale" if self.per_head_scale else "") + ("-pow2" if self.pow2_scale else "")
        return (f"{self.layout.value}-{self.dtype}-{self.cache_dtype}-{self.style}"
                f"-r{self.rotary_dim}-tab{self.table}{q}{sc}")


HEADS, Q_HEADS, HEAD, BS, NB = 2, 4, 16, 4, 5
CASES = [
    RopeCase(L.SPLIT_NHD, "bf16", "auto", "neox", 16),
    RopeCase(L.SPLIT_NHD, "fp32", "fp8_e4m3", "gptj", 16, per_head_scale=True),
    RopeCase(L.SPLIT_HND, "fp16", "fp8_e5m2", "neox", 8, table="bf16"),
    RopeCase(L.SPLIT_KV_FIRST, "bf16", "fp8", "gptj", 10, query=False),
    RopeCase(L.SPLIT_BLOCK_INTERLEAVED, "fp32", "auto", "neox", 12, table="fp16"),
    RopeCase(L.SPLIT_NHD, "fp16", "auto", "gptj", 6, per_head_scale=True),
    RopeCase(L.SPLIT_NHD, "bf16", "fp8_e4m3", "neox", 16, per_head_scale=True, pow2_scale=True),
    RopeCase(L.SPLIT_HND, "fp32", "fp8_e5m2", "gptj", 12, pow2_scale=True),
]


def _cache(layout: KVCacheLayout, cache_dtype: str, dtype: torch.dtype,
           seed: int) -> torch.Tensor:
    shape = kv_cache_shape(layout, NB, BS, HEADS, HEAD)
    order = kv_cache_stride_order(layout)
    storage = cache_storage_dtype(cache_dtype, dtype)  # type: ignore[arg-type]
    phys = torch.empty([shape[i] for i in order], dtype=storage)
    fill_random_bytes(phys, seed)
    return phys.permute(*[order.index(i) for i in range(len(order))])


def _inputs(case: RopeCase, seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    dtype = DT[case.dtype]
    t, n = 5, 7  # 5 written tokens, 7 rotated query rows (CUDA-graph padding), 8 key rows
    key = (torch.randn(t + 3, HEADS, HEAD, generator=g) * 4).to(dtype)
    value = torch.randn(t + 3, HEADS, HEAD, generator=g).to(dtype)
    query = torch.randn(n + 1, Q_HEADS, HEAD, generator=g).to(dtype) if case.query else None
    slots = torch.randperm(NB * BS, generator=g)[:t]
    slots[2] = -1
    slots[4] = NB * BS + 3  # past the cache: skipped, like a negative slot
    positions = torch.randint(0, 40, (n,), generator=g)
    rope = RoPE.build(case.rotary_dim, 40, base=500.0, style=case.style,  # type: ignore[arg-type]
                      dtype=DT[case.table])
    nscale = HEADS if case.per_head_scale else 1
    if case.pow2_scale:  # 2**-126 overflows the quotient, 2**126 underflows it
        ks, vs = torch.tensor([0.5, 2.0**-126][:nscale]), torch.tensor([4.0, 2.0**126][:nscale])
    else:
        ks, vs = torch.rand(nscale, generator=g) + 0.25, torch.rand(nscale, generator=g) + 0.25
    quant = KVQuant(case.cache_dtype, ks, vs)  # type: ignore[arg-type]
    return dict(key=key, value=value, query=query, slots=slots, positions=positions, rope=rope,
                quant=quant)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fused_write_equals_rotate_then_write(case: RopeCase, path: str,
                                              rope_tokens_per_program: str) -> None:
    seed = zlib.crc32(case.id.encode())
    x = _inputs(case, seed)
    key, value, query = x["key"], x["value"], x["query"]
    slots, positions, rope, quant = x["slots"], x["positions"], x["rope"], x["quant"]
    assert isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)
    assert isinstance(slots, torch.Tensor) and isinstance(positions, torch.Tensor)
    assert isinstance(rope, RoPE) and isinstance(quant, KVQuant)
    assert query is None or isinstance(query, torch.Tensor)
    dtype = DT[case.dtype]
    want = _cache(case.layout, case.cache_dtype, dtype, seed)
    got = _cache(case.layout, case.cache_dtype, dtype, seed)
    reference_write(case.layout, rotate_reference(key, positions, rope), value, want, slots,
                    quant)
    key_before = key.clone()
    q = None if query is None else query.clone()
    SplitKVCacheWriter(case.layout).write_with_rope(q, key, value, got, slots, quant, positions,
                                                    rope, path=path)  # type: ignore[arg-type]
    assert torch.equal(raw(got), raw(want))
    assert torch.equal(_bits(key), _bits(key_before))  # the keys are rotated into the cache only
    if query is not None and q is not None:
        assert torch.equal(_bits(q), _bits(rotate_reference(query, positions, rope)))
        assert torch.equal(_bits(q[positions.shape[0]:]), _bits(query[positions.shape[0]:]))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_e4m3"])
def test_mla_fused_write_equals_rotate_then_write(cache_dtype: str, path: str,
                                                  rope_tokens_per_program: str) -> None:
    g = torch.Generator().manual_seed(3)
    lora, r, p, heads, t = 32, 8, 4, 3, 4
    kv_c = torch.randn(t, lora, generator=g).to(torch.bfloat16)
    k_pe = torch.randn(t, 1, r, generator=g).to(torch.bfloat16)
    q = torch.randn(t, heads, p + r, generator=g).to(torch.bfloat16)
    positions = torch.tensor([0, 9, 3, 30])
    slots = torch.tensor([5, -1, 0, 11])
    rope = RoPE.build(r, 32, style="gptj")
    quant = KVQuant(cache_dtype, torch.tensor([0.6]), torch.tensor([0.6]))  # type: ignore[arg-type]
    storage = torch.bfloat16 if cache_dtype == "auto" else torch.float8_e4m3fn
    want = torch.empty(3, 4, lora + r, dtype=storage)
    fill_random_bytes(want, 1)
    got = want.clone()
    reference_write(L.MLA_LATENT, kv_c, rotate_reference(k_pe, positions, rope), want, slots,
                    quant)
    q_got = q.clone()
    MLALatentCacheWriter().write_with_rope(q_got[..., p:], kv_c, k_pe, got, slots, quant,
                                           positions, rope, path=path)  # type: ignore[arg-type]
    assert torch.equal(raw(got), raw(want))
    q_want = q.clone()
    q_want[..., p:] = rotate_reference(q[..., p:].contiguous(), positions, rope)
    assert torch.equal(_bits(q_got), _bits(q_want))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_apply_rope_rotates_in_place(style: str, path: str,
                                     rope_tokens_per_program: str) -> None:
    g = torch.Generator().manual_seed(4)
    q = torch.randn(6, 4, 16, generator=g).to(torch.bfloat16)
    k = torch.randn(6, 2, 16, generator=g).to(torch.bfloat16)
    positions = torch.tensor([3, 1, 4, 1, 5])  # 5 rows rotated, the 6th is padding
    rope = RoPE.build(12, 8, style=style)  # type: ignore[arg-type]
    q2, k2 = q.clone(), k.clone()
    apply_rope(q2, k2, positions, rope, path=path)  # type: ignore[arg-type]
    assert torch.equal(_bits(q2), _bits(rotate_reference(q, positions, rope)))
    assert torch.equal(_bits(k2), _bits(rotate_reference(k, positions, rope)))
    assert torch.equal(_bits(q2[5]), _bits(q[5]))


# -- the oracle against other formulations --------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_oracle_equals_runner_rotary_in_fp32(interleaved: bool) -> None:
    """The runner's HF-style module (fp32 inputs compute in fp32): identical bits."""
    rot = Rotary(RopeConfig(interleaved=interleaved), 32, 64, device=torch.device("cpu"))
    rope = RoPE(torch.cat([rot.cos, rot.sin], dim=-1), "gptj" if interleaved else "neox")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 3, 32, generator=g) * 3
    positions = torch.randint(0, 64, (9,), generator=g)
    assert torch.equal(_bits(rotate_reference(x, positions, rope)), _bits(rot(x, positions)))


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_oracle_equals_rotate_half_formulation(style: str, dtype: str) -> None:
    """``x * cos + rotate_half(x) * sin`` in float32 then rounded, written independently."""
    g = torch.Generator().manual_seed(6)
    d, r = 20, 12
    x = (torch.randn(7, 2, d, generator=g) * 5).to(DT[dtype])
    positions = torch.randint(0, 50, (7,), generator=g)
    rope = RoPE.build(r, 50, style=style)  # type: ignore[arg-type]
    cos, sin = rope.cos_sin_cache[positions, : r // 2], rope.cos_sin_cache[positions, r // 2:]
    xf = x.float()
    if style == "neox":
        cos_f, sin_f = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
        rot = torch.cat([-xf[..., r // 2: r], xf[..., : r // 2]], -1)
    else:
        cos_f = cos.repeat_interleave(2, -1)[:, None]
        sin_f = sin.repeat_interleave(2, -1)[:, None]
        rot = torch.stack([-xf[..., 1:r:2], xf[..., 0:r:2]], -1).flatten(-2)
    want = x.clone()
    want[..., :r] = (xf[..., :r] * cos_f + rot * sin_f).to(x.dtype)
    assert torch.equal(_bits(rotate_reference(x, positions, rope)), _bits(want))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("dtype", "nan"), [("bf16", 0x7FC0), ("fp16", 0x7E00),
                                            ("fp32", 0x7FC00000)])
def test_rotated_nan_is_canonical(dtype: str, nan: int, path: str) -> None:
    x = torch.zeros(3, 1, 4)
    x[0, 0, 0] = float("nan")
    x[1, 0, 1] = -float("nan")
    x[2, 0, 2] = float("inf")  # inf * 0 in the other member of the pair
    x = x.to(DT[dtype])
    rope = RoPE.build(4, 2)
    positions = torch.tensor([1, 1, 0])
    out = x.clone()
    apply_rope(None, out, positions, rope, path=path)  # type: ignore[arg-type]
    bits = _bits(out)
    want = _bits(rotate_reference(x, positions, rope))
    assert torch.equal(bits, want)
    width = 32 if dtype == "fp32" else 16
    got_nans = {int(b) & ((1 << width) - 1) for b in bits[out.isnan()].tolist()}
    assert got_nans == {nan}


# -- through the layer ---------------------------------------------------------------------


def _layer_setup(backend: type, cache_dtype: str = "auto") -> tuple[Attention, torch.Tensor,
                                                                     object, object]:
    batch = make_paged_batch([3, 1], [0, 5], block_size=16,
                             generator=torch.Generator().manual_seed(0))
    layer = Attention(num_heads=4, num_kv_heads=2, head_size=16, scale=0.25, backend=backend,
                      layer_name="r0", kv_cache_dtype=cache_dtype)
    cache = allocate_kv_cache(backend, num_blocks=batch.num_blocks, block_size=16,
                              num_kv_heads=2, head_size=16, cache_dtype=cache_dtype,  # type: ignore[arg-type]
                              model_dtype=torch.float32, device="cpu")
    fill_random_bytes(cache, 2)
    layer.bind_kv_cache(cache, 16)
    meta = backend.get_builder_cls()(layer.spec, torch.device("cpu")).build(batch.common)
    return layer, cache, meta, batch


@pytest.mark.parametrize(("backend", "cache_dtype", "fused"), [
    (TorchRefBackend, "auto", True),
    (TritonAttentionBackend, "fp8_e4m3", True),
    (TritonAttentionBackend, "int8_per_token_head", False),  # no fused writer: rotate, write
], ids=["TORCH_REF-auto", "TRITON_ATTN-fp8_e4m3", "TRITON_ATTN-int8_per_token_head"])
def test_layer_rope_equals_rotating_first(backend: type, cache_dtype: str, fused: bool) -> None:
    layer, cache, meta, batch = _layer_setup(backend, cache_dtype)
    assert (layer._fused_rope is not None) == fused
    g = torch.Generator().manual_seed(9)
    n = 4
    q = torch.randn(n, 4, 16, generator=g)
    k = torch.randn(n, 2, 16, generator=g)
    v = torch.randn(n, 2, 16, generator=g)
    positions = torch.tensor([0, 1, 2, 5])
    rope = RoPE.build(16, 32)
    ctx = dict(attn_metadata={"r0": meta}, slot_mapping={"r0": batch.new_slots})
    start = cache.clone()
    with set_forward_context(**ctx):  # type: ignore[arg-type]
        want = layer(rotate_reference(q, positions, rope), rotate_reference(k, positions, rope), v)
    want_cache = cache.clone()
    raw(cache).copy_(raw(start))
    q_in, k_in = q.clone(), k.clone()
    with set_forward_context(**ctx):  # type: ignore[arg-type]
        got = layer(q_in, k_in, v, positions=positions, rope=rope)
    assert torch.equal(_bits(got), _bits(want))  # bits: the random context holds NaNs
    assert torch.equal(raw(cache), raw(want_cache))
    assert torch.equal(q_in, rotate_reference(q, positions, rope))  # query rotated in place
    assert torch.equal(k_in, k)  # key left as it was


def test_mla_layer_rope_equals_rotating_first() -> None:
    spec = make_spec(L=64, R=16, P=8, V=8)
    s = mla_setup("TRITON_MLA", [2, 1], [3, 6], block_size=16, spec=spec)
    positions = torch.tensor([3, 4, 6])
    rope = RoPE.build(16, 16, style="gptj")
    ctx = dict(attn_metadata={"mla": s.meta}, slot_mapping={"mla": s.batch.new_slots})
    start = s.cache.clone()
    q_rot = s.q.clone()
    q_rot[..., 8:] = rotate_reference(s.q[..., 8:].contiguous(), positions, rope)
    with set_forward_context(**ctx):  # type: ignore[arg-type]
        want = s.layer(q_rot, s.kv_c_new,
                       rotate_reference(s.k_pe_new[:, None], positions, rope)[:, 0])
    want_cache = s.cache.clone()
    raw(s.cache).copy_(raw(start))
    q_in = s.q.clone()
    with set_forward_context(**ctx):  # type: ignore[arg-type]
        got = s.layer(q_in, s.kv_c_new, s.k_pe_new, positions=positions, rope=rope)
    assert torch.equal(_bits(got), _bits(want))
    assert torch.equal(raw(s.cache), raw(want_cache))
    assert torch.equal(q_in, q_rot)


# -- errors ----------------------------------------------------------------------------------


def _good() -> dict[str, object]:
    return _inputs(CASES[0], 0)


@pytest.mark.parametrize(("change", "argument", "error"), [
    (dict(positions=torch.zeros(7, dtype=torch.int32)), "positions.dtype", InvalidArgumentError),
    (dict(positions=torch.zeros(3, dtype=torch.int64)), "positions.shape", InvalidArgumentError),
    (dict(positions=[0, 1, 2, 3, 4]), "positions", InvalidTypeError),
    (dict(rope="neox"), "rope", InvalidTypeError),
    (dict(rope=RoPE.build(32, 40)), "rope.rotary_dim", InvalidArgumentError),
    (dict(rope=RoPE(torch.zeros(40, 16, device="meta"))), "rope.cos_sin_cache.device",
     InvalidArgumentError),
    (dict(query=torch.zeros(8, 4, 8, dtype=torch.bfloat16)), "query.shape", InvalidArgumentError),
    (dict(query=torch.zeros(8, 4, 16)), "query.dtype", InvalidArgumentError),
    (dict(query=torch.zeros(3, 4, 16, dtype=torch.bfloat16)), "query.shape",
     InvalidArgumentError),
], ids=["pos-int32", "pos-short", "pos-list", "rope-str", "rotary-too-wide", "table-device",
        "query-head", "query-dtype", "query-rows"])
def test_bad_rope_arguments_raise_before_writing(change: dict[str, object], argument: str,
                                                 error: type[Exception]) -> None:
    x = {**_good(), **change}
    cache = _cache(L.SPLIT_NHD, "auto", torch.bfloat16, 1)
    before = raw(cache).clone()
    with pytest.raises(error) as info:
        SplitKVCacheWriter(L.SPLIT_NHD).write_with_rope(
            x["query"], x["key"], x["value"], cache, x["slots"], x["quant"],  # type: ignore[arg-type]
            x["positions"], x["rope"])  # type: ignore[arg-type]
    assert getattr(info.value, "argument", None) == argument
    assert torch.equal(raw(cache), before)


@pytest.mark.parametrize(("kwargs", "argument"), [
    (dict(cos_sin_cache=torch.zeros(4, 3)), "rope.cos_sin_cache.shape"),
    (dict(cos_sin_cache=torch.zeros(4, 4, dtype=torch.int32)), "rope.cos_sin_cache.dtype"),
    (dict(cos_sin_cache=torch.zeros(4, 4), style="llama"), "rope.style"),
])
def test_rope_table_errors_name_argument(kwargs: dict[str, object], argument: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        RoPE(**kwargs)  # type: ignore[arg-type]
    assert info.value.argument == argument


def test_layer_checked_mode_rejects_positions_past_the_table() -> None:
    layer, cache, meta, batch = _layer_setup(TorchRefBackend)
    layer.checked = True
    before = raw(cache).clone()
    q, k, v = torch.zeros(4, 4, 16), torch.zeros(4, 2, 16), torch.zeros(4, 2, 16)
    with set_forward_context(attn_metadata={"r0": meta}, slot_mapping={"r0": batch.new_slots}):
        with pytest.raises(InvalidArgumentError) as info:
            layer(q, k, v, positions=torch.tensor([0, 1, 2, 32]), rope=RoPE.build(16, 32))
        with pytest.raises(InvalidArgumentError) as both:
            layer(q, k, v, positions=torch.tensor([0, 1, 2, 3]))
    assert info.value.argument == "positions"
    assert both.value.argument == "positions/rope"
    assert torch.equal(raw(cache), before)


@pytest.mark.skipif(not triton_importable(), reason="triton is not importable: the kernel "
                    "cannot run here")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_fused_write_scalar_scale_every_bf16_pattern(rope_tokens_per_program: str) -> None:
    """A ``[1]`` fp8 scale (``SCALAR_S``): every bf16 bit pattern as key and value rows,
    rotated at position 0 and quantised with a power of two (multiplied), 2**127 and
    7.0 (divided), byte for byte with rotate-then-reference-write. Multiplying by the
    reciprocal of 7.0 instead of dividing changes some of these bytes."""
    key = every_16_bit_pattern(torch.bfloat16, 8)
    value = key.flip(0).contiguous()
    n = key.shape[0]
    rope = RoPE.build(128, 4)
    positions = torch.zeros(n, dtype=torch.int64)
    g = torch.Generator().manual_seed(9)
    for scale in (0.25, 2.0**127, 7.0):
        slots = torch.randperm(n + 16, generator=g)[:n]
        got = torch.zeros(-(-(n + 16) // 16), 2, 16, 8, 128, dtype=torch.float8_e4m3fn)
        want = got.clone()
        quant = KVQuant("fp8_e4m3", torch.tensor([scale]), torch.tensor([scale]))
        SplitKVCacheWriter(L.SPLIT_NHD).write_with_rope(None, key, value, got, slots, quant,
                                                        positions, rope, path="triton")
        reference_write(L.SPLIT_NHD, rotate_reference(key, positions, rope), value, want,
                        slots, quant)
        diff = (raw(got) != raw(want)).nonzero()
        assert diff.numel() == 0, f"scale {scale}: {diff.shape[0]} byte(s) differ"
