"""Compile every Triton launch of the project for each GPU target, without a GPU.

    PYTHONPATH=. python tools/triton_compile_check.py [--target sm_80,sm_90,...]
                                                      [--group writers,...] [--jobs N]

Each recorder of :data:`RECORDERS` runs representative calls of one family of
launchers on CPU tensors with the kernels replaced by recorders (or, for the writers,
builds the launches directly), while the writers' device decisions
(``vllm.attention.writers.kernels.device.gpu_of``) answer for the target's GPU: the
launches carry the flags the launchers choose there (no hardware fp8 on sm_80, no
inline PTX on gfx942). Each recorded launch is then compiled ahead of time with
exactly its arguments (``triton.compile``) and checked (:func:`problem`). Exit 1 if any
launch fails; a target whose Triton backend is missing is reported as skipped, with
the reason; a launch of :data:`KNOWN_GAPS` is reported as a gap. ``tests/ops/`` and
``tests/writers/test_triton_compile.py`` run it in a subprocess (the interpreter setting
of a test process must not leak in); ``docs/kernels.md`` says what runs where.

To add a launcher family: write ``record_<family>(target) -> list[Call]`` and add it to
:data:`RECORDERS`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

if __name__ == "__main__":  # compile, whatever the calling shell set
    os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from vllm.attention.writers.kernels import device as writer_device  # noqa: E402

_TYPES = {torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32",
          torch.int64: "i64", torch.float32: "fp32", torch.float16: "fp16",
          torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}

Call = tuple[str, Any, tuple[Any, ...], dict[str, Any]]
"""``(name, jit function, positional args, constexprs and compiler options)``."""

NVIDIA_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
"""Triton's own NVIDIA tools (ptxas, cuobjdump)."""

NVIDIA_ONLY = ("HW_CVT", "FAST_DIV", "HW_NAN", "FAST_RCP", "PACKED_WIDEN")
"""The writer constexprs that select inline PTX or NVIDIA's conversion semantics."""


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    backend: GPUTarget
    gpu: writer_device.GPU
    """What the launchers' device decisions see while recording for this target."""


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("sm_80", GPUTarget("cuda", 80, 32), writer_device.GPU("nvidia", (8, 0))),
    Target("sm_90", GPUTarget("cuda", 90, 32), writer_device.GPU("nvidia", (9, 0))),
    Target("sm_100", GPUTarget("cuda", 100, 32), writer_device.GPU("nvidia", (10, 0))),
    # MI300: ROCm's torch reports gfx942 as capability 9.4
    Target("gfx942", GPUTarget("hip", "gfx942", 64), writer_device.GPU("amd", (9, 4))),
)}


