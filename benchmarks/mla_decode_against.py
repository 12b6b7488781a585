"""The sm_90 Gluon MLA decode against its own kernel at another commit (or in another
file), in one process:
the decode alone through ``mla_decode_mma`` (batch 64, 4096 tokens of context,
DeepSeek-V3's 576-wide rows, replayed from CUDA graphs) at 128 heads (bf16 cache), 16
heads (bf16) and 128 heads (fp8, E4M3), each kernel timed twice, interleaved, so that
drift within the run shows; the relative error of the first timing of each against
float64; and the whole ``MLAAttention`` step with this tree's kernel.

The other commit's kernel module (``--kernel lead``, the default:
``gluon_mla_lead_kernels.py``; ``--kernel split``: ``gluon_mla_decode_kernels.py``, the
split-scores kernel) is read with ``git show`` and imported under another name; it must
take the launcher's arguments of this tree. ``--file PATH`` imports that module from a
file instead (a variant being measured).

    python benchmarks/mla_decode_against.py a61a0e0 --kernel split > DIR/mla_decode_cmp.txt
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
# --kernel: (module file, kernel name, the launcher's hook that returns it)
KERNELS = {
    "lead": ("vllm/attention/ops/gluon_mla_lead_kernels.py", "mla_decode_lead_kernel",
             "_lead_kernel"),
    "split": ("vllm/attention/ops/gluon_mla_decode_kernels.py", "mla_decode_gluon_kernel",
              "_gluon_kernel"),
}
CASES = [(128, "auto"), (16, "auto"), (128, "fp8")]


def kernel_from(text: str, name: str, into: Path) -> Any:
    """Kernel ``name`` of the module source ``text``, imported from a copy under ``into``
    (Gluon reads a kernel's source from its file)."""
    path = into / "gluon_mla_kernels_then.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("commit", nargs="?", default=None,
                   help="the commit whose kernel to time beside this tree's")
    p.add_argument("--kernel", choices=sorted(KERNELS), default="lead")
    p.add_argument("--file", type=Path, default=None,
                   help="the kernel module to time beside this tree's, instead of a commit's")
    p.add_argument("--cases", nargs="+", default=None, metavar="HEADS:CACHE",
                   help="e.g. 128:fp8 (default: 128:auto 16:auto 128:fp8)")
    p.add_argument("--replays", type=int, default=200)
    a = p.parse_args(argv)
    if (a.commit is None) == (a.file is None):
        p.error("name a commit or --file, not both")
    dev = cuda_or_skip("mla_decode_against.py", "the Gluon kernel runs on sm_90")
    if dev is None:
        return 0
    module_path, name, hook = KERNELS[a.kernel]
    cases = CASES if a.cases is None else [
        (int(c.split(":")[0]), c.split(":")[1]) for c in a.cases]
    ours: Callable[[], Any] = getattr(tmd, hook)
    if a.file is not None:
        text = a.file.read_text()
    else:
        text = subprocess.run(["git", "show", f"{a.commit}:{module_path}"], cwd=ROOT,
                              check=True, capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        theirs = kernel_from(text, name, Path(tmp))
        for heads, cache_dtype in cases:
            step = Step("TRITON_MLA", heads, cache_dtype, 64, 4096, dev)
            with step.active():
                res: dict[str, tuple[float, float]] = {}
                for name in ("new", "old", "new2", "old2"):
                    kernel = ours() if name.startswith("new") else theirs
                    setattr(tmd, hook, lambda kernel=kernel: kernel)
                    fn = step.kernel("default")
                    err = step.check() if name in ("new", "old") else float("nan")
                    res[name] = (_time(fn, dev, a.replays), err)
                setattr(tmd, hook, ours)
                layer = _time(step.layer_call, dev, a.replays)
            print(heads, cache_dtype,
                  " ".join(f"{k}={us:.1f}us(err {e:.1e})" for k, (us, e) in res.items()),
                  f"layer={layer:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
