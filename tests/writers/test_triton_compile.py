"""The Triton kernels compile for real GPUs (sm_80, sm_90) without one: each
launch the writers build is compiled ahead of time with exactly its arguments,
and the generated PTX divides with IEEE ``div.rn.f32``.

Skipped (with the reason) where Triton or its NVIDIA backend is not installed.
"""

from __future__ import annotations

import re

import pytest
import torch

from vllm.attention.layouts import aiter_shuffled_views, legacy_paged_views, split_kv_views
from vllm.attention.ops.triton_writers import (
    Launch,
    ScatterTarget,
    fp8_ds_mla_launch,
    load_kernels,
    per_token_head_launch,
    scatter_kv_launch,
)
from vllm.attention.types import KVCacheLayout

triton = pytest.importorskip("triton", reason="triton is not installed: nothing to compile")
compiler = pytest.importorskip("triton.compiler", reason="this triton has no triton.compiler")
backends = pytest.importorskip("triton.backends.compiler",
                               reason="this triton has no backend compiler API")
try:
    from triton.backends.nvidia import compiler as _nvidia  # noqa: F401
except ImportError:  # pragma: no cover
    pytest.skip("triton's NVIDIA backend is not installed", allow_module_level=True)

_TYPES = {torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
          torch.float32: "fp32"}


def _signature(launch: Launch) -> tuple[dict[str, str], dict[str, object]]:
    fn = getattr(load_kernels(interpret=False), launch.kernel)
    names = list(fn.arg_names)
    sig: dict[str, str] = {}
    for name, arg in zip(names, launch.args):
        if isinstance(arg, torch.Tensor):
            sig[name] = "*" + _TYPES[arg.dtype]
        else:
            sig[name] = "i32" if -2**31 <= arg < 2**31 else "i64"
    for name in launch.constexprs:
        sig[name] = "constexpr"
    assert set(sig) == set(names), (set(names) - set(sig), set(sig) - set(names))
    return sig, dict(launch.constexprs)


def _launches() -> dict[str, Launch]:
    nb, bs, h, d = 4, 16, 8, 128
    slots = torch.zeros(5, dtype=torch.int64)
    bf = torch.zeros(5, h, d, dtype=torch.bfloat16)
    f32 = torch.zeros(5, h, d)
    scale = torch.ones(h)
    fp8_cache = torch.zeros(nb, 2, bs, h, d, dtype=torch.float8_e4m3fn)
    k, v = split_kv_views(fp8_cache, KVCacheLayout.SPLIT_HND)
    legacy = torch.zeros(2, nb, bs * h * d, dtype=torch.float8_e5m2)
    k5, v4 = legacy_paged_views(legacy, h, d)
    aiter = torch.zeros(2, nb, bs, h, d, dtype=torch.bfloat16)
    ak, av = aiter_shuffled_views(aiter)
    ptq = torch.zeros(nb, 2, bs, h, d + 4, dtype=torch.uint8)
    pk, pv = split_kv_views(ptq, KVCacheLayout.PER_TOKEN_HEAD_QUANT)
    ds = torch.zeros(nb, 64, 656, dtype=torch.uint8)
    return {
        "split-fp8_e4m3-bf16": scatter_kv_launch(
            bf, bf, ScatterTarget.token_major(k), ScatterTarget.token_major(v), slots, 1,
            scale, scale),
        "legacy-fp8_e5m2-fp32": scatter_kv_launch(
            f32, f32, ScatterTarget.x_split_key(k5), ScatterTarget.head_major_value(v4), slots,
            2, scale[:1], scale[:1]),
        "aiter-auto-bf16": scatter_kv_launch(
            bf, bf, ScatterTarget.x_split_key(ak), ScatterTarget.x_split_value(av), slots, 0,
            scale, scale),
        "ptq-int8-bf16": per_token_head_launch(bf, bf, pk, pv, slots, True),
        "ptq-fp8-fp32": per_token_head_launch(f32, f32, pk, pv, slots, False),
        "ds_mla-fp32": fp8_ds_mla_launch(torch.zeros(5, 512), torch.zeros(5, 64), ds, slots),
        "ds_mla-bf16": fp8_ds_mla_launch(torch.zeros(5, 512, dtype=torch.bfloat16),
                                         torch.zeros(5, 1, 64, dtype=torch.bfloat16)[:, 0], ds,
                                         slots),
    }


LAUNCHES = _launches()
# every launch for sm_90 (the H200s); two for sm_80, whose fp8 has no hardware
# conversion (the kernels round in integer code, so they need none)
TARGETS = [(name, 90) for name in LAUNCHES] + [("split-fp8_e4m3-bf16", 80), ("ptq-int8-bf16", 80)]


@pytest.mark.parametrize(("name", "arch"), TARGETS, ids=[f"{n}-sm{a}" for n, a in TARGETS])
def test_kernel_compiles_for_gpu(name: str, arch: int) -> None:
    launch = LAUNCHES[name]
    fn = getattr(load_kernels(interpret=False), launch.kernel)
    sig, constexprs = _signature(launch)
    src = compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    compiled = triton.compile(src, target=backends.GPUTarget("cuda", arch, 32))
    ptx = compiled.asm["ptx"]
    divides = set(re.findall(r"\bdiv\.[a-z0-9.]+\.f32\b", ptx))
    if launch.constexprs.get("MODE", 1) != 0:
        assert divides == {"div.rn.f32"}, divides
    assert "cubin" in compiled.asm
