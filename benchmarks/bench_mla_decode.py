"""MLA decode through ``MLAAttention`` (write, then absorbed decode) against its roofline.

Shapes: DeepSeek-V3's (latent 512 + rope 64, q_nope 128, v 128), batch 64, 4096
tokens of context a request, page 64, 128 query heads and 16; bf16 model, bf16 and
fp8 (E4M3, scale 0.37) caches. Measured in the same run:

* the read rate: the larger of a 2 GiB bf16 ``copy_`` (bytes read + written per
  second) and a pure read (``torch.sum`` of the same tensor);
* the bf16 matmul rate: an 8192^3 ``torch.matmul``, timed before the steps and again
  after each head count and cache dtype's steps; the fastest of those timings is the
  ceiling (one timing at the start moved between 709 and 807 TFLOP/s from run to run on
  one H200, and every ratio with it; the fastest is the conservative choice, and all
  are in the report);
* each decode step, replayed from a CUDA graph and timed by CUDA events: the layer
  (TRITON_MLA, and FLASHMLA, whose portable path runs where ``flash_mla`` does not
  import), the decode alone (``mla_decode_triton``: the Gluon kernel on sm_90, path
  ``gluon``, with the Triton kernel it replaced timed beside it; the Triton kernel
  elsewhere) and the per-row kernel (``mla_decode_per_row``), and the layer's pieces
  one by one ("layer: write", "absorb", "decode" on the layer's strided inputs,
  "project"); with an E4M3 cache also the decode on the fp8-MMA kernel (path
  ``gluon-fp8-mma``: the query and the probabilities rounded to E4M3, checked against
  ``FP8_MMA_TOLERANCE``), and each layer with the numerics it does not default to:
  "layer fp8-mma" beside an exact default (TRITON_MLA; FLASHMLA up to 32 heads),
  "layer exact" beside FLASHMLA's fp8-MMA default past 32 heads
  (``MLACommonImpl.uses_fp8_mma``). A layer row's path names its decode kernel after
  the impl's path (``triton:gluon-lead``).

The roofline of a step is ``max(flops / matmul rate, bytes / read rate)`` with
``flops = 2 B N S (L + R) + 2 B N S L`` (scores and values) and ``bytes = B S (L + R)``
cache elements; each row reports achieved time, roofline time and
``roofline / achieved``. The decode's output is checked against float64 on four
tokens (exit 1 beyond the backend's tolerance).

    python benchmarks/bench_mla_decode.py --out DIR   # DIR/mla_decode.json and .txt

Without CUDA: a smoke run of the script (2 requests, 64 tokens, torch path; the Triton
kernel too under ``TRITON_INTERPRET=1``); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import (  # noqa: E402
    capture,
    copy_ceiling_gbps,
    device_info,
    event_us,
    print_table,
    replay_us,
    report_text,
    write_report,
)

from vllm.attention import allocate_kv_cache  # noqa: E402
from vllm.attention.backends.mla.spec import MLALayerSpec, MLAProjection  # noqa: E402
from vllm.attention.batch import make_paged_batch  # noqa: E402
from vllm.attention.layer import MLAAttention  # noqa: E402
from vllm.attention.registry import get_backend  # noqa: E402
from vllm.attention.writers.kernels.device import gpu_of  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402

L, R, P, V, PAGE = 512, 64, 128, 128, 64
K_SCALE = 0.37


def _sum_gbps(device: torch.device, gib: float) -> float:
    x = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device).normal_()
    us = event_us(lambda: x.sum(dtype=torch.float32), iters=10, warmup=2, device=device)
    return x.numel() * 2 / (us * 1e-6) / 1e9


def read_gbps(device: torch.device, gib: float = 2.0) -> dict[str, float]:
    """GB/s of a copy (read + written) and of a pure read (a sum) of ``gib`` GiB."""
    copy = copy_ceiling_gbps(device, gib)
    total = _sum_gbps(device, gib)  # (its tensor freed on return)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"copy_gbps": copy, "sum_gbps": total, "read_gbps": max(copy, total)}


def matmul_tflops(device: torch.device, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    us = event_us(lambda: torch.matmul(a, b), iters=20, warmup=3, device=device)
    return 2 * n**3 / (us * 1e-6) / 1e12


def _spec(heads: int, cache_dtype: str, device: torch.device,
          g: torch.Generator) -> MLALayerSpec:
    w_uk = (torch.randn(heads, P, L, generator=g) * L ** -0.5).bfloat16().to(device)
    w_uv = (torch.randn(heads, L, V, generator=g) * L ** -0.5).bfloat16().to(device)
    return MLALayerSpec.create(num_heads=heads, kv_lora_rank=L, qk_nope_head_dim=P,
                               qk_rope_head_dim=R, v_head_dim=V,
                               projection=MLAProjection(w_uk=w_uk, w_uv=w_uv),
                               kv_cache_dtype=cache_dtype)  # type: ignore[arg-type]


def mla_layer(backend: Any, spec: MLALayerSpec, batch: Any, cache_dtype: str,
              device: torch.device) -> tuple[MLAAttention, torch.Tensor]:
    """An ``MLAAttention`` of ``backend`` over a fresh cache for ``batch`` (page
    :data:`PAGE`, bf16 model, fp8 caches at :data:`K_SCALE`), its context rows written
    with random latents."""
    layer = MLAAttention(spec=spec, backend=backend, layer_name="mla",
                         k_scale=K_SCALE if cache_dtype != "auto" else None, checked=False)
    cache = allocate_kv_cache(backend, num_blocks=batch.num_blocks, block_size=PAGE,
                              num_kv_heads=1, head_size=L + R, cache_dtype=cache_dtype,
                              model_dtype=torch.bfloat16, device=device)
    layer.bind_kv_cache(cache, PAGE)
    n_ctx = int(batch.context_slots.numel())
    if n_ctx:
        bf: dict[str, Any] = dict(dtype=torch.bfloat16, device=device)
        layer.kv_cache_writer.write(torch.randn(n_ctx, L, **bf), torch.randn(n_ctx, R, **bf),
                                    cache, batch.context_slots, layer.kv_quant)
    return layer, cache


class Step:
    """One decode step of one layer: the batch, its cache (context written) and inputs."""

    def __init__(self, backend_name: str, heads: int, cache_dtype: str, batch: int,
                 context: int, device: torch.device, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.backend = get_backend(backend_name)
        self.spec = _spec(heads, cache_dtype, device, g)
        self.batch = make_paged_batch([1] * batch, [context - 1] * batch, block_size=PAGE,
                                      device=device, generator=g)
        self.layer, self.cache = mla_layer(self.backend, self.spec, self.batch, cache_dtype,
                                           device)
        bf: dict[str, Any] = dict(dtype=torch.bfloat16, device=device)
        self.meta = self.backend.get_builder_cls()(self.spec, device).build(self.batch.common)
        self.q = torch.randn(batch, heads, P + R, **bf)
        self.kv_c = torch.randn(batch, L, **bf)
        self.k_pe = torch.randn(batch, R, **bf)
        # the step's own rows too (each layer call writes the same bytes there again): the
        # cache is allocated uninitialised, and the decode alone (kernel(), check()) reads
        # those slots whether or not a layer call came first
        self.layer.kv_cache_writer.write(self.kv_c, self.k_pe, self.cache, self.batch.new_slots,
                                         self.layer.kv_quant)
        self.out = torch.empty(batch, heads * V, **bf)
        self.context = context

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with set_forward_context(attn_metadata={"mla": self.meta},
                                 slot_mapping={"mla": self.batch.new_slots}):
            yield

    def layer_call(self) -> None:
        self.layer(self.q, self.kv_c, self.k_pe, self.out)

    def latent_query(self) -> torch.Tensor:
        """``[B, N, L + R]``: the absorbed query the decode kernels take."""
        impl: Any = self.layer.impl
        q_lat: torch.Tensor = impl._absorb(self.q)
        return q_lat.contiguous()

    def kernel(self, variant: str = "default") -> Callable[[], torch.Tensor]:
        """The decode alone on the contiguous absorbed query: ``default`` (the launch the
        device gets), ``gluon`` (the Gluon kernel with split scores where the default is
        the lead-warpgroup one), ``gluon-lead`` (the lead-warpgroup kernel where the
        default is the few-heads one), ``triton`` (the Triton tensor-core kernel where
        the default is a Gluon one), ``fp8-mma`` (the fp8-MMA kernel, an E4M3 cache) or
        ``per-row`` (the per-row kernel)."""
        from vllm.attention.ops.triton_mla import mla_decode_per_row, mla_decode_triton
        from vllm.attention.ops.triton_mla_decode import default_config, mla_decode_mma

        q_lat = self.latent_query()
        fmt = self.layer.impl.latent_format(self.layer, torch.bfloat16)  # type: ignore[attr-defined]
        m = self.meta
        args = (q_lat, self.cache, m.block_table, m.decode_token_req, m.decode_token_pos, fmt)
        if variant == "per-row":
            return lambda: mla_decode_per_row(*args, scale=self.spec.scale,
                                              max_seq_len=m.max_decode_seq_len)
        if variant in ("triton", "gluon", "gluon-lead", "fp8-mma"):
            base = default_config(q_lat.dtype, gpu_of(q_lat.device))
            if variant == "fp8-mma":
                cfg = dataclasses.replace(base, fp8_mma=True)
            elif variant == "gluon-lead":
                cfg = dataclasses.replace(base, few_heads=False)
            else:
                cfg = dataclasses.replace(base, gluon=variant == "gluon", lead=False)
            return lambda: mla_decode_mma(*args, scale=self.spec.scale,
                                          max_seq_len=m.max_decode_seq_len, config=cfg,
                                          out_dtype=torch.bfloat16)
        return lambda: mla_decode_triton(*args, scale=self.spec.scale,
                                         max_seq_len=m.max_decode_seq_len,
                                         out_dtype=torch.bfloat16)

    def kernel_path(self, fp8_mma: bool = False) -> str:
        """``gluon-fp8-mma`` where ``fp8_mma`` asks for the fp8-MMA kernel and it takes
        the decode; ``gluon-few-heads``, ``gluon-lead`` or ``gluon`` where the default
        decode runs a Gluon kernel (the few-heads one, the lead-warpgroup one or the one
        with split scores); else ``triton``."""
        from vllm.attention.ops.triton_mla_decode import (
            default_config,
            takes_few_heads,
            takes_fp8_mma,
            takes_gluon,
            takes_lead,
        )

        gpu = gpu_of(self.q.device)
        cfg = dataclasses.replace(default_config(self.q.dtype, gpu), fp8_mma=fp8_mma)
        if takes_fp8_mma(cfg, self.q.dtype, self.cache, L, R, gpu, scale=self.spec.scale):
            return "gluon-fp8-mma"
        # (an fp8_ds_mla cache, bytes: takes_gluon says no, as the launcher routes it)
        if takes_few_heads(cfg, self.q.dtype, self.cache, L, R, gpu, scale=self.spec.scale,
                           num_heads=self.spec.num_heads):
            return "gluon-few-heads"
        if takes_lead(cfg, self.q.dtype, self.cache, L, R, gpu, scale=self.spec.scale):
            return "gluon-lead"
        if takes_gluon(cfg, self.q.dtype, self.cache, L, R, gpu, scale=self.spec.scale):
            return "gluon"
        return "triton"

    def parts(self) -> dict[str, Callable[[], object]]:
        """The layer's decode step piece by piece, as its forward runs them (a pure
        decode batch: the query and output rows are read and written in place): the
        cache write, the query absorption, the decode kernel on the strided absorbed
        query and rope part, and the output projection into the output rows."""
        from vllm.attention.ops.triton_mla import mla_decode_triton

        layer, m, proj = self.layer, self.meta, self.spec.projection
        fmt = layer.impl.latent_format(layer, torch.bfloat16)  # type: ignore[attr-defined]
        q_nope, q_pe = self.q[..., :P], self.q[..., P:]
        absorbed = proj.absorb_query(q_nope)
        o_lat = torch.empty(self.q.shape[0], self.spec.num_heads, L, dtype=self.q.dtype,
                            device=self.q.device)
        out3 = self.out.view(self.q.shape[0], self.spec.num_heads, V)

        def decode() -> torch.Tensor:
            return mla_decode_triton(absorbed, self.cache, m.block_table, m.decode_token_req,
                                     m.decode_token_pos, fmt, scale=self.spec.scale,
                                     max_seq_len=m.max_decode_seq_len, out_dtype=self.q.dtype,
                                     q_pe=q_pe)

        return {
            "write": lambda: layer.kv_cache_writer.write(
                self.kv_c, self.k_pe, self.cache, self.batch.new_slots, layer.kv_quant),
            "absorb": lambda: proj.absorb_query(q_nope),
            "decode": decode,
            "project": lambda: proj.project_output(o_lat, out=out3),
        }

    def float64_reference(self, requests: int = 4) -> tuple[int, torch.Tensor]:
        """The decode output of the first ``requests`` requests' tokens from the torch
        path in float64 arithmetic, and how many rows (tokens) that is."""
        from vllm.attention.ops.mla_attention import mla_decode_torch

        m = self.meta
        groups = m.decode_groups[:requests]
        rows = groups[-1].rows.stop
        fmt = self.layer.impl.latent_format(self.layer, torch.bfloat16)  # type: ignore[attr-defined]
        ref = mla_decode_torch(self.latent_query()[:rows], self.cache, m.block_table, groups,
                               fmt, scale=self.spec.scale, dtype=torch.float64)
        return rows, ref

    def check(self, variant: str = "default", requests: int = 4) -> float:
        """Relative error of the decode ``variant`` (:meth:`kernel`) on the first
        ``requests`` requests' tokens against float64 (:meth:`float64_reference`)."""
        out = self.kernel(variant)()
        rows, ref = self.float64_reference(requests)
        return float((out[:rows].double() - ref).norm() / ref.norm())

    def work(self) -> dict[str, float]:
        """The step's multiply-adds (as GFLOP) and cache bytes read (MB)."""
        b, n, s = self.q.shape[0], self.spec.num_heads, self.context
        flops = 2.0 * b * n * s * (L + R) + 2.0 * b * n * s * L
        nbytes = float(b * s * (L + R) * self.cache.element_size())
        return {"gflop": flops / 1e9, "mbytes": nbytes / 1e6}


