"""Timing helpers shared by the speed benchmarks (bench_launch, bench_fused_rope,
bench_protocol_tax). Every result is reported next to a baseline measured in the same
run, so ratios do not depend on the machine's clocks."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def device_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"device": "cpu", "torch": torch.__version__,
                            "python": platform.python_version(), "triton": None}
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
        info["capability"] = list(torch.cuda.get_device_capability(device))
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # no triton: reported as None
        pass
    return info


def cuda_or_skip(script: str, needs: str) -> torch.device | None:
    """The CUDA device, or None once ``script`` has printed why it has nothing to do
    without one (``needs``: what it times there)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    print(f"{script} needs CUDA ({needs}); nothing to do")
    return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_us(fn: Callable[[], object], device: torch.device, *, calls: int = 1000,
            rounds: int = 5, warmup: int = 50) -> dict[str, float]:
    """Host time per call: ``calls`` back-to-back calls then one synchronize, median of
    ``rounds``. ``loop_us``: the loop alone; ``with_sync_us``: including the final wait."""
    for _ in range(warmup):
        fn()
    sync(device)
    loops, totals = [], []
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        sync(device)
        t2 = time.perf_counter()
        loops.append((t1 - t0) / calls * 1e6)
        totals.append((t2 - t0) / calls * 1e6)
    return {"loop_us": statistics.median(loops), "with_sync_us": statistics.median(totals)}


def timing_event() -> Any:
    """A CUDA event that records time (torch's stubs leave ``torch.cuda.Event``
    untyped)."""
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def gpu_sleep(cycles: int) -> None:
    """``torch.cuda._sleep`` (untyped in torch's stubs): the GPU spins ``cycles``."""
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]


def event_us(fn: Callable[[], object], *, iters: int = 100, warmup: int = 10,
             rounds: int = 3, device: torch.device | None = None) -> float:
    """Device time per call of ``fn`` (CUDA events around ``iters`` calls), median of
    ``rounds``; on a CPU ``device``, wall time (the benchmarks' smoke configuration)."""
    for _ in range(warmup):
        fn()
    out = []
    if device is not None and device.type != "cuda":
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append((time.perf_counter() - t0) / iters * 1e6)
        return statistics.median(out)
    torch.cuda.synchronize()
    for _ in range(rounds):
        start = timing_event()
        end = timing_event()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / iters * 1e3)
    return statistics.median(out)


@functools.cache
def _sleep_cycles_per_us(device_index: int) -> float:
    """Cycles of ``torch.cuda._sleep`` per microsecond on this device (timed once)."""
    cycles = 2_000_000
    gpu_sleep(cycles)  # warm-up
    start = timing_event()
    end = timing_event()
    start.record()
    gpu_sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / max(float(start.elapsed_time(end)) * 1e3, 1.0)


def queued_us(fn: Callable[[], object], *, iters: int = 20, warmup: int = 3,
              rounds: int = 3, device: torch.device) -> tuple[float, float]:
    """``(device us, host us)`` per call of ``fn``: the device time of ``iters``
    back-to-back calls between CUDA events with the stream's queue filled first (a GPU
    sleep longer than the host takes to enqueue them all, so the GPU never waits for
    the host: unlike :func:`event_us`, the host's latency for the first call and any
    host-bound stretch do not count), median of ``rounds``; and the host time per call
    (the enqueueing loop). On a CPU ``device``, wall time for both."""
    if device.type != "cuda":
        us = event_us(fn, iters=iters, warmup=warmup, rounds=rounds, device=device)
        return us, us
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    per_us = _sleep_cycles_per_us(device.index or 0)
    t0 = time.perf_counter()
    for _ in range(max(1, warmup)):
        fn()
    host = (time.perf_counter() - t0) / max(1, warmup) * 1e6
    dev_times, host_times = [], []
    for _ in range(rounds):
        torch.cuda.synchronize(device)
        start = timing_event()
        end = timing_event()
        budget_us = min(2e5, 2.0 * host * iters + 500.0)
        gpu_sleep(int(per_us * budget_us))
        start.record()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        host_times.append((time.perf_counter() - t0) / iters * 1e6)
        end.record()
        end.synchronize()
        dev_times.append(start.elapsed_time(end) / iters * 1e3)
        host = max(host, host_times[-1])
    return statistics.median(dev_times), statistics.median(host_times)


