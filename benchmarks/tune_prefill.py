"""Sweep the Triton paged kernel's prefill tiles on the prefill targets, against torch's
flash kernel measured in the same run; with ``--flex``, FlexAttention instead: its decode
(page_table mode) against the Triton decode kernel on the same cache (Inductor
decode-kernel launches, page sizes, partly written last pages, host time per call),
then a few prefill kernel options against the flash kernel.

Shapes as ``bench_prefill.py`` (8 x 2048 fresh, 8 x (2048 + 2048) chunked, 32/8 heads,
D=128, bf16, page 16; ``--block-size`` changes the page). Each variant runs
``paged_attention_triton(..., config=TritonLaunchConfig(...))`` on a split-NHD cache,
is checked against the flash kernel's output (relative error <= 2e-2, bf16) and timed
by CUDA events with the stream's queue filled first (``_timing.queued_us``, as
``bench_prefill.py``; median of 3 rounds of ``--iters`` calls). Variants: ``block_m`` x
``block_n`` x ``num_warps`` x ``num_stages``, masks split at the edges (prefill's
default), and query tiles in launch order or last-first. The sweep stops starting new
variants after ``--budget`` seconds (default 150: the whole run stays under 3 minutes
on an H200, compiles included) and reports what it measured, best first, with the
launch ``choose_config`` picks today marked ``default``.

    python benchmarks/tune_prefill.py --out DIR                     # DIR/tune_prefill.json + .txt
    python benchmarks/tune_prefill.py --flex --budget 120 --out DIR  # DIR/tune_flex.json + .txt
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import (  # noqa: E402
    cuda_or_skip,
    device_info,
    kernel_us,
    print_table,
    queued_us,
    report_text,
    write_report,
)
from bench_prefill import (  # noqa: E402
    Shape,
    add_shape_options,
    baselines,
    relative_error,
    run_args,
    target_shapes,
)

from vllm.attention import KVQuant  # noqa: E402
from vllm.attention.layouts import (  # noqa: E402
    empty_in_stride_order,
    kv_cache_shape,
    kv_cache_stride_order,
)
from vllm.attention.ops.paged_kv import PagedKV  # noqa: E402
from vllm.attention.types import KVCacheLayout  # noqa: E402
from vllm.attention.writers import reference_write  # noqa: E402

L = KVCacheLayout
TILES = [(256, 64), (128, 32), (256, 32), (128, 64), (256, 128), (128, 128), (64, 64),
         (64, 128)]
WARPS = (8, 4)
STAGES = (3, 4, 2)


def _cache(shape: Shape, args: argparse.Namespace, layout: KVCacheLayout) -> PagedKV:
    """``shape``'s keys (context + new) written into a cache of ``layout``."""
    batch, bs = shape.batch, args.block_size
    dev = shape.q.device
    cache = torch.zeros(kv_cache_shape(layout, batch.num_blocks, bs, args.kv_heads,
                                       args.head_size), dtype=shape.q.dtype, device=dev)
    quant = KVQuant.unscaled()
    slots, at_c, at_n = [], 0, 0
    ctx_slots, new_slots = batch.context_slots.tolist(), batch.new_slots.tolist()
    for ci, ni in zip(shape.ctx, shape.new):
        slots += ctx_slots[at_c:at_c + ci] + new_slots[at_n:at_n + ni]
        at_c, at_n = at_c + ci, at_n + ni
    reference_write(layout, shape.k_all, shape.v_all, cache,
                    torch.tensor(slots, dtype=torch.int64, device=dev), quant)
    return PagedKV.from_cache(cache, layout, quant, block_size=bs, num_kv_heads=args.kv_heads,
                              head_size=args.head_size)


def _timed_baseline(shape: Shape, args: argparse.Namespace, device: torch.device
                    ) -> tuple[str, torch.Tensor, float]:
    """What ``shape``'s variants are compared with: the first of its baselines for a
    fresh shape, the last for a chunked one; its name, output and time."""
    name, fn = baselines(shape, args, device)[0] if shape.name.startswith("fresh") else \
        baselines(shape, args, device)[-1]
    ref = fn()
    return name, ref, queued_us(fn, iters=args.iters, warmup=2, rounds=3, device=device)[0]


