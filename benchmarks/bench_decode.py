"""Decode attention over a paged KV cache: the Triton kernel against PyTorch SDPA
over gathered pages and, when importable, flash-attn 4 (``flash_attn.cute``).

Default shape (the target): batch 64, 4096 context tokens, 32 query / 8 kv heads,
head size 128, bf16, page sizes 16, 32, 64, 128. Prints a table and writes
``decode.json`` under ``--out``. Run from the repository root on a CUDA machine::

    python benchmarks/bench_decode.py --out benchmarks/results/h200/<date>-<commit>
    python benchmarks/bench_decode.py --sweep --out DIR   # tune tiles

Each row's time is the median over ``--iters`` launches (CUDA events, after
warm-up). ``GB/s`` counts the K and V bytes a decode step must read once.
Without CUDA it runs a tiny smoke configuration (Triton only under
``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import timing_event  # noqa: E402
from vllm.attention.batch import make_paged_batch  # noqa: E402
from vllm.attention.layouts import (  # noqa: E402
    empty_in_stride_order,
    kv_cache_shape,
    kv_cache_stride_order,
)
from vllm.attention.ops.paged_kv import PagedKV  # noqa: E402
from vllm.attention.types import KVCacheLayout, KVQuant  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Row:
    impl: str
    page_size: int
    layout: str
    cache_dtype: str
    time_us: float | None
    gbps: float | None
    vs_fa4: float | None = None
    """fa4 time / this time (>= 1 means at least as fast as flash-attn 4)."""
    rel_err: float | None = None
    """Relative Frobenius error against SDPA over the gathered pages."""
    note: str = ""


def _time_us(fn: Callable[[], object], iters: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        samples = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t) * 1e6)
        return statistics.median(samples)
    torch.cuda.synchronize()
    starts = [timing_event() for _ in range(iters)]
    ends = [timing_event() for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(float(s.elapsed_time(e)) * 1e3 for s, e in zip(starts, ends))


def _allocate(layout: KVCacheLayout, nb: int, bs: int, h: int, d: int, dtype: torch.dtype,
              device: torch.device, g: torch.Generator) -> torch.Tensor:
    shape = kv_cache_shape(layout, nb, bs, h, d)
    cache = empty_in_stride_order(shape, kv_cache_stride_order(layout), dtype=dtype, device=device)
    return cache.copy_(torch.randn(shape, generator=g, device="cpu").to(dtype))


def _fa4() -> tuple[Callable[..., Any] | None, str]:
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as exc:  # not installed, or no cutlass DSL / unsupported GPU
        return None, f"flash_attn.cute not importable: {type(exc).__name__}: {exc}"
    return flash_attn_varlen_func, ""


def run(args: argparse.Namespace) -> list[Row]:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    b, ctx, hq, h, d = args.batch, args.context, args.heads, args.kv_heads, args.head_size
    scale = 1.0 / math.sqrt(d)
    kv_bytes = 2 * b * ctx * h * d * torch.empty((), dtype=dtype).element_size()
    rows: list[Row] = []
    fa4, fa4_note = _fa4() if device.type == "cuda" else (None, "needs CUDA")

    from vllm.attention.ops.triton_paged_attention import (
        TritonLaunchConfig,
        paged_attention_triton,
        triton_unavailable_reason,
    )

    triton_reason = triton_unavailable_reason(device)
    for bs in args.pages:
        batch = make_paged_batch([1] * b, [ctx - 1] * b, block_size=bs, device=device, generator=g)
        meta = batch.common
        nb = batch.num_blocks
        q = torch.randn(b, hq, d, generator=g).to(dtype).to(device)
        table = meta.block_table
        page_rows: list[Row] = []

        # PyTorch SDPA over pages gathered into a dense [B, H, S, D] batch.
        kv_first = _allocate(KVCacheLayout.SPLIT_KV_FIRST, nb, bs, h, d, dtype, device, g)
        k_pages, v_pages = kv_first[0], kv_first[1]

        def gather() -> tuple[torch.Tensor, torch.Tensor]:
            k = k_pages[table.long()].flatten(1, 2)[:, :ctx].transpose(1, 2)
            v = v_pages[table.long()].flatten(1, 2)[:, :ctx].transpose(1, 2)
            return k, v

        k_dense, v_dense = gather()
        q4 = q.unsqueeze(2)

        def sdpa() -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(
                q4, k_dense, v_dense, scale=scale, enable_gqa=True)

        def gather_sdpa() -> torch.Tensor:
            k, v = gather()
            return torch.nn.functional.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

        ref = sdpa().squeeze(2).float()
        for name, fn in (("sdpa (pre-gathered)", sdpa), ("gather + sdpa", gather_sdpa)):
            t = _time_us(fn, args.iters, args.warmup, device)
            page_rows.append(Row(name, bs, "dense", "auto", t, kv_bytes / t / 1e3))

        if fa4 is not None:
            cu_q = meta.query_start_loc.to(torch.int32)
            seqused = meta.seq_lens.to(torch.int32)
            ktab = table.to(torch.int32).contiguous()

            def fa4_call() -> Any:
                return fa4(q, k_pages, v_pages, cu_seqlens_q=cu_q, max_seqlen_q=1, seqused_k=seqused,
                           page_table=ktab, softmax_scale=scale, causal=True, num_splits=0)

            try:
                out = fa4_call()
                out = out[0] if isinstance(out, tuple) else out
                t = _time_us(fa4_call, args.iters, args.warmup, device)
                page_rows.append(Row("flash_attn.cute (fa4)", bs, "split_kv_first", "auto", t,
                                     kv_bytes / t / 1e3, rel_err=_err(out, ref)))
            except Exception as exc:  # unsupported page size etc.: report, keep going
                page_rows.append(Row("flash_attn.cute (fa4)", bs, "split_kv_first", "auto", None, None,
                                     note=f"{type(exc).__name__}: {str(exc)[:120]}"))
        else:
            page_rows.append(Row("flash_attn.cute (fa4)", bs, "-", "-", None, None, note=fa4_note))

        if triton_reason is None:
            variants: list[tuple[str, KVCacheLayout, str, dict[str, Any]]] = [
                ("triton", KVCacheLayout.SPLIT_KV_FIRST, "auto", {}),
                ("triton", KVCacheLayout.SPLIT_NHD, "auto", {}),
                ("triton no-split", KVCacheLayout.SPLIT_NHD, "auto", {"num_splits": 1}),
                ("triton", KVCacheLayout.SPLIT_NHD, "fp8_e4m3", {}),
                ("triton", KVCacheLayout.LEGACY_PAGED, "auto", {}),
            ]
            if args.sweep:
                for bn in (32, 64, 128):
                    for warps in (2, 4, 8):
                        for stages in (1, 2, 3, 4):
                            for splits in (1, 2, 4):
                                cfg = TritonLaunchConfig(block_m=16, block_n=bn, num_splits=splits,
                                                         num_warps=warps, num_stages=stages)
                                variants.append((f"triton bn{bn} w{warps} s{stages} k{splits}",
                                                 KVCacheLayout.SPLIT_KV_FIRST, "auto", {"config": cfg}))
            caches: dict[tuple[KVCacheLayout, str], PagedKV] = {}
            for name, layout, cdt, kwargs in variants:
                key = (layout, cdt)
                if key not in caches:
                    caches[key] = _paged(layout, cdt, kv_first, nb, bs, h, d, dtype, device)
                kv = caches[key]
                out = torch.empty(b, hq, d, dtype=dtype, device=device)

                def tri(kv: PagedKV = kv, out: torch.Tensor = out, kwargs: dict[str, Any] = kwargs) -> Any:
                    return paged_attention_triton(q, kv, meta, scale=scale, output=out, **kwargs)

                try:
                    tri()
                    err = _err(out, ref) if cdt == "auto" else None
                    t = _time_us(tri, args.iters, args.warmup, device)
                    byte_scale = 0.5 if cdt.startswith("fp8") else 1.0
                    page_rows.append(Row(name, bs, layout.value, cdt, t, byte_scale * kv_bytes / t / 1e3,
                                         rel_err=err))
                except Exception as exc:  # a sweep point that does not compile: keep going
                    page_rows.append(Row(name, bs, layout.value, cdt, None, None,
                                         note=f"{type(exc).__name__}: {str(exc)[:120]}"))
        else:
            page_rows.append(Row("triton", bs, "-", "-", None, None, note=triton_reason))

        fa4_t = next((r.time_us for r in page_rows if r.impl.startswith("flash_attn") and r.time_us), None)
        for r in page_rows:
            if fa4_t and r.time_us:
                r.vs_fa4 = fa4_t / r.time_us
        rows.extend(page_rows)
    return rows


def _paged(layout: KVCacheLayout, cache_dtype: str, kv_first: torch.Tensor, nb: int, bs: int, h: int,
           d: int, dtype: torch.dtype, device: torch.device) -> PagedKV:
    """The same K/V values as ``kv_first``, stored in ``layout`` / ``cache_dtype``."""
    from vllm.attention.writers import reference_write

    quant = KVQuant(cache_dtype, torch.ones(1, device=device), torch.ones(1, device=device))  # type: ignore[arg-type]
    storage = dtype if cache_dtype == "auto" else torch.float8_e4m3fn
    shape = kv_cache_shape(layout, nb, bs, h, d)
    cache = empty_in_stride_order(shape, kv_cache_stride_order(layout), dtype=storage,
                                  device=device).zero_()
    slots = torch.arange(nb * bs, device=device)
    k_rows = kv_first[0].reshape(nb * bs, h, d)
    v_rows = kv_first[1].reshape(nb * bs, h, d)
    reference_write(layout, k_rows, v_rows, cache, slots, quant)
    return PagedKV.from_cache(cache, layout, quant, block_size=bs, num_kv_heads=h, head_size=d)


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def _table(rows: list[Row]) -> str:
    head = f"{'impl':32s} {'page':>5s} {'layout':15s} {'cache':9s} {'time us':>9s} {'GB/s':>7s} {'vs fa4':>7s} {'err':>8s}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        t = f"{r.time_us:9.1f}" if r.time_us else f"{'-':>9s}"
        bw = f"{r.gbps:7.0f}" if r.gbps else f"{'-':>7s}"
        vs = f"{r.vs_fa4:7.2f}" if r.vs_fa4 else f"{'-':>7s}"
        er = f"{r.rel_err:8.1e}" if r.rel_err is not None else f"{'-':>8s}"
        lines.append(f"{r.impl[:32]:32s} {r.page_size:5d} {r.layout[:15]:15s} {r.cache_dtype:9s} {t} {bw} {vs} {er}  {r.note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--pages", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32, 64, 128])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--sweep", action="store_true", help="also time a grid of Triton launch configs")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=None, help="directory for decode.json")
    args = p.parse_args(argv)
    if args.device == "cpu" and argv is None and "--batch" not in sys.argv:
        # No GPU: a smoke run of the script itself, not a measurement.
        args.batch, args.context, args.heads, args.kv_heads, args.head_size = 2, 80, 4, 1, 32
        args.pages, args.iters, args.warmup = [16, 32], 2, 1
        print("no CUDA: smoke configuration (batch 2, context 80, d 32); numbers are meaningless")
    rows = run(args)
    print(_table(rows))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
            "torch": torch.__version__,
            "triton": _version("triton"),
            "flash_attn": _version("flash_attn"),
        }
        path = args.out / "decode.json"
        path.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2))
        print(f"wrote {path}")
    return 0


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except Exception:
        return None
    return str(getattr(mod, "__version__", "unknown"))


if __name__ == "__main__":
    raise SystemExit(main())
