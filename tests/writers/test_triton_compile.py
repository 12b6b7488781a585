"""The Triton kernels compile for real GPUs (sm_80, sm_90) without one: each
launch the writers build is compiled ahead of time with exactly its arguments,
and the generated PTX divides with IEEE ``div.rn.f32``.

Skipped (with the reason) where Triton or its NVIDIA backend is not installed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm.attention.layouts import (
    aiter_shuffled_views,
    legacy_paged_views,
    split_kv_views,
)
from vllm.attention.types import KVCacheLayout
from vllm.attention.writers.kernels import (
    Launch,
    ScatterTarget,
    fp8_ds_mla_launch,
    load_kernels,
    per_token_head_launch,
    scatter_kv_launch,
)

triton = pytest.importorskip("triton", reason="triton is not installed: nothing to compile")
compiler = pytest.importorskip("triton.compiler", reason="this triton has no triton.compiler")
backends = pytest.importorskip("triton.backends.compiler",
                               reason="this triton has no backend compiler API")
try:
    from triton.backends.nvidia import compiler as _nvidia  # noqa: F401
except ImportError:  # pragma: no cover
    pytest.skip("triton's NVIDIA backend is not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
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


def compile_all() -> dict[str, dict[str, object]]:
    """Compile every target; ``"name-smNN"`` -> what the test checks. Runs in a clean
    subprocess (:func:`compiled`): Triton's interpreter patches ``triton.language`` while
    it runs a kernel and does not always undo it for ``@jit`` helpers it calls, so an
    in-process compile after interpreted kernels can pick up interpreter builtins."""
    out: dict[str, dict[str, object]] = {}
    for name, arch in TARGETS:
        launch = LAUNCHES[name]
        fn = getattr(load_kernels(interpret=False), launch.kernel)
        sig, constexprs = _signature(launch)
        src = compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs)
        try:
            result = triton.compile(src, target=backends.GPUTarget("cuda", arch, 32))
        except Exception as exc:  # reported by the test of this target
            out[f"{name}-sm{arch}"] = {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
            continue
        ptx = result.asm["ptx"]
        out[f"{name}-sm{arch}"] = {
            "divides": sorted(set(re.findall(r"\bdiv\.[a-z0-9.]+\.f32\b", ptx))),
            "cubin": "cubin" in result.asm, "mode": launch.constexprs.get("MODE", 1)}
    return out


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, object]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    code = ("import json; from tests.writers.test_triton_compile import compile_all; "
            "print('RESULT' + json.dumps(compile_all()))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), None)
    assert proc.returncode == 0 and line is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    result: dict[str, dict[str, object]] = json.loads(line[len("RESULT"):])
    return result


@pytest.mark.parametrize(("name", "arch"), TARGETS, ids=[f"{n}-sm{a}" for n, a in TARGETS])
def test_kernel_compiles_for_gpu(name: str, arch: int,
                                 compiled: dict[str, dict[str, object]]) -> None:
    got = compiled[f"{name}-sm{arch}"]
    assert "error" not in got, got["error"]
    if got["mode"] != 0:
        assert got["divides"] == ["div.rn.f32"], got["divides"]
    assert got["cubin"]
