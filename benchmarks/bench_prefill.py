"""Prefill (and FlexAttention decode) through ``Attention`` against torch's own flash
kernel over the same tensors, dense, measured in the same process.

Shapes (the targets): 8 requests x 2048 new tokens (``fresh``), and 8 requests x
(2048 cached + 2048 new) (``chunked``); causal, 32 query / 8 kv heads, D=128, bf16,
page size 16 (``--block-size``). Backends: TRITON_ATTN, FLASH_ATTN (its portable path
unless flash-attn is installed: the row says what ran), FLEX_ATTENTION, and FLASHINFER
when ``flashinfer`` imports.

* ``layer``: ``Attention.forward(q, k, v, out)`` in a ForwardContext: this step's K/V
  written into the cache, then attention over the cache (what serving runs);
* ``compute``: ``impl.forward`` alone over the filled cache;
* ``op triton``: the paged Triton kernel called directly on the layer's cache
  (``paged_attention_triton``), whatever path the layer picks; and
  ``TRITON_ATTN [flash_varlen off]`` / ``[flash_varlen on]``, the layer with its prefill
  on that kernel / on the flash varlen path (whichever the layer's own choice is not,
  for the comparison);
* baselines: ``sdpa flash (dense)``, ``scaled_dot_product_attention(q, k, v,
  is_causal=True, enable_gqa=True)`` under ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``
  on ``[B, H, S, D]`` views of the same tensors (fresh); for chunked prefill the same
  flash kernel through ``aten._flash_attention_forward`` over the gathered, contiguous
  K/V with ``cu_seqlens`` (its causal mask is aligned bottom-right, as chunked prefill
  needs; SDPA's ``is_causal`` is aligned top-left when queries and keys differ in
  number).

TFLOP/s counts the causal area computed: ``4 * D * Hq * (C * N + N * N / 2)`` a request
with ``C`` cached and ``N`` new tokens (fresh: ``2 * 2 * N * N * D * Hq / 2``). ``ratio``
is the baseline's time over the row's time (>= 0.90 is the prefill target for
TRITON_ATTN / FLASH_ATTN, >= 0.50 for FLEX_ATTENTION). ``rel_err`` compares each output
with the baseline's (both bf16).

Decode section: batch 64 x 4096-token contexts through ``Attention``, FLEX_ATTENTION
(target >= 0.50), FLASHINFER and FLASH_ATTN (the vendor paths where they import)
against TRITON_ATTN, with the K/V read rate against a device copy (``copy_``) measured
in the same run: the Triton row is the unchanged decode kernel. FLASHINFER rows add
``build``: the builder's time per step (FlashInfer plans there, once for every layer).

    python benchmarks/bench_prefill.py --out DIR      # DIR/prefill.json and prefill.txt

Times (``time us``): device time per call, CUDA events around ``--iters`` back-to-back
calls with the stream's queue filled first by a GPU sleep (``_timing.queued_us``), so
the host's latency for the first call and host-bound stretches stay out of the device
time of every row, baselines included; median of 3 rounds, after warm-up (the first
FLEX_ATTENTION call compiles; its time is reported as ``first_call_s``). ``host us``:
the host time per call of the same loop (a row whose host time exceeds its device
time is host-bound when called eagerly; the builder's row is host time only). On CUDA
the decode section runs first, and FLASH_ATTN / FLASHINFER(_HND) each run in a process
of their own after the rest (``--no-isolate``: all in this one), each with its own
baselines: importing a vendor package slowed the host side of the portable rows timed
after it in one process (``docs/performance.md``). Without
CUDA: a tiny CPU configuration (torch paths), a smoke check of the script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import (  # noqa: E402
    copy_ceiling_gbps,
    device_info,
    kernel_us,
    queued_us,
    print_table,
    report_text,
    write_report,
)

from vllm.attention import allocate_kv_cache  # noqa: E402
from vllm.attention.batch import PagedBatch, make_paged_batch  # noqa: E402
from vllm.attention.layer import Attention  # noqa: E402
from vllm.attention.registry import get_backend  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402

BACKENDS = ("TRITON_ATTN", "FLASH_ATTN", "FLEX_ATTENTION", "FLASHINFER")


def prefill_flops(ctx: list[int], new: list[int], heads: int, d: int) -> float:
    """Causal-area FLOPs: ``4 * D * Hq * (C * N + N * N / 2)`` summed over requests."""
    return float(sum(4 * d * heads * (c * n + n * n / 2) for c, n in zip(ctx, new)))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius norms, in float32)."""
    return float((a.float() - b.float()).norm() / b.float().norm())


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except Exception:  # not installed, or fails to import here
        return False
    return True