def sweep_triton(shapes: list[Shape], args: argparse.Namespace, device: torch.device,
                 deadline: float) -> list[dict[str, Any]]:
    from vllm.attention.ops.triton_paged_attention import (
        LONG_PREFILL,
        TritonLaunchConfig,
        choose_config,
        paged_attention_triton,
    )

    rows: list[dict[str, Any]] = []
    prepared = []
    for shape in shapes:
        name, ref, base_us = _timed_baseline(shape, args, device)
        kv = _cache(shape, args, L.SPLIT_NHD)
        meta = shape.batch.common
        default = choose_config(kv, num_heads=args.heads, num_reqs=meta.num_reqs,
                                max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
                                query_dtype=shape.q.dtype)
        prepared.append((shape, kv, ref, base_us, default))
        rows.append(dict(shape=shape.name, variant=name, time_us=base_us,
                         tflops=shape.flops / base_us / 1e6, ratio=1.0))
    variants = [TritonLaunchConfig(block_m=m, block_n=n, num_splits=1, num_warps=w,
                                   num_stages=s, split_masks=True, reverse_tiles=True)
                for (m, n), w, s in itertools.product(TILES, WARPS, STAGES)]
    defaults = [p[4] for p in prepared]
    n, w, st = LONG_PREFILL  # the 128-row launch, next to whichever the heuristic picks
    defaults.append(TritonLaunchConfig(block_m=128, block_n=n, num_splits=1, num_warps=w,
                                       num_stages=st, split_masks=True, reverse_tiles=True))
    variants = defaults + [v for v in variants if v not in defaults]
    variants += [TritonLaunchConfig(block_m=128, block_n=n, num_splits=1, num_warps=4,
                                    num_stages=5, split_masks=True, reverse_tiles=True)
                 for n in (32, 64)]
    variants += [TritonLaunchConfig(**{**vars(d), "reverse_tiles": False}) for d in defaults]
    variants += [TritonLaunchConfig(**{**vars(d), "split_masks": False}) for d in defaults]
    for cfg in dict.fromkeys(variants):  # once each, in order
        if time.monotonic() > deadline:
            rows.append(dict(shape="-", variant="(budget spent: remaining variants skipped)"))
            break
        label = (f"triton m{cfg.block_m} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
                 f"{'' if cfg.split_masks else ' masked'}{'' if cfg.reverse_tiles else ' inorder'}")
        for shape, kv, ref, base_us, default in prepared:
            out = torch.empty_like(shape.q)

            def run(kv: PagedKV = kv, out: torch.Tensor = out, shape: Shape = shape,
                    cfg: Any = cfg) -> Any:
                return paged_attention_triton(shape.q, kv, shape.batch.common,
                                              scale=args.head_size ** -0.5, output=out,
                                              causal=True, config=cfg)

            try:
                run()
                err = relative_error(out, ref)
                t = queued_us(run, iters=args.iters, warmup=2, rounds=3, device=device)[0]
            except Exception as exc:  # a tile that does not fit: report, keep going
                rows.append(dict(shape=shape.name, variant=label,
                                 note=f"{type(exc).__name__}: {str(exc)[:100]}"))
                continue
            rows.append(dict(shape=shape.name, variant=label, time_us=t,
                             tflops=shape.flops / t / 1e6, ratio=base_us / t, rel_err=err,
                             default=cfg == default,
                             note="" if err <= 2e-2 else "WRONG: error above 2e-2"))
    return rows


FLEX_OPTIONS: list[dict[str, Any]] = [
    {},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
]


