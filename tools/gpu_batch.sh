#!/usr/bin/env bash
# Every GPU check in one batch, on a CUDA machine. Phases (any order, several at once):
#   tests  - every gpu-marked test, one pytest process per area (a CUDA fault in one
#            area cannot poison the next), full logs
#   check  - `vllm-attn backends` and `vllm-attn check` on CUDA
#   bench  - every benchmarks/bench_*.py with --out (BENCHES picks scripts, BENCH_ARGS
#            adds options to each, BENCH_DIR names the results' subfolder)
#   vendor - the GPU tests named in VENDOR_TESTS (node ids), logged as
#            test_vendor_$VENDOR_NAME.txt: the vendor paths once their packages are there
# Vendor packages staged by ../shared/tools/stage-flash-attn-4 (/tmp/fa4site) or
# stage-wheels NAME (/tmp/NAME-site) are registered as site directories (their .pth files
# run), for this script and every Python process it starts.
# Results go to one folder named <date>-<commit> (UTC date, short commit of the checkout;
# "-modified" when tracked files differ from that commit; RESULTS_NAME overrides), with
# commit.txt and env.txt saying what ran where. The folder is tarred into
# $OUT/<date>-<commit>.tgz and a few summaries are copied beside it; unpack it under
# benchmarks/results/<device>/ to commit it (benchmarks/README.md).
# Usage (repository root): bash tools/gpu_batch.sh tests [check] [bench]
# Durations seen on an H200 (2026-11-30), warm Triton cache excluded: writers 45 s, ops 55 s,
# property (SWEEP=40) 100 s, mla 45 s, runner 150 s (the every-backend file), speed 25 s;
# backends over 220 s (about 265 tests); bench_writers + bench_launch + bench_fused_rope
# together 90 s. On a fresh machine (2026-12-01, cold caches): writers 73 s, speed 62 s,
# ops over 150 s (192 s with the Triton cache warm), mla over 150 s, runner 272 s; the
# flashinfer vendor tests 219 s (its JIT builds), bench_prefill with flex about 90 s.
# Under a time limit per invocation, split the areas over several invocations (AREAS=...).
set -u
what=" $* "
FINAL=${OUT:-/tmp/out}
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ "$commit" != unknown ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  commit=$commit-modified
fi
NAME=${RESULTS_NAME:-$(date -u +%F)-$commit}
LOGS=/tmp/gpu_batch/$NAME
mkdir -p "$LOGS" "$FINAL"
{ git rev-parse HEAD 2>/dev/null || echo "no git checkout"; git status --short --untracked-files=no 2>/dev/null; } > "$LOGS/commit.txt"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
purelib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
for d in /tmp/fa4site /tmp/*-site; do
  [ -d "$d" ] && echo "import site; site.addsitedir('$d')" > "$purelib/zz_staged_$(basename "$d").pth"
done
python3 - <<'PY' | tee "$LOGS/env.txt"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
try:
    import flash_attn.cute as fa
    print("flash_attn.cute importable", getattr(fa, "__version__", "?"))
except Exception as e:
    print("flash_attn.cute not importable:", type(e).__name__, e)
try:
    import flashinfer
    print("flashinfer importable", getattr(flashinfer, "__version__", "?"))
except Exception as e:
    print("flashinfer not importable:", type(e).__name__, e)
PY
run_tests() {  # name, timeout, paths...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -q -rfE -m gpu -p no:cacheprovider "$@" > "$LOGS/test_$name.txt" 2>&1
  echo "$name rc=$?" | tee -a "$LOGS/summary.txt"
  grep -E "passed|failed" "$LOGS/test_$name.txt" | tail -n 1 | tee -a "$LOGS/summary.txt"
  grep -E "^FAILED|^ERROR" "$LOGS/test_$name.txt" | head -n 8 | tee -a "$LOGS/summary.txt"
}
# AREAS picks the test areas of the tests phase (default: all, in this order)
areas=" ${AREAS:-writers ops property mla runner speed} "
if [[ "$what" == *" tests "* ]]; then
  [[ "$areas" == *" writers "* ]] && run_tests writers ${T_WRITERS:-120} tests/writers
  [[ "$areas" == *" ops "* ]] && run_tests ops ${T_OPS:-90} tests/ops
  [[ "$areas" == *" property "* ]] && VLLM_KV_GPU_SWEEP=${SWEEP:-60} run_tests property ${T_PROP:-150} tests/property tests/test_fp8_edges.py
  [[ "$areas" == *" mla "* ]] && run_tests mla ${T_MLA:-120} tests/mla
  [[ "$areas" == *" runner "* ]] && VLLM_GPU_REPORT_DIR=$LOGS run_tests runner ${T_RUNNER:-240} tests/runner
  [[ "$areas" == *" speed "* ]] && run_tests speed ${T_SPEED:-90} tests/speed
fi
if [[ "$what" == *" vendor "* ]]; then
  # shellcheck disable=SC2086
  run_tests "vendor_${VENDOR_NAME:-all}" ${T_VENDOR:-400} ${VENDOR_TESTS:?name the vendor tests}
fi
if [[ "$what" == *" backends "* ]]; then
  run_tests backends ${T_BACKENDS:-200} tests/backends
fi
if [[ "$what" == *" check "* ]]; then
  timeout 60 python3 -m vllm.cli backends --device cuda > "$LOGS/backends_cuda.txt" 2>&1
  timeout ${T_CHECK:-200} python3 -m vllm.cli check --device cuda > "$LOGS/check_cuda.txt" 2>&1
  echo "check rc=$?" | tee -a "$LOGS/summary.txt"; tail -n 25 "$LOGS/check_cuda.txt"
fi
if [[ "$what" == *" bench "* ]]; then
  bdir=$LOGS/${BENCH_DIR:-bench}
  mkdir -p "$bdir"
  for b in ${BENCHES:-benchmarks/bench_*.py}; do
    name=$(basename "$b" .py)
    # shellcheck disable=SC2086
    timeout ${T_BENCH:-90} python3 "$b" --out "$bdir" ${BENCH_ARGS:-} > "$bdir/$name.txt" 2>&1
    echo "$name rc=$?" | tee -a "$LOGS/summary.txt"; tail -n 12 "$bdir/$name.txt"
  done
fi
tar -czf "$FINAL/$NAME.tgz" -C "$(dirname "$LOGS")" "$NAME"
for f in summary env backends_cuda check_cuda gpu_every_backend; do [ -f "$LOGS/$f.txt" ] && cp "$LOGS/$f.txt" "$FINAL/"; done
cat "$LOGS/summary.txt" 2>/dev/null