def add_shape_options(p: argparse.ArgumentParser) -> None:
    """The prefill targets' options (read by :func:`target_shapes` and :class:`Shape`),
    shared with tune_prefill.py so that it tunes at this benchmark's shapes."""
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=2048)
    p.add_argument("--cached-tokens", type=int, default=2048, help="chunked prefill's context")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)


def target_shapes(args: argparse.Namespace) -> list[tuple[str, list[int], list[int]]]:
    """The two targets, ``fresh`` prefill and ``chunked`` prefill after
    ``--cached-tokens`` of context, as ``(name, cached tokens, new tokens)`` per request."""
    r, n, c = args.requests, args.new_tokens, args.cached_tokens
    return [(f"fresh {r}x{n}", [0] * r, [n] * r), (f"chunked {r}x({c}+{n})", [c] * r, [n] * r)]


def run_args(args: argparse.Namespace) -> dict[str, Any]:
    """The run's arguments for its JSON record (paths and dtypes as strings)."""
    return {k: (str(v) if isinstance(v, (Path, torch.dtype)) else v)
            for k, v in vars(args).items()}


class Shape:
    """One batch: requests' cached and new token counts, the tensors of the step."""

    def __init__(self, name: str, ctx: list[int], new: list[int], args: argparse.Namespace,
                 device: torch.device, g: torch.Generator) -> None:
        self.name, self.ctx, self.new = name, ctx, new
        dtype = args.torch_dtype
        self.batch: PagedBatch = make_paged_batch(new, ctx, block_size=args.block_size,
                                                  device=device, generator=g)
        t, c = sum(new), sum(ctx)
        hq, h, d = args.heads, args.kv_heads, args.head_size

        def rnd(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g).to(dtype).to(device)

        self.q, self.k_new, self.v_new = rnd(t, hq, d), rnd(t, h, d), rnd(t, h, d)
        self.k_ctx, self.v_ctx = rnd(c, h, d), rnd(c, h, d)
        # the same keys per request, contiguous: context then new
        ks, vs, at_c, at_n = [], [], 0, 0
        for ci, ni in zip(ctx, new):
            ks += [self.k_ctx[at_c:at_c + ci], self.k_new[at_n:at_n + ni]]
            vs += [self.v_ctx[at_c:at_c + ci], self.v_new[at_n:at_n + ni]]
            at_c, at_n = at_c + ci, at_n + ni
        self.k_all, self.v_all = torch.cat(ks), torch.cat(vs)
        lens = [ci + ni for ci, ni in zip(ctx, new)]
        self.cu_q = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32,
                                 device=device)
        self.cu_k = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                                 device=device)
        self.max_q, self.max_k = max(new), max(lens)
        self.flops = prefill_flops(ctx, new, hq, d)


def baselines(shape: Shape, args: argparse.Namespace, device: torch.device
              ) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """The dense flash baseline of ``shape`` (first), then informative extras."""
    scale = args.head_size ** -0.5
    cuda = device.type == "cuda"
    b, hq, h, d = len(shape.new), args.heads, args.kv_heads, args.head_size
    fresh = not any(shape.ctx) and len(set(shape.new)) == 1
    out: list[tuple[str, Callable[[], torch.Tensor]]] = []
    if fresh:
        n = shape.new[0]
        q4 = shape.q.view(b, n, hq, d).transpose(1, 2)
        k4 = shape.k_all.view(b, n, h, d).transpose(1, 2)
        v4 = shape.v_all.view(b, n, h, d).transpose(1, 2)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa() -> torch.Tensor:
            ctx = sdpa_kernel(SDPBackend.FLASH_ATTENTION) if cuda else contextlib.nullcontext()
            with ctx:
                res = torch.nn.functional.scaled_dot_product_attention(
                    q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True)
            return res.transpose(1, 2).reshape(-1, hq, d)

        out.append(("sdpa flash (dense)", sdpa))
    if cuda:
        def varlen() -> torch.Tensor:
            ops: Any = torch.ops.aten
            res = ops._flash_attention_forward(
                shape.q, shape.k_all, shape.v_all, shape.cu_q, shape.cu_k, shape.max_q,
                shape.max_k, 0.0, True, False, scale=scale)
            first: torch.Tensor = res[0]
            return first

        out.append(("flash varlen (gathered K/V)", varlen))
    else:  # CPU smoke run: the float32 reference, request by request
        from vllm.attention.ops.reference import attend

        def ref() -> torch.Tensor:
            rows, at_q, at_k = [], 0, 0
            for ci, ni in zip(shape.ctx, shape.new):
                rows.append(attend(shape.q[at_q:at_q + ni].float(),
                                   shape.k_all[at_k:at_k + ci + ni].float(),
                                   shape.v_all[at_k:at_k + ci + ni].float(),
                                   scale=scale, causal=True))
                at_q, at_k = at_q + ni, at_k + ci + ni
            return torch.cat(rows)

        if not fresh:
            out.append(("reference (cpu)", ref))
    return out


