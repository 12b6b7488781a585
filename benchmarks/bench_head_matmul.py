"""MLA's per-head products: the Triton kernel of ``vllm.attention.ops.head_matmul``
against ``torch.bmm`` (cuBLAS).

Shapes: DeepSeek-V3's absorption ``q_nope @ W_UK`` (``[T, N, 128] @ [N, 128, 512]``, the
query a slice of ``[T, N, 192]``) and output projection ``o_lat @ W_UV``
(``[T, N, 512] @ [N, 512, 128]`` into the rows of a ``[T, N, 128]`` output), N = 128
and 16 heads, bf16, T decode tokens.

Each is timed two ways, as device time per call of its kernels (``torch.profiler``):

* cold: a 256 MiB buffer is overwritten before every call, so the weights come from
  memory as they do in a layer, after the decode has streamed the cache through L2;
* warm: back-to-back calls (weights in L2), for reference.

The read rate (an eager copy of a 2 GiB tensor, ``_timing.copy_ceiling_gbps``) is
measured in the same run; each cold row reports the bytes the
product must move (weight, operand, result) over its time, as a fraction of that
rate. Every result is checked against float64 (relative max error, both paths; exit 1
above ``MAX_ERR``).
``--sweep`` also times alternative tiles of the Triton kernel at some token counts
(for every ``--heads``).

    python benchmarks/bench_head_matmul.py --out DIR   # DIR/head_matmul.json and .txt

Without CUDA: nothing to time; says so.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import (
    copy_ceiling_gbps,
    cuda_or_skip,
    device_info,
    kernel_us,
    print_table,
    report_text,
    write_report,
)

from vllm.attention.ops.head_matmul import (
    HeadMatmulConfig,
    default_config,
    head_matmul,
)

P, R, L, V = 128, 64, 512, 128
MAX_ERR = 1e-2
"""Largest relative max error against float64 (a bf16 result's rounding is 2**-9 of each
element; the relative max error is against the largest): beyond it the run fails."""
SWEEP = {  # op: (block_t, block_c, block_k, num_warps, num_stages) alternatives
    "absorb": [(64, 128, 64, 4, 2), (64, 128, 128, 4, 1), (64, 64, 64, 4, 2),
               (64, 64, 128, 4, 1), (64, 32, 128, 4, 1), (64, 128, 64, 8, 2),
               (64, 256, 64, 8, 2), (32, 128, 64, 4, 2), (64, 128, 32, 4, 3),
               (64, 64, 32, 4, 3)],
    "project": [(64, 64, 64, 4, 3), (64, 64, 128, 4, 3), (64, 32, 64, 4, 3),
                (64, 32, 128, 4, 2), (64, 16, 128, 4, 2), (64, 64, 64, 4, 4),
                (64, 128, 64, 4, 3), (64, 64, 64, 8, 3), (32, 64, 64, 4, 3),
                (64, 32, 64, 4, 4), (64, 64, 32, 4, 5)],
}


def _operands(op: str, t: int, n: int, device: torch.device, seed: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    if op == "absorb":
        q = torch.randn(t, n, P + R, generator=g).to(torch.bfloat16).to(device)
        w = (torch.randn(n, P, L, generator=g) * P ** -0.5).to(torch.bfloat16).to(device)
        return q[..., :P], w, None
    o = torch.randn(t, n, L, generator=g).to(torch.bfloat16).to(device)
    w = (torch.randn(n, L, V, generator=g) * L ** -0.5).to(torch.bfloat16).to(device)
    return o, w, torch.empty(t, n, V, dtype=torch.bfloat16, device=device)


def _err(got: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> float:
    ref = torch.einsum("tnk,nkc->tnc", a.double(), w.double())
    return float((got.double() - ref).abs().max() / ref.abs().max())


def _cold_us(fn: Callable[[], object], scrub: torch.Tensor, device: torch.device,
             scrub_names: set[str]) -> float:
    """Device time per call of ``fn``'s kernels, each call after ``scrub`` is
    overwritten (the scrub's own kernels not counted)."""
    def both() -> None:
        scrub.fill_(1.0)
        fn()

    return sum(us for name, us in kernel_us(both, device, calls=20) if name not in scrub_names)


def _warm_us(fn: Callable[[], object], device: torch.device) -> float:
    return sum(us for _, us in kernel_us(fn, device, calls=50))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/local"))
    p.add_argument("--heads", type=int, nargs="+", default=[128, 64, 16])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 128, 256, 512])
    p.add_argument("--sweep", type=int, nargs="*", default=[64, 256],
                   help="token counts at which to time the alternative tiles")
    args = p.parse_args(argv)
    device = cuda_or_skip("bench_head_matmul.py", "the per-head products on a GPU")
    if device is None:
        return 0
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    read = copy_ceiling_gbps(device)
    scrub = torch.empty(256 << 20 >> 2, dtype=torch.float32, device=device)
    scrub_names = {name for name, _ in kernel_us(lambda: scrub.fill_(1.0), device, calls=3)}
    rows: list[dict[str, Any]] = []
    for n in args.heads:
        for op in ("absorb", "project"):
            for t in args.tokens:
                a, w, out = _operands(op, t, n, device, seed=t + n)
                moved = (a.numel() + w.numel() + t * n * w.shape[2]) * 2
                row: dict[str, Any] = {"op": op, "heads": n, "tokens": t, "MB": moved / 1e6}
                for path in ("bmm", "triton"):
                    fn = partial(head_matmul, a, w, out, path=path)
                    row[f"{path}_err"] = _err(fn(), a, w)
                    row[f"{path}_cold_us"] = _cold_us(fn, scrub, device, scrub_names)
                    row[f"{path}_warm_us"] = _warm_us(fn, device)
                    row[f"{path}_x_read"] = moved / (row[f"{path}_cold_us"] * 1e-6) / 1e9 / read
                row["bmm_over_triton_cold"] = row["bmm_cold_us"] / row["triton_cold_us"]
                rows.append(row)
                print(f"  {op} N={n} T={t}: bmm {row['bmm_cold_us']:.1f} us, "
                      f"triton {row['triton_cold_us']:.1f} us", flush=True)
    sweep: list[dict[str, Any]] = []
    for n, t in [(n, t) for n in args.heads for t in args.sweep]:
        for op, configs in SWEEP.items():
            a, w, out = _operands(op, t, n, device, seed=t)
            base = default_config(t, a.shape[2], w.shape[2])
            for cfg in (base, *(HeadMatmulConfig(*c) for c in configs if
                                HeadMatmulConfig(*c) != base)):
                fn = partial(head_matmul, a, w, out, path="triton", config=cfg)
                try:
                    err = _err(fn(), a, w)
                    us = _cold_us(fn, scrub, device, scrub_names)
                except (CompilationError, OutOfResources) as e:  # reported, not fatal
                    sweep.append({"op": op, "heads": n, "tokens": t, "config": str(cfg),
                                  "error": repr(e)})
                    continue
                sweep.append({"op": op, "heads": n, "tokens": t, "default": cfg == base,
                              "config": f"t{cfg.block_t} c{cfg.block_c} k{cfg.block_k} "
                                        f"w{cfg.num_warps} s{cfg.num_stages}",
                              "cold_us": us, "err": err})
    with report_text() as text:
        print(f"read {read:.0f} GB/s; cold = weights from memory (L2 overwritten before "
              "each call); x read = bytes moved / time / read rate")
        print_table(rows, [("op", "op", ""), ("heads", "N", ""), ("tokens", "T", ""),
                           ("MB", "MB", ".1f"),
                           ("bmm_cold_us", "bmm cold", ".1f"),
                           ("triton_cold_us", "triton cold", ".1f"),
                           ("bmm_over_triton_cold", "bmm/triton", ".2f"),
                           ("bmm_x_read", "bmm x read", ".2f"),
                           ("triton_x_read", "triton x read", ".2f"),
                           ("bmm_warm_us", "bmm warm", ".1f"),
                           ("triton_warm_us", "triton warm", ".1f"),
                           ("bmm_err", "bmm err", ".1e"), ("triton_err", "triton err", ".1e")])
        if sweep:
            print("\ntiles of the Triton kernel, cold")
            print_table(sweep, [("op", "op", ""), ("heads", "N", ""), ("tokens", "T", ""), ("config", "tiles", ""),
                                ("default", "default", ""), ("cold_us", "us", ".1f"),
                                ("err", "err", ".1e"), ("error", "error", "")])
    write_report(args.out, "head_matmul", {"device": device_info(device), "read_gbps": read,
                                           "rows": rows, "sweep": sweep}, text.getvalue())
    worst = max([r[f"{path}_err"] for r in rows for path in ("bmm", "triton")]
                + [r["err"] for r in sweep if "err" in r], default=0.0)
    if worst > MAX_ERR:
        print(f"relative error {worst:.2e} against float64 above {MAX_ERR}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
