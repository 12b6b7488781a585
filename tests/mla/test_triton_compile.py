"""The Triton MLA kernels compile to sm90 (H200) machine code here, without a GPU:
Triton's interpreter cannot catch what only the compiler rejects (annotations it
cannot resolve, dtype mismatches in ``tl.dot``, loop-carried type changes).

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

base = dict(KV_LORA=512, ROPE=64, PAGE=64, TILE=128, FP8_E5M2=False,
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