@contextlib.contextmanager
def _layer_for(name: str, shape: Shape, args: argparse.Namespace, device: torch.device
               ) -> Iterator[tuple[Attention, Any, torch.Tensor, Any]]:
    backend = get_backend(name)
    d, h = args.head_size, args.kv_heads
    layer = Attention(num_heads=args.heads, num_kv_heads=h, head_size=d, scale=d ** -0.5,
                      backend=backend, layer_name=f"bench.{name}").to(device)
    cache = allocate_kv_cache(backend, num_blocks=shape.batch.num_blocks,
                              block_size=args.block_size, num_kv_heads=h, head_size=d,
                              model_dtype=args.torch_dtype, device=device)
    cache.zero_()
    layer.bind_kv_cache(cache, args.block_size)
    if shape.k_ctx.shape[0]:
        layer.kv_cache_writer.write(shape.k_ctx, shape.v_ctx, cache, shape.batch.context_slots,
                                    layer.kv_quant)
    builder = backend.get_builder_cls()(layer.spec, device)
    meta = builder.build(shape.batch.common)
    with set_forward_context(attn_metadata={layer.layer_name: meta},
                             slot_mapping={layer.layer_name: shape.batch.new_slots}):
        yield layer, meta, cache, builder
    del layer, cache


@contextlib.contextmanager
def _flash_varlen(force: str | None) -> Iterator[None]:
    """``"off"``: the portable path's prefill runs the paged Triton kernel; ``"on"``: it
    runs the flash varlen path wherever that computes the call (its cost rule and the
    Triton launch's measured rule set aside); the layer's other choices unchanged."""
    if force is None:
        yield
        return
    from vllm.attention.ops import flash_varlen

    name = "flash_varlen_unavailable" if force == "off" else "flash_varlen_worth_it"
    saved = getattr(flash_varlen, name)
    setattr(flash_varlen, name, (lambda device: "switched off by bench_prefill")
            if force == "off" else (lambda *args, **kwargs: None))
    try:
        yield
    finally:
        setattr(flash_varlen, name, saved)


def _time(fn: Callable[[], object], args: argparse.Namespace, device: torch.device
          ) -> tuple[float, float]:
    """``(device us, host us)`` per call (:func:`_timing.queued_us`: back-to-back calls
    with the stream's queue filled first, so a path's host cost shows in its own column
    and not in the device time)."""
    return queued_us(fn, iters=args.iters, warmup=args.warmup, rounds=3, device=device)


def bench_prefill_shape(shape: Shape, args: argparse.Namespace, device: torch.device
                        ) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    base = baselines(shape, args, device)
    ref_out: torch.Tensor | None = None
    base_us: float | None = None
    for i, (name, fn) in enumerate(base):
        res = fn()
        t, host = _time(fn, args, device)
        if i == 0:
            ref_out, base_us = res, t
        rows.append(dict(shape=shape.name, impl=name, what="baseline" if i == 0 else "extra",
                         path="-", time_us=t, host_us=host, tflops=shape.flops / t / 1e6,
                         ratio=None if base_us is None else base_us / t,
                         rel_err=(None if ref_out is None or i == 0
                                  else relative_error(res, ref_out))))
    runs: list[tuple[str, str | None]] = [(name, None) for name in args.backends]
    if "TRITON_ATTN" in args.backends and device.type == "cuda":
        at = runs.index(("TRITON_ATTN", None)) + 1
        runs[at:at] = [("TRITON_ATTN", "off"), ("TRITON_ATTN", "on")]
    for name, force in runs:
        if name == "FLASHINFER" and not _importable("flashinfer"):
            rows.append(dict(shape=shape.name, impl=name, what="-", path="-",
                             note="flashinfer is not importable here"))
            continue
        out = torch.empty_like(shape.q)
        label = name if force is None else f"{name} [flash_varlen {force}]"
        with _layer_for(name, shape, args, device) as (layer, meta, cache, builder), \
                _flash_varlen(force):
            impl: Any = layer.impl

            def step() -> Any:
                return layer(shape.q, shape.k_new, shape.v_new, out)

            def compute() -> Any:
                return impl.forward(layer, shape.q, shape.k_new, shape.v_new, cache, meta, out)

            t0 = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            first_s = time.perf_counter() - t0
            for what, fn in (("layer", step), ("compute", compute)):
                t, host = _time(fn, args, device)
                err = None if ref_out is None else relative_error(out, ref_out)
                rows.append(dict(
                    shape=shape.name, impl=label, what=what, path=impl.last_compute_path,
                    time_us=t, host_us=host, tflops=shape.flops / t / 1e6,
                    ratio=None if base_us is None else base_us / t, rel_err=err,
                    first_call_s=first_s if what == "layer" else None,
                    note="; ".join(impl.last_fallbacks)))
            if name.startswith("FLASHINFER"):
                rows.append(_build_row(shape, label, builder, args, device))
            if name == "TRITON_ATTN" and force is None and device.type == "cuda":
                rows.append(_op_triton_row(shape, layer, meta, out, args, device, ref_out,
                                           base_us))
    return rows


