"""Compile every Triton attention launch for sm_90 without a GPU.

Runs representative calls of the paged-attention and MLA launchers on CPU
tensors with the kernels replaced by recorders, then compiles each recorded
launch ahead of time with exactly its arguments (``triton.compile`` for the
``cuda`` target). The writers' fused RoPE and tiled scatter launches are built
directly (their PTX is checked too: no FMA in RoPE, hardware fp8 conversion
where selected, IEEE division). Exit 1 if any launch fails to compile. Used by
``tests/ops/test_triton_compile.py`` in a subprocess (the interpreter setting
of the test process must not leak in).
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

_TYPES = {torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32",
          torch.int64: "i64", torch.float32: "fp32", torch.float16: "fp16",
          torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}


class Recorder:
    def __init__(self, name: str, fn: Any, calls: list[tuple[str, Any, tuple, dict]]) -> None:
        self.name, self.fn, self.calls = name, fn, calls

    def __getitem__(self, grid: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> None:
            self.calls.append((self.name, self.fn, args, kwargs))
        return run


def _sig(fn: Any, args: tuple, kwargs: dict) -> tuple[dict[str, str], dict[str, Any], dict]:
    names = list(fn.arg_names)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion")
               if k in kwargs}
    sig: dict[str, str] = {}
    consts: dict[str, Any] = {}
    for name, arg in zip(names, args):
        if isinstance(arg, torch.Tensor):
            sig[name] = "*" + _TYPES[arg.dtype]
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
    missing = set(names) - set(sig)
    if missing:
        raise TypeError(f"unbound kernel args {missing}")
    return sig, consts, options


def record_paged() -> list:
    from vllm.attention import KVQuant
    from vllm.attention.batch import make_paged_batch
    from vllm.attention.ops import triton_paged_kernels as kern
    from vllm.attention.ops.paged_kv import PagedKV
    from vllm.attention.ops import triton_paged_attention as tpa
    from vllm.attention.ops.triton_paged_attention import paged_attention_triton
    from vllm.attention.types import KVCacheLayout

    calls: list = []
    tpa.triton_unavailable_reason = lambda device: None  # record on CPU tensors
    tpa.interpreter_active = lambda: False
    kern.paged_attention_kernel = Recorder("paged", kern.paged_attention_kernel, calls)
    kern.reduce_splits_kernel = Recorder("reduce", kern.reduce_splits_kernel, calls)
    cases = [(KVCacheLayout.SPLIT_NHD, "auto", torch.bfloat16, [1] * 4, [300] * 4),
             (KVCacheLayout.SPLIT_NHD, "fp8_e4m3", torch.bfloat16, [17, 1], [0, 40]),
             (KVCacheLayout.LEGACY_PAGED, "auto", torch.float16, [3, 1], [5, 20]),
             (KVCacheLayout.AITER_SHUFFLED, "auto", torch.bfloat16, [3, 1], [5, 20]),
             (KVCacheLayout.PER_TOKEN_HEAD_QUANT, "int8_per_token_head", torch.bfloat16,
              [2, 1], [0, 33])]
    for layout, cdt, dtype, ql, cl in cases:
        batch = make_paged_batch(ql, cl, block_size=16)
        from vllm.attention.layouts import kv_cache_shape
        from vllm.attention.types import cache_storage_dtype
        shape = kv_cache_shape(layout, batch.num_blocks, 16, 2, 64)
        cache = torch.zeros(shape, dtype=cache_storage_dtype(cdt, dtype))  # type: ignore[arg-type]
        quant = KVQuant(cdt, torch.ones(1), torch.ones(1))  # type: ignore[arg-type]
        kv = PagedKV.from_cache(cache, layout, quant, block_size=16, num_kv_heads=2,
                                head_size=64)
        n = sum(ql)
        q = torch.zeros(n, 8, 64, dtype=dtype)
        out = torch.zeros(n, 8, 64, dtype=dtype)
        from vllm.attention.backend import PagedAttentionMetadata
        meta = PagedAttentionMetadata.from_common(batch.common)
        for sw in (None, 7):
            paged_attention_triton(q, kv, meta, scale=0.1, output=out, causal=True,
                                   sliding_window=sw, logits_soft_cap=None if sw else 5.0)
    return calls


def record_mla() -> list:
    from vllm.attention.ops import triton_mla
    from vllm.attention.ops import triton_mla_kernels as kern
    from vllm.attention.ops.mla_attention import LatentFormat

    calls: list = []
    rec = (Recorder("mla_split", kern.mla_split_kernel, calls),
           Recorder("mla_combine", kern.mla_combine_kernel, calls))
    triton_mla._kernels = lambda interp: rec  # type: ignore[assignment]
    triton_mla._interpreting = lambda: False
    bt = torch.zeros(2, 4, dtype=torch.int32)
    req = torch.tensor([0, 1], dtype=torch.int32)
    pos = torch.tensor([30, 100], dtype=torch.int32)
    for cdt, storage, width in (("auto", torch.bfloat16, 576), ("fp8", torch.float8_e4m3fn, 576),
                                ("fp8_ds_mla", torch.uint8, 656)):
        cache = torch.zeros(4, 64, width, dtype=storage)
        fmt = LatentFormat(cdt, 512, 64, torch.ones(1), torch.bfloat16)  # type: ignore[arg-type]
        q = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
        triton_mla.mla_decode_triton(q, cache, bt, req, pos, fmt, scale=0.1, max_seq_len=101)
        topk = torch.zeros(2, 64, dtype=torch.int32)
        triton_mla.mla_sparse_triton(q, cache, topk, req, pos, bt, fmt, scale=0.1)
    return calls


def record_writers() -> list:
    """The fused RoPE + write launches and the tiled scatter (with the sm_89+ hardware
    fp8 conversion the CPU recording cannot select by itself)."""
    import dataclasses

    from vllm.attention.layouts import mla_latent_views, split_kv_views
    from vllm.attention.writers import kernels as tw
    from vllm.attention.types import KVCacheLayout

    kern = tw.load_kernels(interpret=False)
    calls: list = []

    def add(name: str, launch: Any, **const: Any) -> None:
        if const.get("HW_CVT"):  # as the launches select it on sm_89+
            warps = int(launch.options.get("num_warps", tw.TRITON_DEFAULT_WARPS))
            const.setdefault("PACKED_WIDEN", tw.packed_widen(
                launch.kernel, {**launch.constexprs, **const}, warps))
            const.setdefault("FAST_RCP", True)
        launch = dataclasses.replace(launch, constexprs={**launch.constexprs, **const})
        calls.append((name, getattr(kern, launch.kernel), launch.args,
                      {**launch.constexprs, **launch.options}))

    h, d, t = 8, 128, 4096
    key = torch.zeros(t, h, d, dtype=torch.bfloat16)
    q = torch.zeros(t, 32, d, dtype=torch.bfloat16)
    slots = torch.zeros(t, dtype=torch.int64)
    scale = torch.ones(h)
    table = torch.zeros(4096, d)
    for cdt, storage, mode in (("auto", torch.bfloat16, 0), ("fp8_e4m3", torch.uint8, 1),
                               ("fp8_e5m2", torch.uint8, 2)):
        cache = torch.zeros(300, 2, 16, h, d, dtype=storage)
        kt, vt = (tw.ScatterTarget.token_major(x) for x in split_kv_views(cache, KVCacheLayout.SPLIT_NHD))
        for n in (1, t):  # one token per program, and several
            launch = tw.scatter_kv_launch(key[:n], key[:n], kt, vt, slots[:n], mode, scale, scale)
            add(f"tiled-{cdt}-T{n}", launch, HW_CVT=False)
            if mode:
                add(f"tiled-{cdt}-T{n}-hwcvt", launch, HW_CVT=True)
                add(f"tiled-{cdt}-T{n}-hwcvt-fastdiv", launch, HW_CVT=True, FAST_DIV=True)
                add(f"tiled-{cdt}-T{n}-hwcvt-fastdiv-onescale", launch, HW_CVT=True,
                    FAST_DIV=True, SCALAR_S=True)
                add(f"tiled-{cdt}-T{n}-hwcvt-fastdiv-hwnan", launch, HW_CVT=True,
                    FAST_DIV=True, HW_NAN=True)
        for neox in (True, False):
            launch = tw.rope_kv_launch(q, key, key, kt, vt, slots, slots, table, neox, mode,
                                       scale, scale)
            add(f"rope-{cdt}-{'neox' if neox else 'gptj'}", launch)
            if mode:
                add(f"rope-{cdt}-{'neox' if neox else 'gptj'}-hwcvt", launch, HW_CVT=True)
                add(f"rope-{cdt}-{'neox' if neox else 'gptj'}-hwcvt-onescale", launch,
                    HW_CVT=True, SCALAR_S=True)
                add(f"rope-{cdt}-{'neox' if neox else 'gptj'}-hwcvt-fastdiv-hwnan", launch,
                    HW_CVT=True, FAST_DIV=True, HW_NAN=True)
        if mode:  # several tokens a program (keys only, as large batches launch it)
            launch = tw.rope_kv_launch(None, key, key, kt, vt, slots, slots, table, True, mode,
                                       scale[:1], scale[:1])
            for bt in (2, 4):
                add(f"rope-{cdt}-noq-T{bt}-hwcvt-fastdiv-hwnan", launch, BLOCK_T=bt,
                    HW_CVT=True, FAST_DIV=True, HW_NAN=True)
    half_table = torch.zeros(4096, 64, dtype=torch.bfloat16)  # partial rotary, bf16 table
    add("rope-partial-noq", tw.rope_kv_launch(None, key, key, kt, vt, slots, slots, half_table,
                                              True, 0, scale, scale))
    add("rope-only", tw.rope_launch(q, key, slots, table, True))
    mla = torch.zeros(300, 16, 576, dtype=torch.bfloat16)
    latent, rope = mla_latent_views(mla, 512)
    pe = torch.zeros(t, 1, 64, dtype=torch.bfloat16)
    kv_c = torch.zeros(t, 1, 512, dtype=torch.bfloat16)
    add("rope-mla", tw.rope_kv_launch(
        torch.zeros(t, 16, 64, dtype=torch.bfloat16), pe, kv_c,
        tw.ScatterTarget.token_major(rope.unsqueeze(2)),
        tw.ScatterTarget.token_major(latent.unsqueeze(2)), slots, slots, torch.zeros(4096, 64),
        False, 0, scale[:1], scale[:1]))
    mla8 = torch.zeros(300, 16, 576, dtype=torch.float8_e4m3fn)
    latent8, rope8 = mla_latent_views(mla8, 512)
    add("tiled-mla-fp8-hwcvt-fastdiv-hwnan", tw.scatter_kv_launch(
        kv_c, pe, tw.ScatterTarget.token_major(latent8.unsqueeze(2)),
        tw.ScatterTarget.token_major(rope8.unsqueeze(2)), slots, 1, scale[:1], scale[:1],
        same_scale=True), HW_CVT=True, FAST_DIV=True, HW_NAN=True)
    add("rope-mla-fp8-hwcvt-fastdiv-hwnan", tw.rope_kv_launch(
        torch.zeros(t, 16, 64, dtype=torch.bfloat16), pe, kv_c,
        tw.ScatterTarget.token_major(rope8.unsqueeze(2)),
        tw.ScatterTarget.token_major(latent8.unsqueeze(2)), slots, slots, torch.zeros(4096, 64),
        False, 1, scale[:1], scale[:1], same_scale=True), HW_CVT=True, FAST_DIV=True,
        HW_NAN=True)
    add("tiled-mla-latent", tw.scatter_kv_launch(
        kv_c, pe, tw.ScatterTarget.token_major(latent.unsqueeze(2)),
        tw.ScatterTarget.token_major(rope.unsqueeze(2)), slots, 0, scale[:1], scale[:1]))
    # tiles of fewer elements than threads (one head of 1, 2 or 4 dimensions, rows
    # contiguous or every other element): the one-element code, where the two-element
    # inline PTX cannot compile
    for dim, step in ((1, 1), (2, 1), (2, 2), (4, 1)):
        small = torch.zeros(t, 1, dim * step, dtype=torch.bfloat16)[:, :, ::step]
        cache8 = torch.zeros(300, 2, 16, 1, dim, dtype=torch.uint8)
        st = [tw.ScatterTarget.token_major(x)
              for x in split_kv_views(cache8, KVCacheLayout.SPLIT_NHD)]
        for n in (1, t):
            add(f"tiled-fp8-H1D{dim}s{step}-T{n}-hwcvt-fastdiv-hwnan", tw.scatter_kv_launch(
                small[:n], small[:n], st[0], st[1], slots[:n], 1, scale[:1], scale[:1]),
                HW_CVT=True, FAST_DIV=True, HW_NAN=True)
            if dim == 1:  # no rotary pair
                continue
            add(f"rope-fp8-H1D{dim}s{step}-T{n}-hwcvt-fastdiv-hwnan", tw.rope_kv_launch(
                None, small[:n], small[:n], st[0], st[1], slots[:n], slots[:n],
                torch.zeros(4096, dim), True, 1, scale[:1], scale[:1]),
                HW_CVT=True, FAST_DIV=True, HW_NAN=True)
    return calls


def _ptx_problem(name: str, consts: dict[str, Any], ptx: str) -> str | None:
    """What must hold in the PTX of a writer launch (None when it does)."""
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
    if consts.get("MODE", 0) and set(re.findall(r"\bdiv\.[a-z0-9.]+\.f32\b", ptx)) != {"div.rn.f32"}:
        return "a scaled write that does not divide with div.rn.f32"
    return None


def main() -> int:
    calls = record_paged() + record_mla() + record_writers()
    failures = 0
    seen = set()
    for name, fn, args, kwargs in calls:
        sig, consts, options = _sig(fn, args, dict(kwargs))
        key = (name, tuple(sorted(sig.items())), tuple(sorted(consts.items())))
        if key in seen:
            continue
        seen.add(key)
        try:
            src = ASTSource(fn=fn, signature=sig, constexprs=consts)
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
            problem = _ptx_problem(name, consts, compiled.asm["ptx"])
            if problem is not None:
                failures += 1
                print(f"FAIL {name}: {problem}")
                continue
            print(f"ok   {name} {sorted(consts.items())[:4]}...")
        except Exception:
            failures += 1
            print(f"FAIL {name}: {traceback.format_exc(limit=3)}")
    print(f"{len(seen) - failures} compiled, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