class Recorder:
    def __init__(self, name: str, fn: Any, calls: list[Call]) -> None:
        self.name, self.fn, self.calls = name, fn, calls

    def __getitem__(self, grid: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> None:
            self.calls.append((self.name, self.fn, args, kwargs))
        return run


@contextlib.contextmanager
def patched(obj: Any, **attrs: Any) -> Iterator[None]:
    """Set attributes of ``obj`` for the duration (recorders, stand-ins), then restore."""
    old = {k: getattr(obj, k) for k in attrs}
    for k, v in attrs.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(obj, k, v)


@contextlib.contextmanager
def as_gpu(gpu: writer_device.GPU, env: dict[str, str] | None = None) -> Iterator[None]:
    """The writers' device decisions answer for ``gpu`` (whatever the tensors' device),
    with the environment overrides ``env`` set."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        with patched(writer_device, gpu_of=lambda device: gpu):
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _sig(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
         ) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
    names = list(fn.arg_names)
    options: dict[str, Any] = {k: kwargs.pop(k) for k in ("num_warps", "num_stages",
                                                          "enable_fp_fusion", "maxnreg",
                                                          "launch_pdl")
                               if k in kwargs}
    sig: dict[str, str] = {}
    consts: dict[str, Any] = {}
    for name, arg in zip(names, args):
        if isinstance(arg, torch.Tensor):
            sig[name] = "*" + _TYPES[arg.dtype]
        elif type(arg).__name__ == "TensorDescriptor":  # host TMA descriptor (Gluon's: with
            sig[name] = mangle_type(arg)                  # its shared-memory layout)
        elif isinstance(arg, bool):
            sig[name] = "i1"
        elif isinstance(arg, int):
            sig[name] = "i32" if -2**31 <= arg < 2**31 else "i64"
        elif isinstance(arg, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{name}: {type(arg)}")
    for name, val in kwargs.items():
        sig[name] = "constexpr"
        consts[name] = val
    if "num_warps" in names and "num_warps" in options:  # a Gluon kernel's parameter too
        sig["num_warps"] = "constexpr"
        consts["num_warps"] = options["num_warps"]
    for param in fn.params:  # constexpr parameters left at their defaults
        if param.name not in sig and param.is_constexpr and param.has_default:
            sig[param.name] = "constexpr"
            consts[param.name] = param.default
    missing = set(names) - set(sig)
    if missing:
        raise TypeError(f"unbound kernel args {missing}")
    return sig, consts, options


# -- recorders -------------------------------------------------------------------------


def record_paged(target: Target) -> list[Call]:
    from vllm.attention import KVQuant
    from vllm.attention.backend import PagedAttentionMetadata
    from vllm.attention.batch import make_paged_batch
    from vllm.attention.layouts import kv_cache_shape
    from vllm.attention.ops import triton_paged_attention as tpa
    from vllm.attention.ops import triton_paged_kernels as kern
    from vllm.attention.ops.paged_kv import PagedKV
    from vllm.attention.types import KVCacheLayout, cache_storage_dtype

    calls: list[Call] = []
    # (layout, cache dtype, model dtype, query lengths, context lengths, head size)
    cases: list[tuple[KVCacheLayout, str, torch.dtype, list[int], list[int], int]] = [
        (KVCacheLayout.SPLIT_NHD, "auto", torch.bfloat16, [1] * 4, [300] * 4, 64),
        (KVCacheLayout.SPLIT_NHD, "fp8_e4m3", torch.bfloat16, [17, 1], [0, 40], 64),
        (KVCacheLayout.LEGACY_PAGED, "auto", torch.float16, [3, 1], [5, 20], 64),
        (KVCacheLayout.AITER_SHUFFLED, "auto", torch.bfloat16, [3, 1], [5, 20], 64),
        (KVCacheLayout.PER_TOKEN_HEAD_QUANT, "int8_per_token_head", torch.bfloat16,
         [2, 1], [0, 33], 64),
        # long prefills (128-row tiles; at D=128 on a target of WIDE_PREFILL_ON the
        # 256-row launch) and a split-K decode
        (KVCacheLayout.SPLIT_NHD, "auto", torch.bfloat16, [1100, 1], [0, 40], 64),
        (KVCacheLayout.SPLIT_NHD, "auto", torch.bfloat16, [1100, 1], [0, 40], 128),
        (KVCacheLayout.SPLIT_NHD, "auto", torch.bfloat16, [1, 1], [2047, 1500], 64)]
    with as_gpu(target.gpu), \
         patched(tpa, triton_unavailable_reason=lambda device: None,  # record on CPU tensors
                 interpreter_active=lambda: False), \
         patched(kern, paged_attention_kernel=Recorder("paged", kern.paged_attention_kernel,
                                                       calls),
                 reduce_splits_kernel=Recorder("reduce", kern.reduce_splits_kernel, calls)):
        for layout, cdt, dtype, ql, cl, d in cases:
            batch = make_paged_batch(ql, cl, block_size=16)
            shape = kv_cache_shape(layout, batch.num_blocks, 16, 2, d)
            cache = torch.zeros(shape, dtype=cache_storage_dtype(cdt, dtype))  # type: ignore[arg-type]
            quant = KVQuant(cdt, torch.ones(1), torch.ones(1))  # type: ignore[arg-type]
            kv = PagedKV.from_cache(cache, layout, quant, block_size=16, num_kv_heads=2,
                                    head_size=d)
            n = sum(ql)
            q = torch.zeros(n, 8, d, dtype=dtype)
            out = torch.zeros(n, 8, d, dtype=dtype)
            meta = PagedAttentionMetadata.from_common(batch.common)
            for sw in (None, 7):
                tpa.paged_attention_triton(q, kv, meta, scale=0.1, output=out, causal=True,
                                           sliding_window=sw,
                                           logits_soft_cap=None if sw else 5.0)
    return calls


def record_mla(target: Target) -> list[Call]:
    from vllm.attention.ops import gluon_mla_decode_kernels as gkern
    from vllm.attention.ops import gluon_mla_few_heads_kernels as hkern
    from vllm.attention.ops import gluon_mla_fp8_kernels as fkern
    from vllm.attention.ops import gluon_mla_lead_kernels as lkern
    from vllm.attention.ops import head_matmul, triton_mla, triton_mla_decode
    from vllm.attention.ops import triton_head_matmul_kernels as hm_kern
    from vllm.attention.ops import triton_mla_decode_kernels as dkern
    from vllm.attention.ops import triton_mla_kernels as kern
    from vllm.attention.ops.mla_attention import LatentFormat

    calls: list[Call] = []
    rec = (Recorder("mla_split", kern.mla_split_kernel, calls),
           Recorder("mla_combine", kern.mla_combine_kernel, calls))
    # the dense decode's tensor-core kernel, with the launch the target's GPU gets
    drec = (Recorder("mla_decode", dkern.mla_decode_mma_kernel, calls),
            Recorder("mla_decode_combine", dkern.mla_decode_combine_kernel, calls))
    bt = torch.zeros(2, 4, dtype=torch.int32)
    req = torch.tensor([0, 1], dtype=torch.int32)
    pos = torch.tensor([30, 100], dtype=torch.int32)
    with as_gpu(target.gpu), \
            patched(triton_mla, _kernels=lambda interp: rec, _interpreting=lambda: False), \
            patched(triton_mla_decode, _kernels=lambda interp: drec,
                    _gluon_kernel=lambda: Recorder("mla_decode_gluon",
                                                   gkern.mla_decode_gluon_kernel, calls),
                    _lead_kernel=lambda: Recorder("mla_decode_lead",
                                                  lkern.mla_decode_lead_kernel, calls),
                    _fp8_mma_kernel=lambda: Recorder("mla_decode_fp8_mma",
                                                     fkern.mla_decode_fp8_mma_kernel, calls),
                    _few_heads_kernel=lambda: Recorder("mla_decode_few_heads",
                                                       hkern.mla_decode_few_heads_kernel,
                                                       calls),
                    _interpreting=lambda: False,
                    _device_facts=lambda device: (132, target.gpu)):
        for cdt, storage, width in (("auto", torch.bfloat16, 576),
                                    ("fp8", torch.float8_e4m3fn, 576),
                                    ("fp8_ds_mla", torch.uint8, 656)):
            cache = torch.zeros(4, 64, width, dtype=storage)
            fmt = LatentFormat(cdt, 512, 64, torch.ones(1), torch.bfloat16)  # type: ignore[arg-type]
            q = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
            triton_mla.mla_decode_triton(q, cache, bt, req, pos, fmt, scale=0.1,
                                         max_seq_len=101)
            if cdt != "fp8_ds_mla":  # 16 heads on the lead kernel where the default is
                # the few-heads one (sm_90)
                cfg16 = triton_mla_decode.default_config(torch.bfloat16, target.gpu)
                triton_mla_decode.mla_decode_mma(
                    q, cache, bt, req, pos, fmt, scale=0.1, max_seq_len=101,
                    config=dataclasses.replace(cfg16, few_heads=False))
            if cdt != "fp8_ds_mla":  # DeepSeek-V3's 128 heads: the 64-head tiles
                q128 = torch.zeros(2, 128, 576, dtype=torch.bfloat16)
                triton_mla.mla_decode_triton(q128, cache, bt, req, pos, fmt, scale=0.1,
                                             max_seq_len=101)
                # the Triton kernel where the default is a Gluon one (sm_90, 16-bit),
                # the split-scores Gluon kernel where the default is the lead one, and
                # the opt-in fp8-MMA kernel (E4M3, sm_90)
                cfg = triton_mla_decode.default_config(torch.bfloat16, target.gpu)
                for other in (dataclasses.replace(cfg, gluon=False),
                              dataclasses.replace(cfg, lead=False),
                              dataclasses.replace(cfg, fp8_mma=True)):
                    triton_mla_decode.mla_decode_mma(
                        q128, cache, bt, req, pos, fmt, scale=0.1, max_seq_len=101,
                        config=other)
            topk = torch.zeros(2, 64, dtype=torch.int32)
            triton_mla.mla_sparse_triton(q, cache, topk, req, pos, bt, fmt, scale=0.1)
    # the per-head products around the decode: absorption (K=128) and projection (K=512)
    hrec = Recorder("head_matmul", hm_kern.head_matmul_kernel, calls)
    with patched(head_matmul, _kernel=lambda interp: hrec, unsupported_reasons=lambda a, w: []):
        for dtype in (torch.bfloat16, torch.float16):
            for t, k, c in ((64, 128, 512), (256, 512, 128), (5, 128, 512)):
                head_matmul.head_matmul(torch.zeros(t, 128, k, dtype=dtype),
                                        torch.zeros(128, k, c, dtype=dtype), path="triton")
    return calls


WRITER_ENVS: tuple[dict[str, str], ...] = (
    {}, {"VLLM_KV_FAST_DIV": "0"}, {"VLLM_KV_HW_NAN": "0"}, {"VLLM_KV_HW_NAN": "1"})
"""The writers' A/B switches: every combination of hardware paths a launcher can choose
on a target (FAST_DIV off; the NaN select kept or dropped) is compiled."""


def _flags(consts: dict[str, Any]) -> str:
    on = [k.lower() for k in (*NVIDIA_ONLY, "SCALAR_S", "SAME_SCALE") if consts.get(k)]
    return f"[{','.join(on)}]" if on else ""


def writer_launches() -> list[tuple[str, Any]]:
    """``(name, Launch)`` of every writer launcher on representative shapes, built under
    the device decisions in force (:func:`as_gpu`)."""
    from vllm.attention.layouts import (
        aiter_shuffled_views,
        legacy_paged_views,
        mla_latent_views,
        split_kv_views,
    )
    from vllm.attention.types import KVCacheLayout
    from vllm.attention.writers import kernels as tw

    out: list[tuple[str, Any]] = []
    h, d, t = 8, 128, 4096
    key = torch.zeros(t, h, d, dtype=torch.bfloat16)
    q = torch.zeros(t, 32, d, dtype=torch.bfloat16)
    slots = torch.zeros(t, dtype=torch.int64)
    heads, one = torch.ones(h), torch.ones(1)
    table = torch.zeros(4096, d)
    for cdt, storage, mode in (("auto", torch.bfloat16, 0), ("fp8_e4m3", torch.uint8, 1),
                               ("fp8_e5m2", torch.uint8, 2)):
        cache = torch.zeros(300, 2, 16, h, d, dtype=storage)
        kt, vt = (tw.ScatterTarget.token_major(x)
                  for x in split_kv_views(cache, KVCacheLayout.SPLIT_NHD))
        for n in (1, t):  # one token per program, and several
            for s in (heads, one):
                out.append((f"tiled-{cdt}-T{n}", tw.scatter_kv_launch(
                    key[:n], key[:n], kt, vt, slots[:n], mode, s, s)))
        for neox in (True, False):
            for s in (heads, one):
                out.append((f"rope-{cdt}-{'neox' if neox else 'gptj'}", tw.rope_kv_launch(
                    q, key, key, kt, vt, slots, slots, table, neox, mode, s, s)))
        # several tokens a program (keys only, as large batches launch it)
        out.append((f"rope-{cdt}-noq-T{t}", tw.rope_kv_launch(
            None, key, key, kt, vt, slots, slots, table, True, mode, one, one)))
    half_table = torch.zeros(4096, 64, dtype=torch.bfloat16)  # partial rotary, bf16 table
    out.append(("rope-partial-noq", tw.rope_kv_launch(None, key, key, kt, vt, slots, slots,
                                                      half_table, True, 0, heads, heads)))
    out.append(("rope-only", tw.rope_launch(q, key, slots, table, True)))
    pe = torch.zeros(t, 1, 64, dtype=torch.bfloat16)
    kv_c = torch.zeros(t, 1, 512, dtype=torch.bfloat16)
    for cdt, storage, mode in (("auto", torch.bfloat16, 0), ("fp8", torch.float8_e4m3fn, 1)):
        latent, rope = mla_latent_views(torch.zeros(300, 16, 576, dtype=storage), 512)
        lt = tw.ScatterTarget.token_major(latent.unsqueeze(2))
        rt = tw.ScatterTarget.token_major(rope.unsqueeze(2))
        mla = tw.scatter_kv_launch(kv_c, pe, lt, rt, slots, mode, one, one, same_scale=True)
        out.append((f"tiled-mla-{cdt}", mla))
        # the L2 hints tune_writers.py times as a launch variant
        out.append((f"tiled-mla-{cdt}-hints5", dataclasses.replace(
            mla, constexprs={**mla.constexprs, "CACHE_HINTS": 5})))
        out.append((f"rope-mla-{cdt}", tw.rope_kv_launch(
            torch.zeros(t, 16, 64, dtype=torch.bfloat16), pe, kv_c, rt, lt, slots, slots,
            torch.zeros(4096, 64), False, mode, one, one, same_scale=True)))
    # tiles of fewer elements than threads (one head of 1, 2 or 4 dimensions, rows
    # contiguous or every other element): the one-element code, where the two-element
    # inline PTX cannot compile
    for dim, step in ((1, 1), (2, 1), (2, 2), (4, 1)):
        small = torch.zeros(t, 1, dim * step, dtype=torch.bfloat16)[:, :, ::step]
        cache8 = torch.zeros(300, 2, 16, 1, dim, dtype=torch.uint8)
        st = [tw.ScatterTarget.token_major(x)
              for x in split_kv_views(cache8, KVCacheLayout.SPLIT_NHD)]
        for n in (1, t):
            out.append((f"tiled-fp8-H1D{dim}s{step}-T{n}", tw.scatter_kv_launch(
                small[:n], small[:n], st[0], st[1], slots[:n], 1, one, one)))
            if dim > 1:  # a rotary pair
                out.append((f"rope-fp8-H1D{dim}s{step}-T{n}", tw.rope_kv_launch(
                    None, small[:n], small[:n], st[0], st[1], slots[:n], slots[:n],
                    torch.zeros(4096, dim), True, 1, one, one)))
    # the generic scatter (x-split layouts) and the row-scaled writes
    f32 = torch.zeros(5, h, d)
    legacy = torch.zeros(2, 4, 16 * h * d, dtype=torch.float8_e5m2)
    k5, v4 = legacy_paged_views(legacy, h, d)
    out.append(("generic-legacy-fp8_e5m2-fp32", tw.scatter_kv_launch(
        f32, f32, tw.ScatterTarget.x_split_key(k5), tw.ScatterTarget.head_major_value(v4),
        slots[:5], 2, one, one)))
    ak, av = aiter_shuffled_views(torch.zeros(2, 4, 16, h, d, dtype=torch.bfloat16))
    out.append(("generic-aiter-auto-bf16", tw.scatter_kv_launch(
        key[:5], key[:5], tw.ScatterTarget.x_split_key(ak), tw.ScatterTarget.x_split_value(av),
        slots[:5], 0, heads, heads)))
    ak8, av8 = aiter_shuffled_views(torch.zeros(2, 4, 16, h, d, dtype=torch.uint8))
    out.append(("generic-aiter-fp8_e4m3-bf16", tw.scatter_kv_launch(
        key[:5], key[:5], tw.ScatterTarget.x_split_key(ak8),
        tw.ScatterTarget.x_split_value(av8), slots[:5], 1, heads, heads)))
    ptq = torch.zeros(4, 2, 16, h, d + 4, dtype=torch.uint8)
    pk, pv = split_kv_views(ptq, KVCacheLayout.PER_TOKEN_HEAD_QUANT)
    for int8 in (True, False):
        out.append((f"per-token-head-{'int8' if int8 else 'fp8'}",
                    tw.per_token_head_launch(key[:5], key[:5], pk, pv, slots[:5], int8)))
    ds = torch.zeros(4, 64, 656, dtype=torch.uint8)
    out.append(("fp8_ds_mla-bf16", tw.fp8_ds_mla_launch(kv_c[:5, 0], pe[:5, 0], ds, slots[:5])))
    out.append(("fp8_ds_mla-fp32", tw.fp8_ds_mla_launch(torch.zeros(5, 512),
                                                        torch.zeros(5, 64), ds, slots[:5])))
    return out


def record_writers(target: Target) -> list[Call]:
    """Every writer launch, with the flags its launcher chooses on ``target``'s GPU under
    each of :data:`WRITER_ENVS`."""
    from vllm.attention.writers import kernels as tw

    kern = tw.load_kernels(interpret=False)
    calls: list[Call] = []
    for env in WRITER_ENVS:
        with as_gpu(target.gpu, env):
            launches = writer_launches()
        for name, launch in launches:
            consts = dict(launch.constexprs)
            calls.append((f"{name}{_flags(consts)}", getattr(kern, launch.kernel),
                          launch.args, {**consts, **launch.options}))
    return calls


RECORDERS: dict[str, Callable[[Target], list[Call]]] = {
    "paged": record_paged,
    "mla": record_mla,
    "writers": record_writers,
}
"""Every family of Triton launches, by name (``--group``)."""


# -- checks ----------------------------------------------------------------------------


def _ptx_problem(consts: dict[str, Any], name: str, ptx: str) -> str | None:
    # the scales' reciprocal (FAST_RCP: inline PTX with the division's own FMA steps) is
    # not the rotation's arithmetic
    rotation = re.sub(r"// begin inline asm\n[^\n]*rcp\.approx[^\n]*\n\s*// end inline asm",
                      "", ptx)
    if name.startswith("rope") and not consts.get("FAST_DIV") and re.search(r"\bfma\.",
                                                                            rotation):
        # (FAST_DIV's quotient is the only FMA; without it the rotation must have none)
        return "an FMA in a RoPE kernel (products and sums must round one by one)"
    if consts.get("HW_CVT") and "cvt.rn.satfinite" not in ptx:
        return "HW_CVT without a cvt.rn.satfinite conversion"
    if consts.get("FAST_DIV") and not re.search(r"\bfma\.rn\.f32\b", ptx):
        return "FAST_DIV without fma.rn.f32 (the Markstein correction)"
    # (the row-scaled kernels have no MODE: they always divide)
    divides = set(re.findall(r"\bdiv\.[a-z0-9.]+\.f32\b", ptx))
    if consts.get("MODE", 1) and divides != {"div.rn.f32"}:
        return f"a scaled write that does not divide with div.rn.f32 alone ({sorted(divides)})"
    return None


def wgmma_serialised(ptx: str) -> bool:
    """Whether ptxas serialises the warpgroup MMAs of this sm_90 PTX: its performance
    notes C7514 / C7515, given when code other than MMAs touches an accumulator's
    registers while an MMA group may be in flight; every MMA of the kernel then waits
    for the one before (the MLA decode's lead-warpgroup kernel ran 1.6 x slower so)."""
    ptxas = os.path.join(NVIDIA_BIN, "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o",
                              os.path.join(d, "k.cubin")], capture_output=True, text=True)
    return "instructions are serialized" in out.stdout + out.stderr


def problem(target: Target, group: str, name: str, consts: dict[str, Any],
            asm: dict[str, Any]) -> str | None:
    """What must hold for a compiled launch (None when it does)."""
    if group == "writers":
        if target.gpu.vendor != "nvidia" or target.gpu.capability < (8, 9):
            chosen = [k for k in NVIDIA_ONLY if consts.get(k)]
            if chosen and target.gpu.vendor != "nvidia":
                return f"NVIDIA-only paths chosen on {target.name}: {chosen}"
            if consts.get("HW_CVT"):
                return f"hardware fp8 conversion chosen on {target.name}"
        if target.gpu.vendor == "nvidia":
            return _ptx_problem(consts, name, asm["ptx"])
    if target.gpu.vendor == "nvidia" and target.gpu.capability == (9, 0) \
            and "wgmma.mma_async" in asm["ptx"] and wgmma_serialised(asm["ptx"]):
        return "ptxas serialises its warpgroup MMAs (C7514/C7515: a wait after each)"
    if target.gpu.vendor == "amd":
        # inline assembly in the LLVM IR: PTX the AMD backend would reject, or worse
        if re.search(r"\basm\s+(sideeffect\s+)?\"", asm["llir"]):
            return "inline assembly in the LLVM IR for an AMD target"
        if "hsaco" not in asm:
            return "no code object (hsaco)"
    return None


def backend_unavailable(target: Target) -> str | None:
    """Why Triton cannot compile for ``target`` here (None when it can)."""
    from triton.backends import backends

    name = "nvidia" if target.backend.backend == "cuda" else "amd"
    if name not in backends:
        return f"this triton has no {name} backend (backends: {sorted(backends)})"
    return None


KNOWN_GAPS: tuple[tuple[str, str, str, str], ...] = (
    ("sm_80", "paged", "type fp8e4nv not supported",
     "paged attention reads E4M3 caches as tl.float8e4nv, which Triton 3.6 has only for "
     "sm_89+ (vllm/attention/ops/triton_paged_kernels.py)"),
)
"""``(target, group, error text, why)``: launches known not to compile there, reported as
gaps (not failures) until their owners close them; ``docs/kernels.md`` lists them."""


# -- compiling -------------------------------------------------------------------------

_JOBS: list[tuple[Target, str, Call]] = []


def _error(exc: Exception) -> str:
    """The lines of a compile error that say what failed (ptxas and LLVM errors come with
    the whole module's source)."""
    text = f"{type(exc).__name__}: {exc}"
    errors = [line.strip() for line in text.splitlines() if "error" in line.lower()]
    return " | ".join(dict.fromkeys(errors[:6])) if errors else text[-1500:]


def _compile(index: int) -> tuple[int, str | None]:
    """Compile job ``index`` of :data:`_JOBS` (a forked worker inherits them)."""
    target, group, (name, fn, args, kwargs) = _JOBS[index]
    try:
        sig, consts, options = _sig(fn, args, dict(kwargs))
        source = GluonASTSource if fn.is_gluon() else ASTSource
        src = source(fn=fn, signature=sig, constexprs=consts)
        compiled = triton.compile(src, target=target.backend, options=options)
        return index, problem(target, group, name, consts, compiled.asm)
    except Exception as exc:
        return index, _error(exc)


def _gap(target: Target, group: str, trouble: str) -> str | None:
    for t, g, text, why in KNOWN_GAPS:
        if t == target.name and g == group and text in trouble:
            return why
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=",".join(TARGETS),
                    help=f"comma-separated, of {', '.join(TARGETS)} (default: all)")
    ap.add_argument("--group", default=",".join(RECORDERS),
                    help=f"comma-separated, of {', '.join(RECORDERS)} (default: all)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args(argv)
    targets = [TARGETS[t] for t in a.target.split(",")]
    groups = a.group.split(",")
    counts: dict[str, list[int]] = {}
    for target in targets:
        reason = backend_unavailable(target)
        if reason is not None:
            print(f"skip {target.name}: {reason}")
            continue
        counts[target.name] = [0, 0]
        for group in groups:
            seen = set()
            try:
                calls = RECORDERS[group](target)
            except Exception as exc:  # one broken family must not hide the others
                counts[target.name][1] += 1
                print(f"FAIL {target.name:7} {group:8} (recording): {_error(exc)}")
                continue
            for call in calls:
                name, fn, args, kwargs = call
                sig, consts, _ = _sig(fn, args, dict(kwargs))
                key = (group, name, tuple(sorted(sig.items())),
                       tuple(sorted(consts.items())), tuple(sorted(kwargs.items())))
                if key not in seen:
                    seen.add(key)
                    _JOBS.append((target, group, call))
    if a.jobs > 1 and len(_JOBS) > 1:
        with multiprocessing.get_context("fork").Pool(a.jobs) as pool:
            results = pool.imap(_compile, range(len(_JOBS)))
            outcome = list(results)
    else:
        outcome = [_compile(i) for i in range(len(_JOBS))]
    gaps = 0
    for index, trouble in outcome:
        target, group, (name, _, _, _) = _JOBS[index]
        why = None if trouble is None else _gap(target, group, trouble)
        if trouble is None:
            counts[target.name][0] += 1
            print(f"ok   {target.name:7} {group:8} {name}")
        elif why is not None:
            gaps += 1
            print(f"gap  {target.name:7} {group:8} {name}: {why}")
        else:
            counts[target.name][1] += 1
            print(f"FAIL {target.name:7} {group:8} {name}: {trouble}")
    for name, (ok, bad) in counts.items():
        print(f"{name}: {ok} compiled, {bad} failed")
    failed = sum(bad for _, bad in counts.values())
    print(f"{sum(ok for ok, _ in counts.values())} compiled, {failed} failed, "
          f"{gaps} known gaps (KNOWN_GAPS)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