def _build_row(shape: Shape, label: str, builder: Any, args: argparse.Namespace,
               device: torch.device) -> dict[str, Any]:
    """The builder's per-step cost (FlashInfer plans there, once for all layers)."""
    _, host = _time(lambda: builder.build(shape.batch.common), args, device)
    return dict(shape=shape.name, impl=label, what="build", path="-", host_us=host,
                note="metadata + plan, once per step and KV-cache group (host time)")


def _op_triton_row(shape: Shape, layer: Attention, meta: Any, out: torch.Tensor,
                   args: argparse.Namespace, device: torch.device,
                   ref_out: torch.Tensor | None, base_us: float | None) -> dict[str, Any]:
    from vllm.attention.ops.triton_paged_attention import choose_config, paged_attention_triton

    impl: Any = layer.impl
    kv = impl.paged_kv(layer, layer.kv_cache, meta)
    cfg = choose_config(kv, num_heads=args.heads, num_reqs=meta.num_reqs,
                        max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
                        query_dtype=shape.q.dtype)

    def op() -> Any:
        return paged_attention_triton(shape.q, kv, meta, scale=layer.spec.scale, output=out,
                                      causal=True)

    op()
    t, host = _time(op, args, device)
    return dict(shape=shape.name, impl="op triton kernel", what="compute", path="triton",
                time_us=t, host_us=host, tflops=shape.flops / t / 1e6,
                ratio=None if base_us is None else base_us / t,
                rel_err=None if ref_out is None else relative_error(out, ref_out),
                note=f"block_m={cfg.block_m} block_n={cfg.block_n} warps={cfg.num_warps} "
                     f"stages={cfg.num_stages}")


def bench_decode(args: argparse.Namespace, device: torch.device, g: torch.Generator
                 ) -> list[dict[str, Any]]:
    """FLEX_ATTENTION's and the vendor paths' decode against TRITON_ATTN's, with the
    K/V read rate (FLASHINFER where it imports; FLASH_ATTN's row names what ran)."""
    b, ctx = args.decode_batch, args.decode_context
    shape = Shape("decode", [ctx - 1] * b, [1] * b, args, device, g)
    kv_bytes = 2 * b * ctx * args.kv_heads * args.head_size * shape.q.element_size()
    copy_gbps = copy_ceiling_gbps(device, gib=1.0) if device.type == "cuda" else None
    rows: list[dict[str, Any]] = []
    triton_us: float | None = None
    for name in ("TRITON_ATTN", "FLEX_ATTENTION", "FLASHINFER", "FLASH_ATTN"):
        if name not in ("TRITON_ATTN", *args.backends):
            continue
        if name == "FLASHINFER" and not _importable("flashinfer"):
            continue
        out = torch.empty_like(shape.q)
        with _layer_for(name, shape, args, device) as (layer, meta, cache, _):
            impl: Any = layer.impl

            def step() -> Any:
                return layer(shape.q, shape.k_new, shape.v_new, out)

            t0 = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            first_s = time.perf_counter() - t0
            t, host = _time(step, args, device)
            gbps = kv_bytes / t / 1e3
            if name == "TRITON_ATTN":
                triton_us = t
                ref = out.clone()
            rows.append(dict(
                shape=f"decode {b}x{ctx}", impl=name, what="layer", path=impl.last_compute_path,
                time_us=t, host_us=host, gbps=gbps, read_share=None if copy_gbps is None else gbps / copy_gbps,
                ratio=None if triton_us is None else triton_us / t,
                rel_err=None if name == "TRITON_ATTN" else relative_error(out, ref),
                first_call_s=first_s, note="; ".join(impl.last_fallbacks)))
            if device.type == "cuda" and name == "FLEX_ATTENTION":  # where its time goes
                for kname, kus in kernel_us(step, device)[:6]:
                    rows.append(dict(shape=f"decode {b}x{ctx}", impl=name,
                                     what="  kernel", path=kname[:60], time_us=kus))
    if copy_gbps is not None:
        rows.append(dict(shape=f"decode {b}x{ctx}", impl="copy_ (read + write)", what="baseline",
                         path="-", gbps=copy_gbps, note="device copy rate, 1 GiB bf16"))
    return rows


