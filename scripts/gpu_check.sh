#!/usr/bin/env bash
# Everything the CUDA path needs checked, in one go, on a lent GPU machine (H200; its image has
# python3 with a CUDA torch, nvcc and cmake, and no internet):
#   1. builds the cu<ver> hub variant against that torch (scripts/build_hub.py --cuda)
#   2. runs the Python suite with CUDA tensors (the `device` fixture adds "cuda")
#   3. benchmarks ours vs torch index_add_ (default and deterministic) and torch.compile
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
# Hub-loading, distributed (gloo/CPU) and huge-CPU-tensor tests are CPU checks run by `make test`.
$PY -m pytest tests/python -q -x -k "not hub_loading and not distributed and not huge" 2>&1 | tee "$OUT/pytest.log" | tail -n 5
status=${PIPESTATUS[0]}
$PY benchmarks/bench_cuda.py "$@" --out "$OUT" 2>&1 | tee "$OUT/bench.log"
exit "$status"
