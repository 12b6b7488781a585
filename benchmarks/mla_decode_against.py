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

The results folders' A/B scripts import its helpers: :func:`module_text` (a kernel
module at a commit or in a file), :func:`with_constant` (a module-level compile-time
constant set to another value), :func:`kernel_from`, and :func:`compare_in_layer`
(kernel forms swapped into the layer in turn, layer and decode replayed from CUDA
graphs in alternating rounds).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _timing import alternating_replay_us, capture, cuda_or_skip, kernel_us  # noqa: E402
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


def module_text(ref: str, module_path: str = KERNELS["lead"][0]) -> str:
    """The source of ``module_path`` at commit ``ref`` (``git show``), or of the file
    ``ref`` where one exists."""
    if Path(ref).is_file():
        return Path(ref).read_text()
    return subprocess.run(["git", "show", f"{ref}:{module_path}"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout


def with_constant(text: str, name: str, value: int) -> str:
    """Module source ``text`` with its ``NAME: gl.constexpr = gl.constexpr(N)`` line set
    to ``value`` (an error unless exactly one such line)."""
    out, n = re.subn(rf"^{name}: gl.constexpr = gl.constexpr\(\d+\)",
                     f"{name}: gl.constexpr = gl.constexpr({value})", text, flags=re.M)
    if n != 1:
        raise ValueError(f"{name}: {n} definitions, expected one")
    return out


def kernel_from(text: str, name: str, into: Path, stem: str = "gluon_mla_kernels_then") -> Any:
    """Kernel ``name`` of the module source ``text``, imported from a copy ``stem``.py
    under ``into`` (Gluon reads a kernel's source from its file: one stem a copy)."""
    path = into / f"{stem}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def compare_in_layer(forms: Mapping[str, Mapping[str, Any]], out_name: str, *,
                     heads: int = 128, batch: int = 64, context: int = 4096,
                     hook: str = "_lead_kernel") -> dict[str, Any]:
    """For each cache dtype of ``forms`` (cache dtype -> form name -> kernel), one
    ``Step``; each form's kernel returned by the launcher's ``hook`` in turn, its error
    against float64 checked, the layer and the decode alone captured in CUDA graphs;
    then six rounds of 50 replays alternating between the forms
    (:func:`~_timing.alternating_replay_us`), and each form's three longest kernels in
    the layer (``torch.profiler``, ten replays). Prints every figure and writes them to
    ``$OUT/out_name`` (JSON; keys ``<cache>_<form>_err`` and ``<cache>_<form>``)."""
    dev = torch.device("cuda")
    ours = getattr(tmd, hook)
    state: dict[str, Any] = {}
    setattr(tmd, hook, lambda: state["k"])
    res: dict[str, Any] = {}
    try:
        for cdt, kernels in forms.items():
            step = Step("TRITON_MLA", heads, cdt, batch, context, dev)
            keep, graphs = [], {}
            with step.active():
                for name, k in kernels.items():
                    state["k"] = k
                    dec = step.parts()["decode"]
                    keep.append(dec)
                    dec()
                    step.layer_call()
                    torch.cuda.synchronize()
                    err = step.check()
                    graphs[name] = (capture(step.layer_call), capture(dec))
                    print(cdt, name, "err", err, step.kernel_path(), flush=True)
                    res[f"{cdt}_{name}_err"] = err
                times = alternating_replay_us(graphs)
                for name in kernels:
                    lay, d = times[name]
                    print(cdt, name, "layer", [round(x, 1) for x in lay],
                          "decode", [round(x, 1) for x in d], flush=True)
                    res[f"{cdt}_{name}"] = {"layer": lay, "decode": d}
                for name in kernels:
                    ks = kernel_us(graphs[name][0].replay, dev, calls=10)
                    print(cdt, name, "layer kernels",
                          [(n[:28], round(u, 1)) for n, u in ks[:3]], flush=True)
            del step, keep, graphs
            torch.cuda.empty_cache()
    finally:
        setattr(tmd, hook, ours)
    with open(os.path.join(os.environ.get("OUT", "."), out_name), "w") as f:
        json.dump(res, f, indent=1)
    return res


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
    text = a.file.read_text() if a.file is not None else module_text(a.commit, module_path)
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
