"""MLA prefill through ``MLAAttention`` (write, then the expanded form) against the same
arithmetic on torch's own kernels, measured in the same run.

Shapes: DeepSeek-V3's (latent 512 + rope 64, P 128, V 128, 128 heads), page 64, bf16
model; bf16 and fp8 (E4M3, scale 0.37) caches; a fresh batch (8 requests x 2048 new
tokens) and a chunked one (8 x (2048 cached + 2048 new)). For each:

* ``layer``: the layer's call (cache write, K/V expanded from the latent, attention),
  eager, timed by CUDA events: the prefill rows on the path the layer takes
  (``flash-prefill`` on CUDA: ``ops/mla_prefill_flash.py``), then with
  ``force_path = "torch"`` (the float32 torch path it replaces);
* ``baseline``: upstream's arithmetic on torch's kernels, with nothing of the layer's
  own: each request's latent expanded by two bf16 matmuls over its whole context, then
  one call of torch's flash varlen kernel (``aten._flash_attention_forward``, causal
  aligned to the bottom right, V padded to Q's width) over all requests, the latent
  already gathered and contiguous.

Reported: each time, the attention's own FLOPs per second (causal: ``2 S_q S_k N
(P + R + V)`` halved over the new tokens' square), and ``baseline / layer``. Each
output is checked against the torch path (exit 1 beyond the backend's tolerance).

    python benchmarks/bench_mla_prefill.py --out DIR   # DIR/mla_prefill.json and .txt

Without CUDA: a smoke run (2 requests, 32 tokens, the torch path); numbers mean nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import device_info, event_us, print_table, report_text, write_report  # noqa: E402
from bench_mla_decode import PAGE, L, P, R, V, _spec, mla_layer  # noqa: E402
from bench_prefill import prefill_flops, relative_error  # noqa: E402

from vllm.attention.batch import make_paged_batch  # noqa: E402
from vllm.attention.ops.mla_attention import decode_latent_rows, gather_latent  # noqa: E402
from vllm.attention.registry import get_backend  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402


class Prefill:
    """One prefill step of one layer: ``batch`` requests of ``new`` tokens after
    ``context`` cached ones."""

    def __init__(self, backend: str, heads: int, cache_dtype: str, batch: int, new: int,
                 context: int, device: torch.device) -> None:
        g = torch.Generator().manual_seed(0)
        self.backend = get_backend(backend)
        self.spec = _spec(heads, cache_dtype, device, g)
        self.batch = make_paged_batch([new] * batch, [context] * batch, block_size=PAGE,
                                      device=device, generator=g)
        self.layer, self.cache = mla_layer(self.backend, self.spec, self.batch, cache_dtype,
                                           device)
        bf: dict[str, Any] = dict(dtype=torch.bfloat16, device=device)
        self.meta = self.backend.get_builder_cls()(self.spec, device).build(self.batch.common)
        t = batch * new
        self.q = torch.randn(t, heads, P + R, **bf)
        self.kv_c = torch.randn(t, L, **bf)
        self.k_pe = torch.randn(t, R, **bf)
        self.out = torch.empty(t, heads * V, **bf)
        self.sizes = (batch, new, context)

    def call(self) -> None:
        with set_forward_context(attn_metadata={"mla": self.meta},
                                 slot_mapping={"mla": self.batch.new_slots}):
            self.layer(self.q, self.kv_c, self.k_pe, self.out)

    def baseline(self) -> Any:
        """Upstream's arithmetic on torch's kernels (the latent gathered beforehand)."""
        from vllm.attention.ops.flash_varlen import aten_varlen_kernel

        batch, new, context = self.sizes
        n, s = self.spec.num_heads, new + context
        fmt = self.layer.impl.latent_format(self.layer, torch.bfloat16)  # type: ignore[attr-defined]
        bt = self.meta.block_table
        rows = torch.cat([decode_latent_rows(gather_latent(self.cache, bt[r], 0, s), fmt,
                                             dtype=torch.bfloat16) for r in range(batch)])
        w = self.spec.projection
        wk = w.w_uk.reshape(n * P, L).t().contiguous()
        wv = w.w_uv.permute(1, 0, 2).reshape(L, n * V).contiguous()
        dev = rows.device
        k = torch.zeros(batch * s, n, P + R, dtype=torch.bfloat16, device=dev)
        v = torch.zeros(batch * s, n, P + R, dtype=torch.bfloat16, device=dev)
        out = torch.empty(batch * new, n, P + R, dtype=torch.bfloat16, device=dev)
        cu_q = torch.arange(0, batch + 1, dtype=torch.int32, device=dev) * new
        cu_k = torch.arange(0, batch + 1, dtype=torch.int32, device=dev) * s
        used = torch.full((batch,), s, dtype=torch.int32, device=dev)

        def run() -> None:
            k[..., :P] = (rows[:, :L] @ wk).view(batch * s, n, P)
            k[..., P:] = rows[:, L:].unsqueeze(1)
            v[..., :V] = (rows[:, :L] @ wv).view(batch * s, n, V)
            aten_varlen_kernel(self.q, k, v, cu_q=cu_q, cu_k=cu_k, seqused_k=used, max_q=new,
                         max_k=s, causal=True, scale=self.spec.scale, window_left=None,
                         out=out)
        return run, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--cache-dtypes", nargs="+", default=["auto", "fp8"])
    p.add_argument("--backend", default="TRITON_MLA")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    shapes = [("fresh", 8, 2048, 0), ("chunked", 8, 2048, 2048)] if cuda else \
        [("fresh", 2, 32, 0), ("chunked", 2, 16, 16)]
    if not cuda:
        print("no CUDA: smoke configuration; numbers are meaningless")
    rows: list[dict[str, Any]] = []
    failed = False
    for cache_dtype in args.cache_dtypes:
        for name, batch, new, context in shapes:
            step = Prefill(args.backend, args.heads, cache_dtype, batch, new, context, device)
            # (bench_prefill's causal area, its D the mean of the score and value widths)
            flops = prefill_flops([context] * batch, [new] * batch, args.heads,
                                  (P + R + V) // 2)
            impl: Any = step.layer.impl
            times: dict[str, float] = {}
            outs: dict[str, torch.Tensor] = {}
            for label, force in (("layer", None), ("layer, torch path", "torch")):
                impl.force_path = force
                step.call()
                path = impl.last_path
                times[label] = event_us(step.call, iters=3 if force else 10, warmup=1,
                                        rounds=3, device=device)
                outs[label] = step.out.clone()
                rows.append({"cache": cache_dtype, "shape": name, "what": label,
                             "path": path, "us": times[label],
                             "tflops": flops / (times[label] * 1e-6) / 1e12})
            impl.force_path = None
            err = relative_error(outs["layer"], outs["layer, torch path"])
            tol = step.backend.tolerances[torch.bfloat16]
            failed |= not err < tol
            rows[-2]["rel_err"] = err
            if cuda:
                run, _ = step.baseline()
                us = event_us(run, iters=10, warmup=2, rounds=3, device=device)
                rows.append({"cache": cache_dtype, "shape": name,
                             "what": "baseline: expand + flash varlen", "path": "aten",
                             "us": us, "tflops": flops / (us * 1e-6) / 1e12})
                rows[-3]["x_baseline"] = us / times["layer"]
            del step
            if cuda:
                torch.cuda.empty_cache()
    columns = [("cache", "cache", ""), ("shape", "shape", ""), ("what", "what", ""),
               ("path", "path", ""), ("us", "time us", ".1f"), ("tflops", "attn TFLOP/s", ".1f"),
               ("x_baseline", "baseline / layer", ".3f"), ("rel_err", "err vs torch", ".1e")]
    with report_text() as text:
        print_table(rows, columns)
    if args.out is not None:
        write_report(args.out, "mla_prefill",
                     {"device": device_info(device),
                      "args": {k: str(v) for k, v in vars(args).items()},
                      "rows": rows, "failed": failed}, text.getvalue())
    if failed:
        print("FAILED: the layer's prefill is outside the backend's tolerance")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
