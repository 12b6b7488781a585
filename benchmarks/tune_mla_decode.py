"""Sweep the MLA decode kernel's launch parameters at the benchmark's shapes.

For each shape (128 and 16 heads, bf16 and fp8 caches, batch 64, 4096 tokens of
context, page 64) every variant of ``VARIANTS`` (heads and rows a tile, warps,
pipeline stages, value split, TMA) runs at several split counts, replayed from a CUDA
graph and timed by CUDA events; each output (and the default launch's) is checked
against float64 on the first four tokens (relative error within the backend's
tolerance, else the row is marked wrong). Times are reported with their ratio to the
default launch measured in the same run. A variant that does not compile or launch
(shared memory, registers) is listed with its error. ``--budget`` seconds bounds the
sweep, shared equally by the shapes (a shape's variants past its share are listed as
skipped; compiling takes most of it); ``--variants`` keeps the variants whose name
contains one of the given strings.

    python benchmarks/tune_mla_decode.py --out DIR   # DIR/tune_mla_decode.json and .txt

Without CUDA it exits after saying so: the sweep needs a GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import (  # noqa: E402
    capture,
    device_info,
    print_table,
    replay_us,
    report_text,
    write_report,
)
from bench_mla_decode import Step, add_shape_options  # noqa: E402

VARIANTS: list[tuple[str, dict[str, Any]]] = [  # name: MLADecodeConfig arguments
    # the sm_90 default: the score warps split the keys, one [., 512] latent operand
    ("bh64-bn64-w8-s2-1chunk-split", dict(block_h=64, block_n=64, num_warps=8, num_stages=2,
                                          latent_chunks=1, split_scores=True)),
    ("bh64-bn64-w8-s2", dict(block_h=64, block_n=64, num_warps=8, num_stages=2)),  # before
    ("bh64-bn64-w8-s2-split", dict(block_h=64, block_n=64, num_warps=8, num_stages=2,
                                   split_scores=True)),
    ("bh64-bn64-w8-s2-1chunk", dict(block_h=64, block_n=64, num_warps=8, num_stages=2,
                                    latent_chunks=1)),
    # fp8: the bfloat16 dots (three instructions widen two E4M3 values) instead of float16
    ("bh64-bn64-w8-s2-1chunk-split-nofp16", dict(block_h=64, block_n=64, num_warps=8,
                                                 num_stages=2, latent_chunks=1,
                                                 split_scores=True, fp8_fp16_dot=False)),
    ("bh64-bn64-w8-s2-1chunk-split-notma", dict(block_h=64, block_n=64, num_warps=8,
                                                num_stages=2, latent_chunks=1,
                                                split_scores=True, tma=False)),
    ("bh64-bn64-w8-s3-1chunk-split", dict(block_h=64, block_n=64, num_warps=8, num_stages=3,
                                          latent_chunks=1, split_scores=True)),
    ("bh64-bn128-w8-s1-1chunk-split", dict(block_h=64, block_n=128, num_warps=8,
                                           num_stages=1, latent_chunks=1, split_scores=True)),
    # earlier sweeps: none beat the default of their day
    ("bh64-bn64-w4-s2-vsplit", dict(block_h=64, block_n=64, num_warps=4, num_stages=2,
                                    v_split=2)),
    ("bh64-bn32-w4-s1-vsplit", dict(block_h=64, block_n=32, num_warps=4, num_stages=1,
                                    v_split=2)),
    ("bh64-bn128-w8-s1", dict(block_h=64, block_n=128, num_warps=8, num_stages=1)),
    ("bh16-bn16-w4-s2", dict(block_h=16, block_n=16, num_warps=4, num_stages=2)),
]
"""Launches to time, the new ones first (the budget may stop the sweep early)."""
SPLITS: dict[int, list[int | None]] = {128: [None], 16: [None, 4]}
"""Split counts tried per head count (None: the launcher's choice; the 2026-12-01 sweep
found more splits than it picks slower at these shapes, so compiling is spent on
variants instead)."""


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    from vllm.attention.ops.triton_mla_decode import MLADecodeConfig, mla_decode_mma

    device = torch.device("cuda")
    rows: list[dict[str, Any]] = []
    share = args.budget / (len(args.heads) * len(args.cache_dtypes))
    variants = [(n, k) for n, k in VARIANTS
                if not args.variants or any(v in n for v in args.variants)]
    for heads in args.heads:
        for cache_dtype in args.cache_dtypes:
            start = time.perf_counter()
            step = Step("TRITON_MLA", heads, cache_dtype, args.batch, args.context, device)
            with step.active():  # writes the step's own token: every read slot is written
                step.layer_call()
            q_lat = step.latent_query()
            fmt = step.layer.impl.latent_format(step.layer, torch.bfloat16)  # type: ignore[attr-defined]
            m = step.meta
            tol = step.backend.tolerances[torch.bfloat16]

            def launch(cfg: MLADecodeConfig | None, splits: int | None) -> torch.Tensor:
                return mla_decode_mma(q_lat, step.cache, m.block_table, m.decode_token_req,
                                      m.decode_token_pos, fmt, scale=step.spec.scale,
                                      max_seq_len=m.max_decode_seq_len, config=cfg,
                                      num_splits=splits, out_dtype=torch.bfloat16)

            n_ref, ref = step.float64_reference(4)

            def error(out: torch.Tensor) -> float:
                return float((out[:n_ref].double() - ref).norm() / ref.norm())

            def note(err: float) -> str:
                return "" if err < tol else f"WRONG (err {err:.1e} > {tol})"

            default_err = error(launch(None, None))
            default_us = replay_us(capture(lambda: launch(None, None)), replays=args.replays)
            base = {"heads": heads, "cache": cache_dtype}
            rows.append({**base, "variant": "default", "splits": "auto", "us": default_us,
                         "vs_default": 1.0, "err": default_err, "note": note(default_err)})
            for name, kwargs in variants:
                cfg = MLADecodeConfig(**kwargs)
                for splits in SPLITS.get(heads, [None, 1, 4]):
                    row = {**base, "variant": name, "splits": splits or "auto"}
                    rows.append(row)
                    if time.perf_counter() - start > share:
                        row["note"] = "skipped (budget)"
                        continue
                    try:
                        err = error(launch(cfg, splits))
                        us = replay_us(capture(lambda: launch(cfg, splits)),
                                       replays=args.replays)
                    except Exception as exc:  # does not compile or launch: record it
                        row["note"] = f"{type(exc).__name__}: {str(exc)[:100]}"
                        continue
                    row.update(us=us, vs_default=default_us / us, err=err, note=note(err))
    return rows


COLUMNS = [("heads", "N", "d"), ("cache", "cache", ""), ("variant", "variant", ""),
           ("splits", "splits", ""), ("us", "time us", ".1f"),
           ("vs_default", "default/this", ".3f"), ("err", "err", ".1e"), ("note", "note", "")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None)
    add_shape_options(p)
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--budget", type=float, default=150.0,
                   help="seconds for the sweep, shared equally by the shapes")
    p.add_argument("--variants", nargs="*", default=[],
                   help="only the variants whose name contains one of these")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_mla_decode needs CUDA; nothing to sweep here")
        return 0
    rows = sweep(args)
    with report_text() as text:
        print_table(rows, COLUMNS)
        for heads in args.heads:
            for cache in args.cache_dtypes:
                timed = [r for r in rows if r["heads"] == heads and r["cache"] == cache
                         and r.get("us") is not None and not r.get("note")]
                if timed:
                    best = min(timed, key=lambda r: r["us"])
                    print(f"best N={heads} {cache}: {best['variant']} splits={best['splits']} "
                          f"{best['us']:.1f} us ({best['vs_default']:.3f} x the default's speed)")
    if args.out is not None:
        write_report(args.out, "tune_mla_decode",
                     {"device": device_info(torch.device("cuda")),
                      "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                     text.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
