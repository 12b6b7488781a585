"""Fused RoPE + KV write against rotate-then-write and against the plain write.

Per token count T (1..64 and 8192), split NHD cache, Hq=32, Hkv=8, D=128, bf16 in,
block 16, NeoX over the whole head, random slots and positions:

* ``fused``: ``writer.write_with_rope(q, k, v, ...)``: one kernel rotates q (in place)
  and k, and writes k and v;
* ``rotate+write``: a RoPE kernel (the same Triton rotation, launched on its own,
  rotating q and k in place) then ``writer.write``: two launches and a round trip of k;
* ``fused k-only``: ``write_with_rope(None, k, v, ...)`` (the query rotated elsewhere);
* ``write``: the plain ``writer.write`` (no rotation at all).

Each is timed as device time per call inside a CUDA graph (20 calls per graph, CUDA
events over the replays) and as eager wall time per call (1000 calls, one sync).
Targets: ``rotate+write / fused >= 1.6`` for T in 1..64 (graph time); at T=8192
``fused k-only / write <= 1.05`` (the rotation rides on the write's memory traffic; with
the query included the fused kernel must also read and write q, which is reported as
``fused / write`` for information). Every configuration is checked once against the
torch oracle (rotate, then the reference write).

    python benchmarks/bench_fused_rope.py --out DIR      # writes DIR/fused_rope.json

Without CUDA: a tiny CPU run of the torch paths (smoke check only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import capture, device_info, host_us, print_table, replay_us, write_json  # noqa: E402

from vllm.attention import KVQuant  # noqa: E402
from vllm.attention.rope import RoPE, apply_rope, rotate_reference  # noqa: E402
from vllm.attention.types import KVCacheLayout  # noqa: E402
from vllm.attention.writers import SplitKVCacheWriter, reference_write  # noqa: E402
from vllm.attention.writers.kernels import rope_launch, triton_importable  # noqa: E402

HQ, HKV, D, BS, MAX_POS = 32, 8, 128, 16, 16384
SMALL_TARGET, LARGE_TARGET = 1.6, 1.05


def _setup(t: int, cache_dtype: str, device: torch.device, seed: int,
           scale_value: float = 1.0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    nb = max(64, 2 * -(-t // BS))
    storage = torch.bfloat16 if cache_dtype == "auto" else torch.float8_e4m3fn
    scale = torch.full((1,), scale_value, device=device)
    return dict(
        q=torch.randn(t, HQ, D, generator=g).to(torch.bfloat16).to(device),
        k=torch.randn(t, HKV, D, generator=g).to(torch.bfloat16).to(device),
        v=torch.randn(t, HKV, D, generator=g).to(torch.bfloat16).to(device),
        cache=torch.zeros(nb, 2, BS, HKV, D, dtype=storage, device=device),
        slots=torch.randperm(nb * BS, generator=g)[:t].to(device),
        positions=torch.randint(0, MAX_POS, (t,), generator=g).to(device),
        quant=KVQuant(cache_dtype, scale, scale.clone()),  # type: ignore[arg-type]
    )


def _check(x: dict[str, Any], rope: RoPE, writer: SplitKVCacheWriter) -> bool:
    """The fused write against rotate-then-reference-write, byte for byte."""
    got, want = x["cache"].clone(), x["cache"].clone()
    q = x["q"].clone()
    writer.write_with_rope(q, x["k"], x["v"], got, x["slots"], x["quant"], x["positions"], rope)
    reference_write(KVCacheLayout.SPLIT_NHD, rotate_reference(x["k"], x["positions"], rope),
                    x["v"], want, x["slots"], x["quant"])
    bits = {1: torch.uint8, 2: torch.int16}[got.element_size()]
    q_ok = torch.equal(q.view(torch.int16),
                       rotate_reference(x["q"], x["positions"], rope).view(torch.int16))
    return bool(torch.equal(got.view(bits), want.view(bits))) and q_ok


def _case(cache_dtype: str, t: int, args: argparse.Namespace, rope: RoPE,
          device: torch.device, cuda: bool) -> dict[str, Any]:
    """One row: the variants of one cache dtype and token count, timed (the step's
    tensors are freed when it returns)."""
    x = _setup(t, cache_dtype, device, seed=t, scale_value=args.scale)
    w = SplitKVCacheWriter(KVCacheLayout.SPLIT_NHD)
    q, k, v, cache, slots, pos, quant = (x[n] for n in ("q", "k", "v", "cache", "slots",
                                                        "positions", "quant"))
    ok = _check(x, rope, w)
    if cuda:
        rotate = rope_launch(q, k, pos, rope.cos_sin_cache, rope.is_neox)

        def rotate_then_write() -> None:
            rotate.run()
            w.write(k, v, cache, slots, quant)
    else:
        def rotate_then_write() -> None:
            apply_rope(q, k, pos, rope)
            w.write(k, v, cache, slots, quant)

    variants = {
        "fused": lambda: w.write_with_rope(q, k, v, cache, slots, quant, pos, rope),
        "rotate+write": rotate_then_write,
        "fused_k_only": lambda: w.write_with_rope(None, k, v, cache, slots, quant, pos,
                                                  rope),
        "write": lambda: w.write(k, v, cache, slots, quant),
    }
    row: dict[str, Any] = {"cache_dtype": cache_dtype, "tokens": t, "matches_oracle": ok}
    for name, fn in variants.items():
        if cuda:
            row[f"{name}_graph_us"] = replay_us(capture(fn, reps=args.reps),
                                                replays=20) / args.reps
        row[f"{name}_eager_us"] = host_us(fn, device, calls=1000 if cuda else 20,
                                          rounds=3)["with_sync_us"]
    key = "graph_us" if cuda else "eager_us"
    row["speedup"] = row[f"rotate+write_{key}"] / row[f"fused_{key}"]
    row["speedup_eager"] = row["rotate+write_eager_us"] / row["fused_eager_us"]
    row["k_only_vs_write"] = row[f"fused_k_only_{key}"] / row[f"write_{key}"]
    row["fused_vs_write"] = row[f"fused_{key}"] / row[f"write_{key}"]
    if cuda:  # the targets, for the bf16 and the fp8 cache alike
        if t <= 64:
            row["target"] = f"speedup >= {SMALL_TARGET}"
            row["ok"] = row["speedup"] >= SMALL_TARGET
        elif t >= 8192:
            row["target"] = f"k-only/write <= {LARGE_TARGET}"
            row["ok"] = row["k_only_vs_write"] <= LARGE_TARGET
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/local"))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 8192])
    p.add_argument("--cache-dtypes", nargs="+", default=["auto", "fp8_e4m3"])
    p.add_argument("--reps", type=int, default=20, help="calls per captured graph")
    p.add_argument("--scale", type=float, default=1.0,
                   help="the fp8 cache's k/v scale: 1.0 (a power of two: the quantiser "
                        "multiplies) or any other value (it divides)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda" and triton_importable()
    if not cuda:
        args.tokens = [t for t in args.tokens if t <= 8][:2]
    rope = RoPE.build(D, MAX_POS, device=device)
    rows: list[dict[str, Any]] = []
    for cache_dtype in args.cache_dtypes:
        for t in args.tokens:
            row = _case(cache_dtype, t, args, rope, device, cuda)
            rows.append(row)
            print(f"  {cache_dtype} T={t}: oracle {'ok' if row['matches_oracle'] else 'MISMATCH'}",
                  flush=True)
            if cuda:
                torch.cuda.empty_cache()
    info = device_info(device)
    print(f"device: {info['device']}; torch {info['torch']}; triton {info['triton']}; "
          f"Hq={HQ} Hkv={HKV} D={D} bf16, block {BS}, NeoX, fp8 scale {args.scale}; "
          f"times per call "
          f"({'CUDA graph' if cuda else 'CPU eager, smoke'})")
    suffix = "graph_us" if cuda else "eager_us"
    print_table(rows, [("cache_dtype", "cache", ""), ("tokens", "T", ""),
                       (f"fused_{suffix}", "fused us", ".2f"),
                       (f"rotate+write_{suffix}", "rot+write us", ".2f"),
                       (f"fused_k_only_{suffix}", "fused-k us", ".2f"),
                       (f"write_{suffix}", "write us", ".2f"),
                       ("speedup", "rot+write/fused", ".2f"),
                       ("speedup_eager", "same, eager", ".2f"),
                       ("k_only_vs_write", "fused-k/write", ".3f"),
                       ("fused_vs_write", "fused/write", ".2f"),
                       ("matches_oracle", "oracle", ""), ("ok", "target ok", "")])
    write_json(args.out, "fused_rope.json", {"meta": {**info, "Hq": HQ, "Hkv": HKV, "D": D,
                                                      "block_size": BS, "style": "neox",
                                                      "graph_reps": args.reps,
                                                      "fp8_scale": args.scale},
                                             "rows": rows})
    return 0 if all(r["matches_oracle"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
