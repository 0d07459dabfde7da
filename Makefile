# scatter-add. Two commands do everything on a fresh Debian 12 machine:
#   make bench   the side-by-side benchmark (installs what it needs first)
#   make test    C++ tests on every ISA level, the hub package, pytest, and a quick bench
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BUILD := .build/release
JOBS ?= $(shell nproc)

.PHONY: all deps venv cpp test test-cpp test-python hub bench bench-quick bench-cpp cuda cuda-hub peers clean

all: cpp

deps:
	@scripts/install_deps.sh

# The virtual environment is rebuilt only when requirements.txt changes.
venv: $(VENV)/.installed
$(VENV)/.installed: requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip >/dev/null
	$(PY) -m pip install -q -r requirements.txt
	@touch $@

cpp: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release >/dev/null
	cmake --build $(BUILD) -j $(JOBS)

test-cpp: cpp
	ctest --test-dir $(BUILD) --output-on-failure

hub: deps venv
	$(PY) scripts/build_hub.py --jobs $(JOBS)

test-python: hub
	$(PY) -m pytest tests/python -q

test: test-cpp test-python bench-quick cuda cuda-hub

# CUDA: compile-only here (sm_80, sm_90); runs on a GPU machine via scripts/gpu_check.sh.
NVCC := $(shell command -v nvcc 2>/dev/null)
cuda: deps
ifeq ($(NVCC),)
	@echo "cuda: nvcc not found on this machine; the CUDA sources were NOT compiled"
else
	cmake -S . -B .build/cuda -DSCATTER_ADD_CUDA=ON -DSCATTER_ADD_TESTS=OFF -DSCATTER_ADD_BENCH=OFF >/dev/null
	cmake --build .build/cuda -j $(JOBS) --target scatter_add_cuda
endif

# The cu<ver> hub variant, built against pip's CUDA torch in its own venv (compile and link only).
CUDA_TORCH ?= torch==2.14.1
VENV_CUDA := .venv-cuda
$(VENV_CUDA)/.installed:
	@test -x $(VENV_CUDA)/bin/python || $(PYTHON) -m venv $(VENV_CUDA)
	$(VENV_CUDA)/bin/python -m pip install -q $(CUDA_TORCH)
	@touch $@
cuda-hub: deps
ifeq ($(NVCC),)
	@echo "cuda-hub: nvcc not found on this machine; the CUDA variant was NOT built"
else
	$(MAKE) $(VENV_CUDA)/.installed
	$(VENV_CUDA)/bin/python scripts/build_hub.py --cuda --jobs $(JOBS)
	$(VENV_CUDA)/bin/python -c "import torch, glob; torch.ops.load_library(glob.glob('build/*-cu*-*/*.abi3.so')[0]); print('cuda variant loads')"
endif

# torch_scatter has no PyPI wheels: this builds it from source into .venv (about 30 min on
# 2 cores). `make bench` includes it when it is installed and says so when it is not.
peers: venv
	$(PY) -m pip install --no-build-isolation torch-scatter==2.1.2

bench-cpp: cpp
	$(BUILD)/benchmarks/bench_scatter_add

bench: hub
	$(PY) benchmarks/bench_torch.py

bench-quick: hub
	$(PY) benchmarks/bench_torch.py --quick --out .build/bench-quick

clean:
	rm -rf .build build results