def kernel_us(fn: Callable[[], object], device: torch.device, *, calls: int = 5
              ) -> list[tuple[str, float]]:
    """Device time per call of each kernel ``fn`` launches (``torch.profiler`` over
    ``calls`` calls after one warm-up), longest first: where a path's time goes."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == getattr(torch.autograd, "DeviceType").CUDA:
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time
    return sorted(((name, us / calls) for name, us in totals.items()), key=lambda x: -x[1])


def capture(fn: Callable[[], object], *, reps: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``reps`` back-to-back calls of ``fn`` (warmed up on a side stream
    first: lazy compilation and launcher binding must not happen during capture)."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    torch.cuda.synchronize()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, *, replays: int = 200, rounds: int = 3) -> float:
    """Device time per replay (CUDA events around ``replays`` back-to-back replays)."""
    return event_us(graph.replay, iters=replays, warmup=5, rounds=rounds)


def alternating_replay_us(graphs: Mapping[Any, Sequence[torch.cuda.CUDAGraph]], *,
                          rounds: int = 6, replays: int = 50) -> dict[Any, list[list[float]]]:
    """A/B timing: ``rounds`` rounds in which every form's graphs take turns, each timed
    by :func:`replay_us` (``replays`` a time), so that a drift of the clocks or of the
    memory touches all forms alike. Per form, per graph, the rounds' times sorted."""
    times: dict[Any, list[list[float]]] = {k: [[] for _ in gs] for k, gs in graphs.items()}
    for _ in range(rounds):
        for k, gs in graphs.items():
            for i, g in enumerate(gs):
                times[k][i].append(replay_us(g, replays=replays))
    return {k: [sorted(x) for x in ts] for k, ts in times.items()}


def copy_ceiling_gbps(device: torch.device, gib: float = 2.0, iters: int = 10, *,
                      warmup: int = 2, rounds: int = 3) -> float:
    """GB/s (read + written) of an eager ``dst.copy_(src)`` of a ``gib`` GiB bf16 tensor
    (``copy_bytes(gib)`` bytes each way)."""
    each_way = copy_bytes(gib)
    us = copy_us(device, each_way, iters, warmup=warmup, rounds=rounds)
    return 2 * each_way / (us * 1e-6) / 1e9


def copy_us(device: torch.device, each_way: int, iters: int = 10, *, warmup: int = 2,
            rounds: int = 3) -> float:
    """Time per call of an eager ``dst.copy_(src)`` of a bf16 tensor of ``each_way``
    bytes (rounded down to whole elements, at least one), CUDA events around ``iters``
    back-to-back calls."""
    src = torch.empty(max(1, each_way // 2), dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    us = event_us(lambda: dst.copy_(src), iters=iters, warmup=warmup,  # noqa: F821
                  rounds=rounds, device=device)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return us


def copy_bytes(gib: float) -> int:
    """Bytes of the bf16 tensor :func:`copy_ceiling_gbps` copies for ``gib``."""
    return int(gib * 2**30) // 2 * 2


def fmt(x: object, spec: str = ".2f") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return "-" if not math.isfinite(x) else format(x, spec)
    return str(x)


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> None:
    """``columns``: ``(key, header, format spec)``."""
    widths = [max(len(h), *(len(fmt(r.get(k), s)) for r in rows)) if rows else len(h)
              for k, h, s in columns]
    print("  ".join(h.rjust(w) if i else h.ljust(w)
                    for i, ((_, h, _), w) in enumerate(zip(columns, widths))))
    for r in rows:
        print("  ".join(fmt(r.get(k), s).rjust(w) if i else fmt(r.get(k), s).ljust(w)
                        for i, ((k, _, s), w) in enumerate(zip(columns, widths))))


def write_json(out: Path, name: str, payload: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(payload, indent=1, default=str))
    print(f"wrote {path}")
    return path


@contextlib.contextmanager
def report_text() -> Iterator[io.StringIO]:
    """Collects what the block prints and prints it once the block ends, so that the
    same text can also be saved (:func:`write_report`)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        yield buf
    print(buf.getvalue(), end="")


def write_report(out: Path, stem: str, payload: dict[str, Any], text: str) -> None:
    """``out/stem.json`` (``payload``) and ``out/stem.txt`` (the printed report)."""
    write_json(out, f"{stem}.json", payload)
    (out / f"{stem}.txt").write_text(text)
