import sys, torch
sys.path.insert(0, "benchmarks")
from bench_mla_decode import Step, _time
from vllm.attention.ops import triton_mla_decode as tmd
import old_gluon_kernels as old

new_k = tmd._gluon_kernel
for heads, cdt in [(128, "auto"), (16, "auto"), (128, "fp8")]:
    step = Step("TRITON_MLA", heads, cdt, 64, 4096, torch.device("cuda"))
    with step.active():
        res = {}
        for name in ["new", "old", "new2", "old2"]:
            tmd._gluon_kernel = new_k if name.startswith("new") else (lambda: old.mla_decode_gluon_kernel)
            fn = step.kernel("default")
            err = step.check() if name in ("new", "old") else float("nan")
            res[name] = (_time(fn, torch.device("cuda"), 200), err)
        tmd._gluon_kernel = new_k
        layer = _time(step.layer_call, torch.device("cuda"), 200)
    print(heads, cdt, " ".join(f"{k}={v[0]:.1f}us(err {v[1]:.1e})" for k, v in res.items()), f"layer={layer:.1f}", flush=True)
