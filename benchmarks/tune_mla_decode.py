"""Sweep the MLA decode kernel's launch parameters at the benchmark's shapes.

For each shape (128 and 16 heads, bf16 and fp8 caches, batch 64, 4096 tokens of
context, page 64) every variant of ``VARIANTS`` (heads and rows a tile, warps,
pipeline stages, value split, TMA) runs at several split counts, replayed from a CUDA
graph and timed by CUDA events; each output is checked against the default launch's
(relative error within the backend's tolerance, else the variant is marked wrong).
Times are reported with their ratio to the default launch measured in the same run.
A variant that does not compile or launch (shared memory, registers) is listed with
its error. ``--budget`` seconds bounds the sweep (variants past it are listed as
skipped); the defaults finish in about three minutes on an H200, most of it compiling.

    python benchmarks/tune_mla_decode.py --out DIR   # DIR/tune_mla_decode.json and .txt

Without CUDA it exits after saying so: the sweep needs a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import capture, device_info, print_table, replay_us, write_json  # noqa: E402
from bench_mla_decode import Step  # noqa: E402

# (block_h, block_n, num_warps, num_stages, v_split, tma)
VARIANTS: list[tuple[int, int, int, int, int, bool]] = [
    (64, 64, 8, 2, 1, True),     # the sm_90 default
    (64, 32, 8, 2, 1, True),
    (64, 32, 8, 3, 1, True),
    (64, 128, 8, 1, 1, True),    # wider score MMAs, one stage (bf16: 80 bytes of spills)
    (64, 64, 8, 2, 1, False),    # pointer loads
    (64, 64, 4, 2, 2, True),     # value split, one warpgroup a program
    (64, 64, 8, 2, 2, True),     # value split, two
    (64, 32, 4, 2, 2, True),
    (64, 32, 4, 1, 2, True),     # 112 KiB of shared memory: two programs an SM
    (64, 16, 4, 2, 2, True),     # 111 KiB, pipelined: two programs an SM
    (16, 16, 4, 2, 1, True),     # Ampere-style MMA (spills on sm_90)
]
SPLITS = {128: [None, 1, 2, 4], 16: [None, 2, 4, 8]}


def _name(v: tuple[int, int, int, int, int, bool]) -> str:
    bh, bn, w, st, vs, tma = v
    return f"bh{bh}-bn{bn}-w{w}-s{st}" + ("-vsplit" if vs == 2 else "") + ("" if tma else "-notma")


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    from vllm.attention.ops.triton_mla_decode import MLADecodeConfig, mla_decode_mma

    device = torch.device("cuda")
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for heads in args.heads:
        for cache_dtype in args.cache_dtypes:
            step = Step("TRITON_MLA", heads, cache_dtype, args.batch, args.context, device)
            q_lat = step.latent_query()
            fmt = step.layer.impl.latent_format(step.layer, torch.bfloat16)  # type: ignore[attr-defined]
            m = step.meta
            tol = step.backend.tolerances[torch.bfloat16]

            def launch(cfg: MLADecodeConfig | None, splits: int | None) -> torch.Tensor:
                return mla_decode_mma(q_lat, step.cache, m.block_table, m.decode_token_req,
                                      m.decode_token_pos, fmt, scale=step.spec.scale,
                                      max_seq_len=m.max_decode_seq_len, config=cfg,
                                      num_splits=splits, out_dtype=torch.bfloat16)

            want = launch(None, None).float()
            default_us = replay_us(capture(lambda: launch(None, None)), replays=args.replays)
            base = {"heads": heads, "cache": cache_dtype}
            rows.append({**base, "variant": "default", "splits": "auto", "us": default_us,
                         "vs_default": 1.0})
            for v in VARIANTS:
                bh, bn, w, st, vs, tma = v
                cfg = MLADecodeConfig(block_h=bh, block_n=bn, num_warps=w, num_stages=st,
                                      v_split=vs, tma=tma)
                for splits in SPLITS.get(heads, [None, 1, 4]):
                    row = {**base, "variant": _name(v), "splits": splits or "auto"}
                    rows.append(row)
                    if time.perf_counter() - start > args.budget:
                        row["note"] = "skipped (budget)"
                        continue
                    try:
                        got = launch(cfg, splits).float()
                        err = float((got - want).norm() / want.norm())
                        us = replay_us(capture(lambda: launch(cfg, splits)),
                                       replays=args.replays)
                    except Exception as exc:  # does not compile or launch: record it
                        row["note"] = f"{type(exc).__name__}: {str(exc)[:100]}"
                        continue
                    row.update(us=us, vs_default=default_us / us, err=err,
                               note="" if err < tol else f"WRONG (err {err:.1e} > {tol})")
    return rows


COLUMNS = [("heads", "N", "d"), ("cache", "cache", ""), ("variant", "variant", ""),
           ("splits", "splits", ""), ("us", "time us", ".1f"),
           ("vs_default", "default/this", ".3f"), ("err", "err", ".1e"), ("note", "note", "")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--heads", type=int, nargs="+", default=[128, 16])
    p.add_argument("--cache-dtypes", nargs="+", default=["auto", "fp8"])
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--budget", type=float, default=170.0, help="seconds for the sweep")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_mla_decode needs CUDA; nothing to sweep here")
        return 0
    rows = sweep(args)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_table(rows, COLUMNS)
        for heads in args.heads:
            for cache in args.cache_dtypes:
                timed = [r for r in rows if r["heads"] == heads and r["cache"] == cache
                         and r.get("us") is not None and not r.get("note")]
                if timed:
                    best = min(timed, key=lambda r: r["us"])
                    print(f"best N={heads} {cache}: {best['variant']} splits={best['splits']} "
                          f"{best['us']:.1f} us ({best['vs_default']:.3f} x the default's speed)")
    text = buf.getvalue()
    print(text, end="")
    if args.out is not None:
        write_json(args.out, "tune_mla_decode.json",
                   {"device": device_info(torch.device("cuda")),
                    "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
        (args.out / "tune_mla_decode.txt").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
