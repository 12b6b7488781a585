"""Where a FLEX_ATTENTION decode call's host time goes: the page_table decode of
``flex_decode_layouts.py`` (batch 64 x 4096 context, 32 q / 8 kv heads, D=128, bf16,
page 16), called back to back without synchronising.

Reported per call: the host time of the whole op; of its compiled ``flex_attention``
call and of its compiled tail merge (each timed around the compiled function: Dynamo's
frame and guards, Inductor's wrapper, the kernel launches); the rest (the op's own
Python and eager torch ops); the device time per call with the queue full; then
torch.profiler's host functions by self time.

    python benchmarks/flex_host_profile.py > DIR/flex_host_profile.txt
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tune_prefill  # noqa: E402
from _timing import cuda_or_skip, queued_us  # noqa: E402

from vllm.attention.ops import flex_paged  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--profiled", type=int, default=10)
    a = p.parse_args(argv)
    dev = cuda_or_skip("flex_host_profile.py", "it times Inductor's compiled calls")
    if dev is None:
        return 0
    q, kv, meta, scale = tune_prefill.flex_decode_case(dev)
    out = torch.empty_like(q)
    spent = {"flex": 0.0, "tail": 0.0}
    compiled_flex, compiled_tail = flex_paged._compiled_flex, flex_paged._compiled_tail_merge

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
        return call

    setattr(flex_paged, "_compiled_flex", lambda: timed("flex", compiled_flex()))
    setattr(flex_paged, "_compiled_tail_merge", lambda: timed("tail", compiled_tail()))

    def run() -> object:
        return flex_paged.flex_paged_attention(q, kv, meta, scale=scale, output=out,
                                               mode="page_table", compiled=True)

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    run_ = flex_paged.last_run
    print(f"ran: {run_}")
    spent.update(flex=0.0, tail=0.0)
    t0 = time.perf_counter()
    for _ in range(a.calls):
        run()
    host = (time.perf_counter() - t0) / a.calls * 1e6
    torch.cuda.synchronize()
    flex_us = spent["flex"] / a.calls * 1e6
    tail_us = spent["tail"] / a.calls * 1e6
    device_us, _ = queued_us(run, iters=20, warmup=2, rounds=3, device=dev)
    print(f"host per call {host:.1f} us: compiled flex call {flex_us:.1f}, compiled tail "
          f"merge {tail_us:.1f}, the rest {host - flex_us - tail_us:.1f}; device per call "
          f"(queue full) {device_us:.1f} us")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(a.profiled):
            run()
        torch.cuda.synchronize()
    print(f"torch.profiler, {a.profiled} calls (times are totals over them):")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
