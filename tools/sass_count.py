"""Compile writer launches for sm_90 with Triton's own JIT specialisation (alignment,
divisibility by 16, ints equal to 1) on CPU tensors, and count their SASS instructions.

    PYTHONPATH=. python tools/sass_count.py [name-substring ...] [--dump DIR]

Without a GPU: the launches are those of ``tools/triton_compile_check.record_writers``
for sm_90 (plus the MLA fp8 launches); ``--dump`` writes each kernel's SASS there. The counts are
static (instructions in the binary, not executed); ``docs/performance.md`` uses them to
compare variants of one kernel, not to predict time.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

TARGET = GPUTarget("cuda", 90, 32)


def compile_like_jit(fn: Any, args: tuple, kwargs: dict) -> Any:
    """``fn[grid](*args, **kwargs)``'s kernel as Triton's JIT would specialise it."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kw = dict(kwargs)
    bound, spec, _ = binder(*args, **kw)
    options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, spec, None)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options=options.__dict__)


def sass_of(cubin: bytes) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


def count(sass: str) -> collections.Counter[str]:
    ops: collections.Counter[str] = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops[m.group(1).split(".")[0]] += 1
    return ops


def launches() -> list[tuple[str, Any, tuple, dict]]:
    import dataclasses

    import triton_compile_check as tcc

    from vllm.attention.layouts import mla_latent_views
    from vllm.attention.writers import kernels as tw

    calls = tcc.record_writers(tcc.TARGETS["sm_90"])
    kern = tw.load_kernels(interpret=False)
    t = 65536
    mla = torch.zeros(4096, 16, 576, dtype=torch.uint8)
    latent, rope = mla_latent_views(mla, 512)
    pe = torch.zeros(t, 1, 64, dtype=torch.bfloat16)
    kv_c = torch.zeros(t, 1, 512, dtype=torch.bfloat16)
    slots = torch.zeros(t, dtype=torch.int64)
    one = torch.ones(1)
    launch = tw.scatter_kv_launch(kv_c, pe, tw.ScatterTarget.token_major(latent.unsqueeze(2)),
                                  tw.ScatterTarget.token_major(rope.unsqueeze(2)), slots, 1,
                                  one, one, same_scale=True)
    for extra in ({}, {"FAST_DIV": True, "HW_NAN": True}):
        c = {**launch.constexprs, "HW_CVT": True, "PACKED_WIDEN": True, "FAST_RCP": True, **extra}
        launch2 = dataclasses.replace(launch, constexprs=c)
        name = "mla-fp8-T65536" + ("-fastdiv-hwnan" if extra else "-hwcvt")
        calls.append((name, getattr(kern, launch.kernel), launch2.args,
                      {**launch2.constexprs, **launch2.options}))
    # bench_fused_rope's 3b launch: keys only, T=8192, split NHD fp8, [1] scales
    from vllm.attention.layouts import split_kv_views
    from vllm.attention.types import KVCacheLayout

    n = 8192
    key = torch.zeros(n, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(n // 16 + 1, 2, 16, 8, 128, dtype=torch.float8_e4m3fn)
    kt, vt = (tw.ScatterTarget.token_major(x)
              for x in split_kv_views(cache, KVCacheLayout.SPLIT_NHD))
    rl = tw.rope_kv_launch(None, key, key, kt, vt, slots[:n], slots[:n],
                           torch.zeros(4096, 128), True, 1, one, one.clone())
    c = {**rl.constexprs, "HW_CVT": True, "FAST_DIV": True, "HW_NAN": True,
         "PACKED_WIDEN": True, "FAST_RCP": True}
    calls.append(("rope3b-fp8-T8192-fastdiv-hwnan", getattr(kern, rl.kernel), rl.args,
                  {**c, **rl.options}))
    for bt, nw in ((2, 2), (2, 4), (4, 4)):
        calls.append((f"rope3b-fp8-T8192-fastdiv-hwnan-bt{bt}w{nw}", getattr(kern, rl.kernel),
                      rl.args, {**c, **rl.options, "BLOCK_T": bt, "num_warps": nw}))
    return calls


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*")
    ap.add_argument("--dump")
    a = ap.parse_args()
    for name, fn, args, kwargs in launches():
        if a.names and not any(n in name for n in a.names):
            continue
        compiled = compile_like_jit(fn, args, kwargs)
        sass = sass_of(compiled.asm["cubin"])
        ops = count(sass)
        total = sum(ops.values())
        top = ", ".join(f"{k} {v}" for k, v in ops.most_common(8))
        print(f"{name:45} {total:5d} instr | {top}")
        if a.dump:
            os.makedirs(a.dump, exist_ok=True)
            with open(os.path.join(a.dump, name + ".sass"), "w") as f:
                f.write(sass)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