def apply_roofline(rows: list[dict[str, Any]], rates: dict[str, float]) -> None:
    """Each row's roofline (``max(flops / matmul rate, bytes / read rate)``) and, for
    timed steps, ``roofline / achieved``, from its ``gflop`` and ``mbytes``."""
    for row in rows:
        compute_us = row["gflop"] * 1e9 / (rates["matmul_tflops"] * 1e12) * 1e6
        memory_us = row["mbytes"] * 1e6 / (rates["read_gbps"] * 1e9) * 1e6
        row.update(compute_us=compute_us, memory_us=memory_us,
                   roofline_us=max(compute_us, memory_us))
        if row["fraction"] is not None:
            row["fraction"] = row["roofline_us"] / row["us"]


def _time(fn: Callable[[], object], device: torch.device, replays: int) -> float:
    if device.type == "cuda":
        return replay_us(capture(fn), replays=replays)
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    rates: dict[str, Any] = {}
    matmul: list[float] = []  # the matmul rate's timings through the run
    if cuda:
        rates.update(read_gbps(device))
        matmul.append(matmul_tflops(device))
    else:
        rates.update({"copy_gbps": 1.0, "sum_gbps": 1.0, "read_gbps": 1.0})
    rows: list[dict[str, Any]] = []
    failed = False
    for heads in args.heads:
        for cache_dtype in args.cache_dtypes:
            for name in args.backends:
                step = Step(name, heads, cache_dtype, args.batch, args.context, device)
                impl: Any = step.layer.impl
                with step.active():
                    step.layer_call()
                    path = impl.last_path
                    layer_us = _time(step.layer_call, device, args.replays)
                base = {"heads": heads, "cache": cache_dtype, **step.work()}
                # the layer's decode kernel where it is a Gluon one (FLASHMLA's default
                # with an E4M3 cache past 32 heads is the fp8-MMA kernel:
                # MLACommonImpl.uses_fp8_mma)
                uses8 = impl.uses_fp8_mma()
                kpath = step.kernel_path(uses8) if cuda else ""
                # (fractions filled in at the end, against the run's fastest matmul)
                rows.append({**base, "what": f"{name} layer",
                             "path": f"{path}:{kpath}" if kpath else path, "us": layer_us,
                             "fraction": 0.0})
                if (step.cache.dtype == torch.float8_e4m3fn and cuda
                        and step.kernel_path() in ("gluon-lead", "gluon-few-heads")):
                    # the layer with the other numerics: its decode on fp8 tensor cores
                    # (E4M3 query and probabilities) where the default is exact, or exact
                    # where the default is the fp8-MMA kernel
                    saved = impl.fp8_mma
                    impl.fp8_mma = not uses8
                    try:
                        with step.active():
                            step.layer_call()
                            us_other = _time(step.layer_call, device, args.replays)
                    finally:
                        impl.fp8_mma = saved
                    other = "exact" if uses8 else "fp8-mma"
                    rows.append({**base, "what": f"{name} layer {other}",
                                 "path": f"{path}:{step.kernel_path(not uses8)}",
                                 "us": us_other, "fraction": 0.0})
                if name != args.backends[0] or not (cuda or args.interpret):
                    continue
                err = step.check()
                tol = step.backend.tolerances[torch.bfloat16]
                failed |= not err < tol
                kernel_path = step.kernel_path()
                variants: list[tuple[str, str, str, float | None]] = [
                    ("decode kernel", "default", kernel_path, err)]
                # the kernels the default replaced, beside it
                earlier = {"gluon-few-heads": ["gluon-lead", "gluon", "triton"],
                           "gluon-lead": ["gluon", "triton"], "gluon": ["triton"]}
                for alt in earlier.get(kernel_path, []):
                    err_t = step.check(alt)
                    failed |= not err_t < tol
                    variants.append(("decode kernel", alt, alt, err_t))
                if (kernel_path in ("gluon-lead", "gluon-few-heads")
                        and step.cache.dtype == torch.float8_e4m3fn):
                    # E4M3 query and probabilities: a tolerance of its own
                    from vllm.attention.ops.triton_mla_decode import FP8_MMA_TOLERANCE

                    err_f = step.check("fp8-mma")
                    failed |= not err_f < FP8_MMA_TOLERANCE
                    variants.append(("decode kernel", "fp8-mma", "gluon-fp8-mma", err_f))
                variants.append(("per-row kernel", "per-row", "triton", None))
                for what, variant, kpath, kerr in variants:
                    us = _time(step.kernel(variant), device, args.replays)
                    rows.append({**base, "what": what, "path": kpath, "us": us,
                                 "fraction": 0.0, "rel_err": kerr})
                if cuda or args.interpret:  # where the layer's time goes
                    for part, fn in step.parts().items():
                        us = _time(fn, device, args.replays)
                        rows.append({**base, "what": f"  layer: {part}", "path": "", "us": us,
                                     "fraction": None})
            if cuda:
                matmul.append(matmul_tflops(device))
    rates["matmul_tflops"] = max(matmul) if matmul else 1.0
    rates["matmul_tflops_samples"] = matmul
    apply_roofline(rows, rates)
    return {"rates": rates, "rows": rows, "failed": failed}