def sweep_flex(shapes: list[Shape], args: argparse.Namespace, device: torch.device,
               deadline: float) -> list[dict[str, Any]]:
    from vllm.attention.ops import flex_paged

    rows: list[dict[str, Any]] = []
    for shape in shapes:
        _, ref, base_us = _timed_baseline(shape, args, device)
        kv = _cache(shape, args, L.SPLIT_BLOCK_INTERLEAVED)
        for opts in FLEX_OPTIONS:
            if time.monotonic() > deadline:
                rows.append(dict(shape=shape.name, variant="(budget spent)"))
                return rows
            out = torch.empty_like(shape.q)

            def run(opts: dict[str, Any] = opts, out: torch.Tensor = out) -> Any:
                return flex_paged.flex_paged_attention(
                    shape.q, kv, shape.batch.common, scale=args.head_size ** -0.5, output=out,
                    kernel_options=opts or None)

            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize(device)
            first = time.perf_counter() - t0
            run_info = flex_paged.last_run
            t = queued_us(run, iters=args.iters, warmup=2, rounds=3, device=device)[0]
            rows.append(dict(shape=shape.name, variant=f"flex {opts or 'inductor default'}",
                             time_us=t, tflops=shape.flops / t / 1e6, ratio=base_us / t,
                             rel_err=relative_error(out, ref),
                             note=f"{run_info}; first call {first:.0f} s"))
    return rows


DECODE_OPTIONS: list[dict[str, Any]] = [
    {},                                            # the op's launch (decode_launch, decode_splits)
    {"num_stages": 1, "num_warps": 2, "SPLIT_KV": 1},  # Inductor's on an H200 (1 stage)
    {"num_stages": 3, "num_warps": 4, "SPLIT_KV": 1},
    {"num_stages": 4, "num_warps": 2, "SPLIT_KV": 3},
    {"num_stages": 6, "num_warps": 2, "SPLIT_KV": 3},
    {"num_stages": 8, "num_warps": 2, "SPLIT_KV": 3},
    {"num_stages": 6, "num_warps": 2, "SPLIT_KV": 6},
    {"num_stages": 3, "num_warps": 4, "SPLIT_KV": 3},
    {"num_stages": 3, "num_warps": 1, "SPLIT_KV": 3},
    {"num_stages": 3, "num_warps": 2, "SPLIT_KV": 4, "USE_TMA": True},
] + [{"num_stages": 3, "num_warps": 2, "SPLIT_KV": k} for k in (1, 2, 3, 4, 5, 6, 8, 12, 16)]
DECODE_PAGES = (64, 128)
"""Page sizes timed besides ``--block-size`` (the decode kernel's key tile is a page)."""


def _decode_cache(b: int, ctx: int, bs: int, args: argparse.Namespace, device: torch.device,
                  seed: int, layout: KVCacheLayout = L.SPLIT_BLOCK_INTERLEAVED
                  ) -> tuple[torch.Tensor, PagedKV, Any]:
    """``b`` decodes of ``ctx`` keys (the last one this step's): random queries and a
    cache of ``layout`` and page ``bs`` with every request's keys written, made on the
    device (the host generator of ``Shape`` would take seconds at this size). The cache
    is in the layout's physical order, as ``allocate_kv_cache`` makes it: in the logical
    order its block and token axes would not merge into the slot axis page_table mode
    reads."""
    from vllm.attention.batch import make_paged_batch

    g = torch.Generator(device).manual_seed(seed)
    h, d, dtype = args.kv_heads, args.head_size, args.torch_dtype
    batch = make_paged_batch([1] * b, [ctx - 1] * b, block_size=bs, device=device,
                             generator=torch.Generator().manual_seed(seed))
    q = torch.randn(b, args.heads, d, generator=g, device=device).to(dtype)
    cache = empty_in_stride_order(kv_cache_shape(layout, batch.num_blocks, bs, h, d),
                                  kv_cache_stride_order(layout), dtype=dtype,
                                  device=device).zero_()
    quant = KVQuant.unscaled()
    per_req = ctx - 1
    slots = torch.cat([batch.context_slots.view(b, per_req), batch.new_slots.view(b, 1)], 1)
    keys = torch.randn(b * ctx, h, d, generator=g, device=device).to(dtype)
    vals = torch.randn(b * ctx, h, d, generator=g, device=device).to(dtype)
    reference_write(layout, keys, vals, cache, slots.reshape(-1), quant)
    kv = PagedKV.from_cache(cache, layout, quant, block_size=bs, num_kv_heads=h, head_size=d)
    return q, kv, batch.common


