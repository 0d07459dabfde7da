#!/usr/bin/env bash
# Everything the CUDA path needs checked, on a machine with an NVIDIA GPU, python3 with a CUDA
# build of torch, nvcc and cmake (no `kernels` package and no internet access needed). Stages, in
# this order:
#   build     the cu<ver> hub variant against that torch (scripts/build_hub.py --cuda) and the
#             torch-free C++ example (examples/combine_cuda.cu)
#   test      pytest on CUDA tensors (test_cuda.py and the `cuda` cases of the shared tests), then
#             the C++ example
#   bench     benchmarks/bench_cuda.py: ours in the default check mode (no wait) and in sync mode
#             (waits for the stream once per call), vs index_add_ (default and deterministic) and
#             torch.compile, GB/s against a copy ceiling measured in the same run
#   sanitize  every kernel variant under compute-sanitizer memcheck and initcheck
#             (scripts/cuda_memcheck.py)
# Results (logs, bench_cuda.json) go to $OUT if set, else results/gpu. Each stage prints its time;
# split the stages over several runs if one run must stay short (build/ and .build/ are reused):
#   bash scripts/gpu_check.sh [bench options]                     # all stages
#   STAGES="build test" bash scripts/gpu_check.sh
#   STAGES="bench sanitize" bash scripts/gpu_check.sh --quick
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
# Without the `kernels` package the suite imports build/<variant> the way the loader does.
$PY -c "import kernels" 2>/dev/null || export SCATTER_ADD_DIRECT_IMPORT=1

if has build; then
  SECONDS=0
  $PY scripts/build_hub.py --cuda --jobs "$(nproc)" 2>&1 | tee "$OUT/build.log" | tail -n 3
  [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
  { cmake -S . -B .build/cuda-gpu -DSCATTER_ADD_CUDA=ON -DSCATTER_ADD_TESTS=OFF -DSCATTER_ADD_BENCH=OFF &&
    cmake --build .build/cuda-gpu -j "$(nproc)" --target combine_cuda_example; } >> "$OUT/build.log" 2>&1 || exit 1
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
  # The summary table: ours (default, no wait) and ours in sync mode side by side.
  sed -n '/^summary/,$p' "$OUT/bench.log"
  echo "bench: ${SECONDS}s"
fi

# compute-sanitizer needs a machine whose driver lets it attach (some sandboxed or virtualised
# machines refuse it). A refusal that says "Device not supported" is reported, not counted as a
# failure; any other nonzero exit (an error it finds, or error 999 at the first allocation) is.
if has sanitize; then
  if command -v compute-sanitizer >/dev/null; then
    for tool in memcheck initcheck; do
      SECONDS=0
      timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 9 $PY scripts/cuda_memcheck.py \
        > "$OUT/$tool.log" 2>&1
      rc=$?
      echo "compute-sanitizer $tool: exit $rc, ${SECONDS}s"
      tail -n 3 "$OUT/$tool.log"
      if [ $rc -ne 0 ]; then
        if [ $rc -ne 9 ] && grep -q "Device not supported" "$OUT/$tool.log"; then
          echo "compute-sanitizer $tool: refused by this machine's driver (not counted as a failure)"
        else
          status=1
        fi
      fi
    done
  else
    echo "sanitize: compute-sanitizer is not on PATH; skipped"
  fi
fi
exit "$status"
