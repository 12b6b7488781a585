"""Launch-parameter sweep of the tiled scatter kernel for the bandwidth targets.

For the target rows of ``bench_writers.py`` (split K/V bf16 and fp8, MLA latent bf16
and fp8, T = 65536 random slots) times the prebuilt kernel launch for every
``BLOCK_T`` x ``num_warps`` (for fp8: at scale 1.0, which the quantiser multiplies by,
and at 0.37 with and without ``FAST_DIV``) and reports GB/s and the ratio to an eager
``copy_`` of a 2 GiB bf16 tensor measured in the same run (each variant timed in a
CUDA graph of 10 launches, as ``bench_writers.py``'s kernel column: eager launches of
the ~30 us MLA writes would time the host). ``--hw-nan both`` adds the fp8
conversion's NaN select on and off. Every variant's cache bytes are compared with the
default launch's (a variant that differs is reported and never chosen). The defaults
in ``vllm/attention/writers/kernels/scatter.py`` come from this table
(``docs/performance.md``); ``--tiled-variants`` adds launch variants (``hints=5``: L2
hints) to every ``BLOCK_T`` x ``num_warps``. Then the fused RoPE + write (keys
only, T=8192) against the plain write, in CUDA graphs, for the launch variants of
``--rope-variants`` (warps, L2 hints, tokens a program, ...), fp8 at each scale.

    python benchmarks/tune_writers.py --out benchmarks/results/h200/<date>-<commit>

Writes ``tune_writers.json``. Needs CUDA and Triton (exits 0 with a note otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Literal

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_writers as bw  # noqa: E402
from _timing import copy_ceiling_gbps  # noqa: E402

from vllm.attention.writers.kernels import (  # noqa: E402
    TRITON_DEFAULT_WARPS,
    Launch,
    packed_widen,
    triton_importable,
)

TARGETS = ["split_nhd/auto", "split_nhd/fp8_e4m3", "mla_latent/auto", "mla_latent/fp8_e4m3"]


def variant(launch: Launch, n: int, block_t: int, warps: int, fast: bool | None,
            hw_nan: bool | None = None, extra: str = "default") -> Launch:
    """The tiled sweep's variant: :func:`launch_variant` of ``BLOCK_T``, warps, where
    given FAST_DIV and HW_NAN, and the ``extra`` spec (``--tiled-variants``)."""
    spec = f"bt={block_t},warps={warps}"
    spec += "" if fast is None else f",fast={int(fast)}"
    spec += "" if hw_nan is None else f",nan={int(hw_nan)}"
    return launch_variant(launch, f"{spec},{extra}", n)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


ROPE_VARIANTS = ["default", "warps=1", "warps=4", "hints=0", "hints=2", "packed=0", "shift=-1",
                 "rcp=0", "shift=-1,rcp=0", "bt=2", "bt=2,warps=4", "bt=4,warps=8",
                 "maxnreg=40"]
"""Variants of the fused RoPE launch (``--rope-variants``), as :func:`launch_variant`
specs. The plain write is timed with the changes of ``PLAIN_VARIANTS``
(``--plain-variants``)."""

PLAIN_VARIANTS = ["default", "packed=0", "shift=-1", "rcp=0", "packed=0,shift=-1,rcp=0"]

_KNOBS = {"hints": "CACHE_HINTS", "packed": "PACKED_WIDEN", "shift": "BS_SHIFT",
          "bt": "BLOCK_T", "rcp": "FAST_RCP", "fast": "FAST_DIV", "nan": "HW_NAN"}
_INT_KNOBS = {"hints", "shift", "bt"}


def launch_variant(base: Launch, spec: str, rows: int) -> Launch:
    """``base`` changed as ``spec`` says: comma-separated ``warps=N``, ``maxnreg=N``
    (register cap), ``hints=B`` (``CACHE_HINTS`` bits), ``packed=0/1`` (``PACKED_WIDEN``),
    ``shift=-1`` (``BS_SHIFT``: divide by the block size), ``bt=N`` (``BLOCK_T`` tokens a
    program; the grid follows for ``rows`` rows), ``rcp=0/1`` (``FAST_RCP``),
    ``fast=0/1`` (``FAST_DIV``), ``nan=0/1`` (``HW_NAN``); ``default`` changes nothing.
    Without ``packed=``, ``PACKED_WIDEN`` follows the variant's tiles and warps as a
    launch's would (:func:`~vllm.attention.writers.kernels.packed_widen`)."""
    consts = dict(base.constexprs)
    options = dict(base.options)
    packed_named = False
    for item in filter(None, spec.split(",")):
        if item == "default":
            continue
        key, _, value = item.partition("=")
        if key in ("warps", "maxnreg"):
            options["num_warps" if key == "warps" else key] = int(value)
        elif key in _KNOBS:
            consts[_KNOBS[key]] = int(value) if key in _INT_KNOBS else bool(int(value))
            packed_named = packed_named or key == "packed"
        else:
            raise ValueError(f"launch variant: unknown knob {key!r} in {spec!r}")
    if not packed_named:
        warps = int(options.get("num_warps", TRITON_DEFAULT_WARPS))
        consts["PACKED_WIDEN"] = packed_widen(base.kernel, consts, warps)
    grid = (-(-rows // int(consts.get("BLOCK_T", 1))), *base.grid[1:])
    return dataclasses.replace(base, grid=grid, constexprs=consts, options=options)


def _rope_sweep(dev: torch.device, specs: list[str], scales: list[float],
                repeat: int, plain_specs: list[str]) -> list[dict[str, object]]:
    """The fused RoPE + write without a query (``fused k-only`` of bench_fused_rope.py)
    at T=8192 against the plain write's launch, device time per call in CUDA graphs (20
    calls a graph, the same positions each call, as consecutive layers have), bf16 and
    fp8 at each of ``scales``: every variant of ``specs``, each one's bytes checked
    against the default launch's; ``repeat`` timing rounds over all variants (median)."""
    import bench_fused_rope as bf
    from _timing import capture, replay_us
    from triton.errors import TritonError

    from vllm.attention.layouts import split_kv_views
    from vllm.attention.writers.kernels import ScatterTarget, rope_kv_launch, scatter_kv_launch
    from vllm.attention.rope import RoPE
    from vllm.attention.writers.split import scatter_mode

    def graph_us(launch: Launch) -> float:
        return replay_us(capture(launch.run, reps=20), replays=20) / 20

    out: list[dict[str, object]] = []
    rope = RoPE.build(bf.D, bf.MAX_POS, device=dev)
    runs: list[tuple[Literal["auto", "fp8_e4m3"], float]] = [("auto", 1.0)]
    runs += [("fp8_e4m3", sc) for sc in scales]
    n = 8192
    for cache_dtype, scale in runs:
        x = bf._setup(n, cache_dtype, dev, 0, scale_value=scale)
        kv, vv = split_kv_views(x["cache"], bw.L.SPLIT_NHD)
        kt, vt = ScatterTarget.token_major(kv), ScatterTarget.token_major(vv)
        mode = scatter_mode(cache_dtype)
        q = x["quant"]
        plain = scatter_kv_launch(x["k"], x["v"], kt, vt, x["slots"], mode, q.k_scale, q.v_scale)
        base = rope_kv_launch(None, x["k"], x["v"], kt, vt, x["slots"], x["positions"],
                              rope.cos_sin_cache, True, mode, q.k_scale, q.v_scale)
        built: list[tuple[str, str, Launch, bool, list[float]]] = []
        for kind, launch, variants in (("plain", plain, plain_specs),
                                       ("rope", base, specs)):
            x["cache"].zero_()
            launch.run()
            want = _raw(x["cache"]).clone()
            for spec in variants:
                v = launch_variant(launch, spec, n)
                try:
                    x["cache"].zero_()
                    v.run()
                    same = bool(torch.equal(_raw(x["cache"]), want))
                except (TritonError, RuntimeError) as exc:  # a variant that does not compile
                    print(f"{kind} {cache_dtype} scale={scale} {spec}: {type(exc).__name__} {exc}")
                    continue
                built.append((kind, spec, v, same, []))
        for _ in range(repeat):
            for _, _, v, _, times in built:
                times.append(graph_us(v))
        plain_us = sorted(built[0][4])[len(built[0][4]) // 2]
        for kind, spec, v, same, times in built:
            us = sorted(times)[len(times) // 2]
            out.append({"config": f"{kind}/{cache_dtype}", "tokens": n, "scale": scale,
                        "variant": spec, "us": us, "us_runs": times,
                        "plain_write_us": plain_us, "vs_plain_write": us / plain_us,
                        "bytes_equal": same})
            spread = f"{min(times):6.2f}-{max(times):6.2f}"
            print(f"{kind:5} {cache_dtype:9} scale={scale:<5} T={n} {spec:22} {us:7.2f} us "
                  f"({spread}) / plain {plain_us:6.2f} = {us / plain_us:5.3f}"
                  + ("" if same else "  BYTES DIFFER"))
        del x
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/local"))
    p.add_argument("--tokens", type=int, nargs="+", default=[65536])
    p.add_argument("--configs", nargs="*", default=TARGETS)
    p.add_argument("--block-t", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--scales", type=float, nargs="+", default=[1.0, 0.37],
                   help="fp8 k/v scales: 1.0 (a power of two: the quantiser multiplies) and "
                        "one that is not (it divides: FAST_DIV on and off)")
    p.add_argument("--fast-div", choices=["both", "on"], default="both",
                   help="for a scale that is not a power of two: FAST_DIV off and on, or on")
    p.add_argument("--tiled-variants", nargs="+", default=["default"],
                   help="launch_variant specs the tiled sweep adds to every BLOCK_T x warps "
                        "(e.g. hints=5: the tiled kernel's CACHE_HINTS)")
    p.add_argument("--hw-nan", choices=["default", "both"], default="default",
                   help="fp8: the launch's HW_NAN, or both settings")
    p.add_argument("--rope-variants", nargs="+", default=ROPE_VARIANTS,
                   help="fused RoPE launch variants (see ROPE_VARIANTS)")
    p.add_argument("--plain-variants", nargs="+", default=PLAIN_VARIANTS,
                   help="plain write variants timed beside them (the first is the baseline)")
    p.add_argument("--no-rope", action="store_true", help="skip the fused RoPE sweep")
    p.add_argument("--only-rope", action="store_true", help="only the fused RoPE sweep")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeat", type=int, default=1,
                   help="timing rounds over all variants (the median is reported)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or not triton_importable():
        print("tune_writers: needs CUDA and Triton; nothing to do here")
        return 0
    dev = torch.device("cuda")
    ns = argparse.Namespace(block_size=16, heads=8, head_size=128, dtype="bf16",
                            kv_lora_rank=512, rope_dim=64, slots="random", path="triton",
                            scale=1.0)
    timing = argparse.Namespace(iters=args.iters, warmup=5)  # bench_writers' graph timing
    copy_gbps = copy_ceiling_gbps(dev, 2.0, 10)
    print(f"eager copy_ ceiling: {copy_gbps:.0f} GB/s")
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, object]] = []
    bad = 0
    for name in ([] if args.only_rope else args.configs):
        cfg = next(c for c in bw.CONFIGS if c.name == name)
        fp8 = cfg.cache_dtype != "auto"
        for n in args.tokens:
            for scale in (args.scales if fp8 else [1.0]):
                ns.scale = scale
                setup = bw.build(cfg, n, ns, dev, gen)
                base = setup.launch
                if base is None or base.kernel != "scatter_kv_tiled_kernel":
                    print(f"{name}: not the tiled kernel, skipped")
                    continue
                setup.cache.zero_()
                base.run()
                want = setup.cache.clone()
                pow2 = math.frexp(scale)[0] == 0.5  # FAST_DIV is not used then
                divide = (False, True) if args.fast_div == "both" else (True,)
                nans = (None,) if args.hw_nan == "default" or not fp8 else (True, False)
                built: list[tuple[Launch, dict[str, object], list[float]]] = []
                for fast, hw_nan, bt, nw, extra in itertools.product(
                        (None,) if not fp8 else (True,) if pow2 else divide, nans,
                        args.block_t, args.warps, args.tiled_variants):
                    v = variant(base, n, bt, nw, fast, hw_nan, extra)
                    try:
                        setup.cache.zero_()
                        v.run()
                        same = bool(torch.equal(_raw(setup.cache), _raw(want)))
                    except Exception as exc:  # a variant that does not compile
                        print(f"{name} T={n} BLOCK_T={bt} warps={nw} fast={fast} {extra}: "
                              f"{exc}")
                        continue
                    bad += not same
                    built.append((v, {"config": name, "tokens": n, "scale": scale,
                                      "block_t": bt, "num_warps": nw, "fast_div": fast,
                                      "hw_nan": hw_nan, "variant": extra,
                                      "bytes_equal": same}, []))
                for _ in range(args.repeat):  # rounds over every variant: drift hits all alike
                    for v, row, times in built:
                        times.append(bw._kernel_us(v, timing, dev))
                for v, row, times in built:
                    runs = sorted(times)
                    us = runs[len(runs) // 2]
                    gbps = setup.bytes_moved / (us * 1e-6) / 1e9
                    row.update(us=us, us_runs=times, gbps=gbps, vs_copy=gbps / copy_gbps)
                    rows.append(row)
                    spread = f" ({runs[0]:.1f}-{runs[-1]:.1f})" if len(runs) > 1 else ""
                    print(f"{name:22} T={n:<6} scale={scale:<5} BLOCK_T={row['block_t']!s:<3} "
                          f"warps={row['num_warps']} fast={row['fast_div']!s:5} "
                          f"hw_nan={row['hw_nan']!s:5} {row['variant']} "
                          f"{us:8.1f} us{spread} {gbps:7.0f} GB/s "
                          f"{gbps / copy_gbps:5.2f}x" + ("" if row["bytes_equal"] else
                                                          "  BYTES DIFFER"))
                default = {k: base.constexprs.get(k) for k in ("BLOCK_T", "FAST_DIV", "HW_NAN")}
                best = max((r for r in rows if r["config"] == name and r["tokens"] == n
                            and r["scale"] == scale and r["bytes_equal"]),
                           key=lambda r: float(r["gbps"]))  # type: ignore[arg-type]
                print(f"  default {default} warps={base.options.get('num_warps', 4)}; "
                      f"best {best}")
                del setup
                torch.cuda.empty_cache()
    rope_rows = [] if args.no_rope else _rope_sweep(dev, args.rope_variants, args.scales,
                                                    args.repeat, args.plain_variants)
    bad += sum(not r["bytes_equal"] for r in rope_rows)
    rows += rope_rows
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tune_writers.json").write_text(json.dumps(
        {"copy_gbps": copy_gbps, "device": torch.cuda.get_device_name(dev), "rows": rows},
        indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
