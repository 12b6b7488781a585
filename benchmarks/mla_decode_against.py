"""The sm_90 Gluon MLA decode against its own kernel at another commit, in one process:
the decode alone through ``mla_decode_mma`` (batch 64, 4096 tokens of context,
DeepSeek-V3's 576-wide rows, replayed from CUDA graphs) at 128 heads (bf16 cache), 16
heads (bf16) and 128 heads (fp8, E4M3), each kernel timed twice, interleaved, so that
drift within the run shows; the relative error of the first timing of each against
float64; and the whole ``MLAAttention`` step with this tree's kernel.

The other commit's ``gluon_mla_decode_kernels.py`` is read with ``git show`` and
imported under another name; it must take the launcher's arguments of this tree.

    python benchmarks/mla_decode_against.py a61a0e0 > DIR/mla_decode_cmp.txt
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import cuda_or_skip  # noqa: E402
from bench_mla_decode import Step, _time  # noqa: E402

from vllm.attention.ops import triton_mla_decode as tmd  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KERNELS = "vllm/attention/ops/gluon_mla_decode_kernels.py"
CASES = [(128, "auto"), (16, "auto"), (128, "fp8")]


def kernel_at(commit: str, into: Path) -> Any:
    """The Gluon decode kernel of ``commit``, imported from a copy under ``into`` (Gluon
    reads a kernel's source from its file)."""
    text = subprocess.run(["git", "show", f"{commit}:{KERNELS}"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    path = into / "gluon_mla_decode_kernels_then.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.mla_decode_gluon_kernel


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("commit", help="the commit whose kernel to time beside this tree's")
    p.add_argument("--replays", type=int, default=200)
    a = p.parse_args(argv)
    dev = cuda_or_skip("mla_decode_against.py", "the Gluon kernel runs on sm_90")
    if dev is None:
        return 0
    ours: Callable[[], Any] = tmd._gluon_kernel
    with tempfile.TemporaryDirectory() as tmp:
        theirs = kernel_at(a.commit, Path(tmp))
        for heads, cache_dtype in CASES:
            step = Step("TRITON_MLA", heads, cache_dtype, 64, 4096, dev)
            with step.active():
                res: dict[str, tuple[float, float]] = {}
                for name in ("new", "old", "new2", "old2"):
                    kernel = ours() if name.startswith("new") else theirs
                    setattr(tmd, "_gluon_kernel", lambda kernel=kernel: kernel)
                    fn = step.kernel("default")
                    err = step.check() if name in ("new", "old") else float("nan")
                    res[name] = (_time(fn, dev, a.replays), err)
                setattr(tmd, "_gluon_kernel", ours)
                layer = _time(step.layer_call, dev, a.replays)
            print(heads, cache_dtype,
                  " ".join(f"{k}={us:.1f}us(err {e:.1e})" for k, (us, e) in res.items()),
                  f"layer={layer:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