def flex_decode_case(device: torch.device) -> tuple[torch.Tensor, PagedKV, Any, float]:
    """``(query, cache, metadata, scale)`` of the FlexAttention decode the profiling
    scripts study (``flex_decode_layouts.py``, ``flex_host_profile.py``): bench_prefill's
    decode shape, batch 64 x 4096 context, 32 q / 8 kv heads, D=128, bf16, page 16, in
    FLEX_ATTENTION's block-interleaved cache."""
    d = 128
    args = argparse.Namespace(kv_heads=8, head_size=d, torch_dtype=torch.bfloat16, heads=32)
    q, kv, meta = _decode_cache(64, 4096, 16, args, device, 0, L.SPLIT_BLOCK_INTERLEAVED)
    return q, kv, meta, d ** -0.5


def sweep_flex_decode(args: argparse.Namespace, device: torch.device, deadline: float
                      ) -> list[dict[str, Any]]:
    """FlexAttention decode (page_table mode) against the Triton decode kernel on the same
    cache: Inductor decode-kernel launches, page sizes, a batch whose last pages are
    partly written (the tail path), and the host time per call."""
    from vllm.attention.ops import flex_paged
    from vllm.attention.ops.triton_paged_attention import paged_attention_triton

    b, ctx = args.decode_batch, args.decode_context
    scale = args.head_size ** -0.5
    rows: list[dict[str, Any]] = []
    inter, kv_first = L.SPLIT_BLOCK_INTERLEAVED, L.SPLIT_KV_FIRST
    runs: list[tuple[int, int, list[dict[str, Any]], KVCacheLayout]] = [
        (args.block_size, ctx, DECODE_OPTIONS, inter)]
    # the same pages with K and V in blocks of their own (slot stride H*D, not 2*H*D)
    runs += [(args.block_size, ctx, [{}, {"SPLIT_KV": 1}], kv_first)]
    runs += [(bs, ctx, [{}], inter) for bs in DECODE_PAGES if bs != args.block_size]
    runs += [(args.block_size, ctx - 6, [{}], inter)]  # last pages 10 of 16 rows written: tails
    for seed, (bs, c, options, layout) in enumerate(runs):
        if time.monotonic() > deadline:
            rows.append(dict(shape="-", variant="(budget spent: remaining variants skipped)"))
            break
        name = f"decode {b}x{c} page {bs}" + ("" if layout is inter else f" {layout.value}")
        q, kv, meta = _decode_cache(b, c, bs, args, device, seed, layout)
        kv_bytes = 2 * b * c * args.kv_heads * args.head_size * q.element_size()
        ref = torch.empty_like(q)

        def triton(out: torch.Tensor = ref, q: torch.Tensor = q, kv: PagedKV = kv,
                   meta: Any = meta) -> Any:
            return paged_attention_triton(q, kv, meta, scale=scale, output=out, causal=True)

        triton()
        base_us, host = queued_us(triton, iters=args.iters, warmup=2, rounds=3, device=device)
        rows.append(dict(shape=name, variant="triton decode (op)", time_us=base_us,
                         gbps=kv_bytes / base_us / 1e3, ratio=1.0,
                         note=f"host {host:.0f} us/call"))
        for opts in options:
            if time.monotonic() > deadline:
                rows.append(dict(shape=name, variant="(budget spent)"))
                break
            out = torch.empty_like(q)

            def flex(opts: dict[str, Any] = opts, out: torch.Tensor = out, q: torch.Tensor = q,
                     kv: PagedKV = kv, meta: Any = meta) -> Any:
                return flex_paged.flex_paged_attention(
                    q, kv, meta, scale=scale, output=out, mode="page_table",
                    compiled=True, kernel_options=opts or None)

            programs = max(2, 1 << (b - 1).bit_length()) * args.kv_heads
            launch = {**flex_paged.decode_launch(device),
                      "SPLIT_KV": flex_paged.decode_splits(device, programs), **opts}
            label = f"flex {launch or 'inductor default'}"
            t0 = time.perf_counter()
            try:
                flex()
                torch.cuda.synchronize(device)
            except Exception as exc:  # a launch that does not compile: report, keep going
                rows.append(dict(shape=name, variant=label,
                                 note=f"{type(exc).__name__}: {str(exc)[:100]}"))
                continue
            first = time.perf_counter() - t0
            info = flex_paged.last_run
            t, host_q = queued_us(flex, iters=args.iters, warmup=2, rounds=3, device=device)
            host_flex = host_q if not opts else None
            if not opts:  # where the default launch's time goes, kernel by kernel
                for kname, kus in kernel_us(flex, device)[:8]:
                    rows.append(dict(shape=name, variant=f"  kernel {kname[:60]}",
                                     time_us=kus))
            err = relative_error(out, ref)
            rows.append(dict(shape=name, variant=label, time_us=t, gbps=kv_bytes / t / 1e3,
                             ratio=base_us / t, rel_err=err, default=not opts,
                             note=(f"{'' if err <= 2e-2 else 'WRONG: error above 2e-2; '}"
                                   f"{'' if info is None or info.compiled else f'EAGER {info}; '}"
                                   f"first call {first:.1f} s"
                                   + ("" if host_flex is None
                                      else f"; host {host_flex:.0f} us/call"))))
        del q, kv, meta
        torch.cuda.empty_cache()
    return rows