COLUMNS = [("heads", "N", "d"), ("cache", "cache", ""), ("what", "what", ""),
           ("path", "path", ""), ("us", "time us", ".1f"), ("roofline_us", "roofline us", ".1f"),
           ("fraction", "x roofline", ".3f"), ("compute_us", "flop us", ".1f"),
           ("memory_us", "byte us", ".1f"), ("rel_err", "err", ".1e")]


def add_shape_options(p: argparse.ArgumentParser) -> None:
    """The steps' shape options (batch, context, head counts, cache dtypes), shared with
    tune_mla_decode.py so that it sweeps at this benchmark's shapes."""
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--heads", type=int, nargs="+", default=[128, 16])
    p.add_argument("--cache-dtypes", nargs="+", default=["auto", "fp8"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None)
    add_shape_options(p)
    p.add_argument("--backends", nargs="+", default=["TRITON_MLA", "FLASHMLA"])
    p.add_argument("--replays", type=int, default=100)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    args.interpret = False
    if args.device == "cpu":
        import os

        args.interpret = os.environ.get("TRITON_INTERPRET") == "1"
        args.batch, args.context, args.heads = 2, 64, [16]
        print("no CUDA: smoke configuration (2 requests, 64 tokens); numbers are meaningless")
    result = run(args)
    with report_text() as text:
        r = result["rates"]
        samples = ", ".join(f"{x:.0f}" for x in r["matmul_tflops_samples"])
        print(f"read {r['read_gbps']:.0f} GB/s (copy {r['copy_gbps']:.0f}, sum "
              f"{r['sum_gbps']:.0f}); bf16 matmul {r['matmul_tflops']:.0f} TFLOP/s "
              f"(the fastest of {samples})")
        print_table(result["rows"], COLUMNS)
    if args.out is not None:
        info = device_info(torch.device(args.device))
        write_report(args.out, "mla_decode",
                     {"device": info, "args": {k: str(v) for k, v in vars(args).items()},
                      **result}, text.getvalue())
    if result["failed"]:
        print("FAILED: the decode kernel is outside the backend's tolerance")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