COLUMNS = [("shape", "shape", ""), ("impl", "impl", ""), ("what", "what", ""),
           ("path", "path", ""), ("time_us", "time us", ".1f"), ("host_us", "host us", ".0f"), ("tflops", "TFLOP/s", ".1f"),
           ("gbps", "GB/s", ".0f"), ("read_share", "vs copy", ".2f"), ("ratio", "ratio", ".3f"),
           ("rel_err", "rel err", ".1e"), ("first_call_s", "1st call s", ".1f"),
           ("note", "note", "")]


VENDOR_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "FLASHINFER_HND")
"""Backends whose vendor package, once imported, has been seen to slow the host side of
the portable rows timed after it in the same process (H200, 2026-12-01): each runs in a
process of its own, after the rest."""


def _rows_of_own_process(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``name``'s rows (and that process's baselines) from a child process of this script,
    given this run's own options with ``--backends`` and ``--out`` overridden (argparse
    keeps the last occurrence)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(Path(__file__).resolve()), *args.argv, "--no-isolate",
               "--backends", name, "--out", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        report = Path(tmp) / "prefill.json"
        if not report.exists():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            return [dict(shape="-", impl=name, what="-", path="-",
                         note=f"its process failed (rc={proc.returncode}): " + " | ".join(tail))]
        rows: list[dict[str, Any]] = json.loads(report.read_text())["rows"]
    for row in rows:
        row["note"] = "; ".join(x for x in (row.get("note") or "", f"process of {name}") if x)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="directory for prefill.json/.txt")
    add_shape_options(p)
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS))
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--decode-context", type=int, default=4096)
    p.add_argument("--no-decode", action="store_true")
    p.add_argument("--decode-only", action="store_true", help="the decode rows only")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-isolate", dest="isolate", action="store_false",
                   help=f"time {', '.join(VENDOR_BACKENDS)} in this process too")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        print("no CUDA: smoke configuration (2 requests of 24 + 40 tokens, d 32); "
              "numbers are meaningless")
        args.requests, args.new_tokens, args.cached_tokens = 2, 24, 40
        args.heads, args.kv_heads, args.head_size = 4, 2, 32
        args.decode_batch, args.decode_context, args.iters, args.warmup = 3, 50, 2, 1
    args.torch_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    own, isolated = args.backends, []
    if args.isolate and device.type == "cuda":
        own = [b for b in args.backends if b not in VENDOR_BACKENDS]
        isolated = [b for b in args.backends if b in VENDOR_BACKENDS]
    args.backends = own
    g = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    if not args.no_decode:  # first: no vendor package is imported yet in this process
        rows += bench_decode(args, device, g)
    for name, ctx, new in target_shapes(args):
        if not own or args.decode_only:
            break
        shape = Shape(name, ctx, new, args, device, g)
        rows += bench_prefill_shape(shape, args, device)
        del shape
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for name in isolated:
        rows += _rows_of_own_process(name, args)
    args.backends = own + isolated
    with report_text() as text:
        print_table(rows, COLUMNS)
    if args.out is not None:
        meta = device_info(device)
        meta["args"] = run_args(args)
        meta["flops_formula"] = "4 * D * Hq * (C * N + N * N / 2) per request"
        write_report(args.out, "prefill", {"meta": meta, "rows": rows}, text.getvalue())
    bad = [row for row in rows if row.get("rel_err") is not None
           and (not math.isfinite(row["rel_err"]) or row["rel_err"] > 0.05)]
    if bad:
        print(f"{len(bad)} rows differ from the baseline by more than 5%: "
              + ", ".join(f"{b['shape']}/{b['impl']}/{b['what']}" for b in bad))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