COLUMNS = [("shape", "shape", ""), ("variant", "variant", ""), ("default", "default", ""),
           ("time_us", "time us", ".1f"), ("tflops", "TFLOP/s", ".1f"), ("gbps", "GB/s", ".0f"),
           ("ratio", "vs base", ".3f"),
           ("rel_err", "rel err", ".1e"), ("note", "note", "")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None)
    add_shape_options(p)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--budget", type=float, default=150.0, help="seconds before skipping variants")
    p.add_argument("--flex", action="store_true",
                   help="time FlexAttention instead: decode launches and pages, then prefill "
                        "kernel options (--budget for all of it)")
    p.add_argument("--decode-only", action="store_true",
                   help="with --flex: the decode sweep only (no prefill kernel options)")
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--decode-context", type=int, default=4096)
    args = p.parse_args(argv)
    device = cuda_or_skip("tune_prefill.py", "it times compiled kernels")
    if device is None:
        return 0
    args.torch_dtype = torch.bfloat16
    deadline = time.monotonic() + args.budget
    g = torch.Generator().manual_seed(0)
    shapes = [Shape(name, ctx, new, args, device, g) for name, ctx, new in target_shapes(args)]
    if args.flex:
        rows = sweep_flex_decode(args, device, deadline)
        if not args.decode_only:
            rows += sweep_flex(shapes, args, device, deadline)
        prefix = "flex"
    else:
        rows = sweep_triton(shapes, args, device, deadline)
        prefix = "triton"
    ranked = sorted((row for row in rows if row.get("ratio") is not None
                     and row["variant"].startswith(prefix)),
                    key=lambda row: (row["shape"], -row["ratio"]))
    with report_text() as text:
        print("all variants, in the order run:")
        print_table(rows, COLUMNS)
        print(f"\n{prefix} variants, best first per shape:")
        print_table(ranked, COLUMNS)
    if args.out is not None:
        meta = device_info(device)
        meta["args"] = run_args(args)
        stem = "tune_flex" if args.flex else "tune_prefill"
        write_report(args.out, stem, {"meta": meta, "rows": rows}, text.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
