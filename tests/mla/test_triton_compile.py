"""The Triton MLA kernels compile to machine code here, without a GPU: Triton's
interpreter cannot catch what only the compiler rejects (annotations it cannot
resolve, dtype mismatches in ``tl.dot``, loop-carried type changes). The per-row
kernel compiles for sm_90; the tensor-core decode's default launches for sm_80,
sm_90 (the Gluon kernels: the lead-warpgroup one at 128 and 16 heads, the few-heads one
at 16 with a bfloat16 and a float16 query, the split-scores and Triton ones they
replace, the fp8-MMA one with an E4M3 cache) and sm_100, each checked for what only
shows in the binary: a kernel lowered to a bare ``trap`` (Blackwell's tensor memory
overflowed), shared memory past the device's limit, and register spills on sm_90.

The compile runs in a child process: ``triton.language``'s own ``@jit`` helpers are
built for either the interpreter or the compiler when triton is first imported, and
the interpreter tests of the same pytest process need the former.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mla.conftest import HAVE_TRITON

ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm.attention.ops import triton_mla_kernels as k

def compile_(fn, signature, consts):
    names = fn.arg_names
    sig = {n: ("constexpr" if n in consts else signature.get(n, "i32")) for n in names}
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(names.index(c),): v for c, v in consts.items()})
    asm = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm
    assert "cubin" in asm, list(asm)

base = dict(KV_LORA=512, ROPE=64, PAGE=64, TILE=128, FP8_E5M2=False, HW_FP8=True,
            DYNAMIC_LOOP=True, MAX_ITERS=0, BLOCK_H=16, BLOCK_N=16, BLOCK_L=512, BLOCK_R=64)
variants = [  # format, sparse, q dtype, cache dtype
    (0, False, "bf16", "bf16"),   # native cache, dense, half dots
    (1, False, "fp16", "u8"),     # scaled fp8 read as bytes
    (2, True, "bf16", "u8"),      # fp8_ds_mla, sparse top-k
    (0, True, "fp32", "fp32"),    # float32 model: IEEE dots
]
for fmt, sparse, q, cache in variants:
    rope = "bf16" if fmt == 2 else cache
    sig = {"Q": "*" + q, "C": "*" + cache, "C_SCALE": "*fp32", "C_ROPE": "*" + rope,
           "BT": "*i32", "TOK_REQ": "*i32", "TOK_POS": "*i32", "TOPK": "*i32",
           "K_SCALE": "*fp32", "O_PART": "*fp32", "LSE_PART": "*fp32", "sm_scale": "fp32"}
    compile_(k.mla_split_kernel, sig,
             dict(base, FORMAT=fmt, IS_SPARSE=sparse, HALF_DOT=q != "fp32"))
    print("compiled split kernel", fmt, sparse, q, cache)
compile_(k.mla_combine_kernel, {"O_PART": "*fp32", "LSE_PART": "*fp32", "OUT": "*fp32"},
         dict(KV_LORA=512, BLOCK_S=32, BLOCK_L=512))
print("compiled combine kernel")
'''


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton)")
def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert done.stdout.count("compiled") == 5


DECODE_CHILD = r'''
import dataclasses, os, re, subprocess, sys, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from vllm.attention.ops import gluon_mla_decode_kernels as gkern
from triton.runtime.jit import create_function_from_signature
from vllm.attention.ops import triton_mla_decode as tmd
from vllm.attention.ops import triton_mla_decode_kernels as kern
from vllm.attention.ops.mla_attention import LatentFormat
from vllm.attention.writers.kernels.device import GPU

SMEM = {80: 166912, 90: 232448, 100: 232448}
sys.path.insert(0, "tools")
from triton_compile_check import NVIDIA_BIN as BIN, wgmma_serialised  # (ptxas' C7514/C7515 notes)

def compile_like_jit(fn, args, kwargs, target):
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, _ = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, None)
    source = GluonASTSource if fn.is_gluon() else ASTSource
    src = source(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=target, options=options.__dict__)

def spill_bytes(cubin):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin); f.flush()
        out = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out)
    return int(m.group(1)), int(m.group(2)) + int(m.group(3))

calls = []
class Rec:
    def __init__(self, fn): self.fn = fn
    def __getitem__(self, grid):
        return lambda *a, **k: calls.append((self.fn, a, k))
tmd._kernels = lambda interp: (Rec(kern.mla_decode_mma_kernel), Rec(kern.mla_decode_combine_kernel))
tmd._gluon_kernel = lambda: Rec(gkern.mla_decode_gluon_kernel)
from vllm.attention.ops import gluon_mla_lead_kernels as lkern
tmd._lead_kernel = lambda: Rec(lkern.mla_decode_lead_kernel)
from vllm.attention.ops import gluon_mla_fp8_kernels as fkern
tmd._fp8_mma_kernel = lambda: Rec(fkern.mla_decode_fp8_mma_kernel)
from vllm.attention.ops import gluon_mla_few_heads_kernels as hkern
tmd._few_heads_kernel = lambda: Rec(hkern.mla_decode_few_heads_kernel)
tmd._interpreting = lambda: False
failures = 0
for cap in (80, 90, 100):
    tmd._device_facts = lambda dev, cap=cap: (132, GPU("nvidia", (cap // 10, cap % 10)))
    for cdt, storage, heads, qdt in (
            ("auto", torch.bfloat16, 128, torch.bfloat16),
            ("fp8", torch.float8_e4m3fn, 128, torch.bfloat16),
            ("auto", torch.bfloat16, 16, torch.bfloat16),
            ("fp8", torch.float8_e4m3fn, 16, torch.bfloat16),
            # a float16 query on an E4M3 cache: the few-heads kernel's scores widened in
            # registers (at 17-32 heads, as with an E5M2 cache, ptxas keeps one value of
            # the partitions' prologue on the stack, 8 bytes stored twice and loaded
            # once before any loop: not checked here)
            ("fp8", torch.float8_e4m3fn, 16, torch.float16)):
        if heads <= 32 and cap != 90:
            continue
        # on sm_90 the default is a Gluon kernel (the lead-warpgroup one for 16-bit
        # caches; at 16 heads the few-heads one); "split" forces the split-scores one,
        # "triton" the Triton one there, "lead" the lead-warpgroup one at 16 heads,
        # "fp8mma" the fp8-MMA one (an E4M3 cache)
        engines = (("default", "split", "triton") if cap == 90 and heads == 128
                   else ("default", "lead") if cap == 90 else ("default",))
        if cap == 90 and cdt == "fp8":
            engines += ("fp8mma",)
        # the opt-in 64-head few-heads launch (few_heads_64) at 128 heads
        if cap == 90 and cdt == "fp8" and heads == 128 and qdt == torch.bfloat16:
            engines += ("few64",)
        if qdt == torch.float16:
            engines = ("default",)
        for splits, engine in [(s, e) for s in ((1, 4) if cap == 90 and cdt == "auto"
                                                and heads == 128 else (4,)) for e in engines]:
            calls.clear()
            cache = torch.zeros(8, 64, 576, dtype=storage)
            fmt = LatentFormat(cdt, 512, 64, torch.ones(1), qdt)
            q = torch.zeros(4, heads, 576, dtype=qdt)
            bt = torch.zeros(4, 8, dtype=torch.int32)
            t = torch.zeros(4, dtype=torch.int32)
            base = tmd.default_config(qdt, GPU("nvidia", (cap // 10, cap % 10)))
            cfg = {"triton": dataclasses.replace(base, gluon=False),
                   "split": dataclasses.replace(base, lead=False),
                   "lead": dataclasses.replace(base, few_heads=False),
                   "fp8mma": dataclasses.replace(base, fp8_mma=True),
                   "few64": dataclasses.replace(base, few_heads_64=True)}.get(engine)
            tmd.mla_decode_mma(q, cache, bt, t, t, fmt, scale=0.1, max_seq_len=4096,
                               num_splits=splits, out_dtype=qdt, config=cfg)
            for fn, a, k in calls:
                c = compile_like_jit(fn, a, dict(k), GPUTarget("cuda", cap, 32))
                name = (f"sm{cap} {cdt} q={str(qdt)[6:]} N={heads} splits={splits} {engine} "
                        f"{fn.__name__}")
                bad = []
                ptx = c.asm["ptx"]
                if re.search(r"^\s*trap;", ptx, re.M) and ptx.count(chr(10)) < 400:
                    bad.append("lowered to a bare trap")
                if c.metadata.shared > SMEM[cap]:
                    bad.append(f"shared {c.metadata.shared} > {SMEM[cap]}")
                # programmatic dependent launch: the few-heads kernel up to 32 heads and
                # the combine after it, each waiting for the grid before it ahead of its
                # first read
                few = heads <= 32 and any(f.__name__ == "mla_decode_few_heads_kernel"
                                          for f, _, _ in calls)
                pdl = few and fn.__name__ in ("mla_decode_few_heads_kernel",
                                              "mla_decode_combine_kernel")
                waits = ptx.find("griddepcontrol.wait")
                reads = [i for i in (ptx.find("ld.global"), ptx.find("cp.async.bulk"))
                         if i >= 0]
                if bool(c.metadata.launch_pdl) != pdl or (waits >= 0) != pdl:
                    bad.append(f"launch_pdl={c.metadata.launch_pdl}, griddepcontrol.wait "
                               f"{'in' if waits >= 0 else 'not in'} the PTX (expected {pdl})")
                elif pdl and reads and min(reads) < waits:
                    bad.append("a global read before griddepcontrol.wait")
                if cap == 90:
                    regs, spilled = spill_bytes(c.asm["cubin"])
                    name += f" regs={regs}"
                    # the opt-in 64-head launch is known to spill (its values' warpgroups
                    # reload addresses: 104 bytes with four splits, docs/mla.md), which
                    # keeps it from being a default; a bound catches it growing
                    allowed = 128 if engine == "few64" else 0
                    if spilled > allowed:
                        bad.append(f"{spilled} bytes of stack/local (register spills)")
                    if "wgmma" in ptx and wgmma_serialised(ptx):
                        bad.append("ptxas serialised the warpgroup MMAs")
                failures += bool(bad)
                print(("FAIL " if bad else "compiled ") + name, *bad, flush=True)
sys.exit(1 if failures else 0)
'''


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton)")
def test_decode_kernel_compiles_for_sm80_sm90_sm100() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", DECODE_CHILD], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert done.stdout.count("compiled ") == 39, done.stdout
