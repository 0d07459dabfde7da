#!/usr/bin/env bash
# Everything the CUDA path needs checked, on a lent GPU machine (H200; its image has python3 with
# a CUDA torch, nvcc and cmake, no `kernels` package and no internet). Stages, in this order:
#   build     the cu<ver> hub variant against that torch (scripts/build_hub.py --cuda) and the
#             torch-free C++ example (examples/combine_cuda.cu)
#   test      pytest on CUDA tensors (test_cuda.py and the `cuda` cases of the shared tests), then
#             the C++ example
#   bench     benchmarks/bench_cuda.py: ours vs index_add_ (default and deterministic) and
#             torch.compile, GB/s against a copy ceiling measured in the same run
#   sanitize  every kernel variant under compute-sanitizer memcheck (Firecracker machines only)
# Results (logs, bench_cuda.json) go to $OUT (the device tool's folder) or results/gpu.
#   bash scripts/gpu_check.sh [bench options]                     # all stages
#   STAGES="build test" bash scripts/gpu_check.sh                 # one device call...
#   STAGES="bench sanitize" bash scripts/gpu_check.sh --quick     # ...and the next (build/ stays)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
STAGES=${STAGES:-build test bench sanitize}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
status=0
has() { [[ " $STAGES " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$OUT/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
# The image has no `kernels` package: the suite imports build/<variant> the way the loader does.
$PY -c "import kernels" 2>/dev/null || export SCATTER_ADD_DIRECT_IMPORT=1

if has build; then
  SECONDS=0
  $PY scripts/build_hub.py --cuda --jobs 16 2>&1 | tee "$OUT/build.log" | tail -n 3
  [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
  { cmake -S . -B .build/cuda-gpu -DSCATTER_ADD_CUDA=ON -DSCATTER_ADD_TESTS=OFF -DSCATTER_ADD_BENCH=OFF &&
    cmake --build .build/cuda-gpu -j 16 --target combine_cuda_example; } >> "$OUT/build.log" 2>&1 || exit 1
  echo "build: ${SECONDS}s"
fi

if has test; then
  SECONDS=0
  $PY -m pytest tests/python -q -k cuda -p no:cacheprovider 2>&1 | tee "$OUT/test.log" | tail -n 15
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  .build/cuda-gpu/combine_cuda_example 2>&1 | tee -a "$OUT/test.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  echo "test: ${SECONDS}s"
fi

if has bench; then
  SECONDS=0
  $PY benchmarks/bench_cuda.py "$@" --out "$OUT" > "$OUT/bench.log" 2>&1 || status=1
  tail -n 52 "$OUT/bench.log"
  echo "bench: ${SECONDS}s"
fi

# Out-of-bounds accesses (compute-sanitizer works on the Firecracker machines, not on gVisor
# ones: a refusal there is reported, not counted as a failure).
if has sanitize && command -v compute-sanitizer >/dev/null; then
  SECONDS=0
  timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 $PY scripts/cuda_memcheck.py > "$OUT/memcheck.log" 2>&1
  rc=$?
  echo "compute-sanitizer memcheck: exit $rc, ${SECONDS}s"
  tail -n 3 "$OUT/memcheck.log"
  [ $rc -eq 9 ] && status=1
fi
exit "$status"
