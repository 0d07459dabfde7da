#!/usr/bin/env bash
# Everything the CUDA path needs checked, in one go, on a lent GPU machine (H200; its image has
# python3 with a CUDA torch, nvcc and cmake, and no internet):
#   1. builds the cu<ver> hub variant against that torch (scripts/build_hub.py --cuda)
#   2. runs the Python tests on CUDA tensors (test_cuda.py and the `device` fixture's "cuda")
#   3. builds and runs the C++ CUDA example; every kernel variant under compute-sanitizer
#      (memcheck, racecheck)
#   4. benchmarks ours vs torch index_add_ (default and deterministic) and torch.compile
# Results (logs, bench_cuda.json) go to $OUT (the device tool's folder) or results/gpu.
#   bash scripts/gpu_check.sh [--quick]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
$PY scripts/build_hub.py --cuda 2>&1 | tee "$OUT/build.log" | tail -n 3 || exit 1
# The image has no `kernels` package: the suite imports build/<variant> the way the loader does.
$PY -c "import kernels" 2>/dev/null || export SCATTER_ADD_DIRECT_IMPORT=1
# The tests that touch CUDA tensors (tests/python/test_cuda.py and the `cuda` cases of the shared
# ones); the CPU suite is what `make test` runs everywhere.
$PY -m pytest tests/python -q -k cuda -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -n 15
status=${PIPESTATUS[0]}
# The torch-free C++ CUDA API (examples/combine_cuda.cu), built with CMake here.
{ cmake -S . -B .build/cuda-gpu -DSCATTER_ADD_CUDA=ON -DSCATTER_ADD_TESTS=OFF -DSCATTER_ADD_BENCH=OFF >/dev/null &&
  cmake --build .build/cuda-gpu -j 16 --target combine_cuda_example >/dev/null && .build/cuda-gpu/combine_cuda_example; } 2>&1 | tee -a "$OUT/pytest.log" | tail -n 4
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# Out-of-bounds accesses and races in every kernel variant (compute-sanitizer works on the
# Firecracker machines, not on gVisor ones: a refusal there is reported, not fatal).
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 $PY scripts/cuda_memcheck.py > "$OUT/sanitizer-$tool.log" 2>&1
    rc=$?
    echo "compute-sanitizer $tool: exit $rc ($(grep -c 'ERROR SUMMARY: 0 errors' "$OUT/sanitizer-$tool.log") clean summaries)"
    tail -n 3 "$OUT/sanitizer-$tool.log"
    [ $rc -eq 9 ] && status=1
  done
fi
$PY benchmarks/bench_cuda.py "$@" --out "$OUT" 2>&1 | tee "$OUT/bench.log"
exit "$status"
