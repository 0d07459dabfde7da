# scatter-add. Two commands do everything on a fresh Debian 12 machine:
#   make bench   the side-by-side benchmark (installs what it needs first)
#   make test    C++ tests on every ISA level this CPU runs, the hub package, pytest, and a quick bench
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VENV_CUDA := .venv-cuda
PY := $(VENV)/bin/python
BUILD := .build/release
JOBS ?= $(shell nproc)
# Quiet recursive builds: CMake's own progress lines, no "Entering/Leaving directory" lines.
MAKEFLAGS += --no-print-directory

.PHONY: all deps venv cpp hub-no-python-h test test-cpp test-consumer test-python test-sanitizers hub bench bench-quick bench-cpp cuda cuda-hub peers fuzz fuzz-build clean
.PHONY: test-python-venv-cuda compat test-serial clang-levels test-fuzz-corpus

all: cpp

deps:
	@scripts/install_deps.sh

# The virtual environment is rebuilt only when requirements.txt changes. pip compiles every
# module's bytecode as it installs (35 of its 56 s here): without that, where Python writes no
# bytecode (PYTHONDONTWRITEBYTECODE), each of the suite's many processes compiled what it imports
# again (`import torch, transformers` 5-6 s instead of 3 s).
venv: $(VENV)/.installed
$(VENV)/.installed: requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip >/dev/null
	@echo "Installing requirements.txt into $(VENV) (once). The largest download is torch 2.13.0: about 190 MB as a CPU wheel, several GB as PyPI's default Linux wheel with its nvidia-* packages. pip shows each file's size and progress."
	$(PY) -m pip install -r requirements.txt
	@touch $@

# Under a lock that tests/python/test_readme.py also takes to run the README's build commands,
# which build the same directory (make test runs the two in different lanes).
RELEASE_LOCK := .build/release.lock
cpp: deps
	@mkdir -p .build
	flock $(RELEASE_LOCK) cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release >/dev/null
	flock $(RELEASE_LOCK) cmake --build $(BUILD) -j $(JOBS)

test-cpp: cpp
	ctest --test-dir $(BUILD) --output-on-failure

# The library as another CMake project uses it: installed to a temporary prefix and found with
# find_package, through add_subdirectory and FetchContent (GTest made unfindable), and by hand with
# pkg-config. tests/cmake_consumer/main.cpp must print tests/cmake_consumer/expected.txt each way.
test-consumer: cpp
	@scripts/install_deps.sh pkg-config
	JOBS=$(JOBS) tests/cmake_consumer/run.sh $(BUILD)

# build/torch-stable-abi<XY>-cpu-<arch>-linux: built on torch's stable ABI, it loads on every torch
# from the version build.toml names on (tests/python/test_stable_abi.py checks the binary).
hub: deps venv
	$(PY) scripts/build_hub.py --jobs $(JOBS)

test-python: hub
	$(PY) -m pytest tests/python -q -rs

# Two lanes side by side (scripts/lanes.sh; each line of output is prefixed [cpp] or [python]),
# after every Debian package either needs is installed (apt-get must not run twice at once), in
# two rounds: the second round's targets use both virtual environments and the hub package, which
# the first round's Python lane makes (a target that made them in the other lane would race it).
# The fuzz build runs in the Python lane, which would otherwise wait for the C++ lane's sanitizer
# suites (a clean clone on 2 cores: that lane 886 s, the Python lane's pytest and CUDA venv 460).
TEST_CPP_1 = test-cpp test-consumer test-sanitizers
TEST_PY_1 = test-python $(VENV_CUDA)/.installed test-fuzz-corpus
TEST_CPP_2 = cuda clang-levels
TEST_PY_2 = test-python-venv-cuda bench-quick hub-no-python-h cuda-hub
test:
	@scripts/check_disk.sh
	@scripts/install_deps.sh pkg-config $(SAN_DEPS)
	@scripts/lanes.sh cpp '$(MAKE) $(TEST_CPP_1)' python '$(MAKE) $(TEST_PY_1)'
	@scripts/lanes.sh cpp '$(MAKE) $(TEST_CPP_2)' python '$(MAKE) $(TEST_PY_2)'

# The same one after another (one stream of output).
test-serial: $(TEST_CPP_1) $(TEST_PY_1) $(TEST_CPP_2) $(TEST_PY_2)

# Sanitizers (clang's runtimes from Debian): the whole C++ suite under ASan + UBSan, the threaded
# path (std::thread backend, which TSan can see into) under TSan; test-fuzz-corpus replays the fuzz
# corpus (ASan + UBSan + libFuzzer).
SAN_DEPS := clang libclang-rt-14-dev libomp-14-dev
# Sanitizer builds at -O1 with line tables only (all a sanitizer's report needs for file and line):
# the ASan+UBSan build of the C++ suite took 92 s at -O2 -g and takes 76 s so, its tests as long.
SAN_OPT := -O1 -gline-tables-only -DNDEBUG
# These builds (and the CUDA ones below) run on this machine only, so they compile the CPU kernels
# up to the level it runs (scripts/native_isa.sh; CMake's SCATTER_ADD_MAX_ISA): on a CPU without
# AVX-512 the two AVX-512 levels, about half of each build's compile time, would never run.
NATIVE_ISA := $(shell scripts/native_isa.sh)
HERE_ONLY := -DSCATTER_ADD_MAX_ISA=$(NATIVE_ISA)
TSAN_TESTS := Determinism.*:ThreadSafety.*:IndexAdd.MatchesFloat64*:Gather.*
test-sanitizers:
	@scripts/install_deps.sh $(SAN_DEPS)
	cmake -S . -B .build/asan $(HERE_ONLY) -DCMAKE_CXX_COMPILER=clang++ -DSCATTER_ADD_SANITIZE="address;undefined" -DSCATTER_ADD_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$(SAN_OPT)" >/dev/null
	cmake --build .build/asan -j $(JOBS) --target scatter_add_tests combine_example
	ctest --test-dir .build/asan --output-on-failure
	cmake -S . -B .build/tsan $(HERE_ONLY) -DCMAKE_CXX_COMPILER=clang++ -DSCATTER_ADD_SANITIZE=thread -DSCATTER_ADD_OPENMP=OFF -DSCATTER_ADD_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$(SAN_OPT)" >/dev/null
	cmake --build .build/tsan -j $(JOBS) --target scatter_add_tests
	.build/tsan/tests/cpp/scatter_add_tests --gtest_filter='$(TSAN_TESTS)'

test-fuzz-corpus: fuzz-build
	set -o pipefail; .build/fuzz/fuzz_scatter_add -runs=0 tests/fuzz/corpus 2>&1 | tail -n 2

# The kernel levels above this CPU's, which the clang builds above leave out, checked by clang
# once (-fsyntax-only: every template instantiated and checked, no code generated), as the
# release build compiles them with gcc (the avx512_bf16 level with its AMX kernel).
clang-levels:
	@scripts/install_deps.sh $(SAN_DEPS)
	for bf16 in 0 1; do \
	  clang++ -std=c++17 -fsyntax-only -Wall -Wextra -Iinclude -Icsrc/cpu -mavx512f -mavx512bw -mavx512vl -mavx512dq \
	    -mfma -mf16c -mpopcnt $$([ $$bf16 = 1 ] && echo -mavx512bf16 -mamx-tile -mamx-bf16 -DSCATTER_ADD_AMX=1) \
	    -DSCATTER_ADD_AVX512_BF16=$$bf16 \
	    csrc/cpu/kernels_avx512.cpp || exit 1; \
	done

# libFuzzer over the core for FUZZ_SECONDS; new interesting inputs are merged into the corpus.
FUZZ_SECONDS ?= 60
fuzz-build:
	@scripts/install_deps.sh $(SAN_DEPS)
	cmake -S . -B .build/fuzz $(HERE_ONLY) -DCMAKE_CXX_COMPILER=clang++ -DSCATTER_ADD_FUZZ=ON -DSCATTER_ADD_OPENMP=OFF -DSCATTER_ADD_TESTS=OFF -DSCATTER_ADD_BENCH=OFF >/dev/null
	cmake --build .build/fuzz -j $(JOBS) --target fuzz_scatter_add
fuzz: fuzz-build
	@rm -rf .build/fuzz/new && mkdir -p .build/fuzz/new
	.build/fuzz/fuzz_scatter_add -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 .build/fuzz/new tests/fuzz/corpus
	.build/fuzz/fuzz_scatter_add -merge=1 tests/fuzz/corpus .build/fuzz/new 2>&1 | tail -n 1

# CUDA: compiled for sm_80 and sm_90 (a ptxas spill fails the build); the kernels' per-task code
# and the C API's argument checks run on the CPU against the core (tests/cuda/host_sim.cu, also
# under ASan+UBSan, with line tables only and the CUDA host code at -O1: 134 s to build, against
# 196 s at -O2 -g; the core stays at -O2, where gcc's -O1 warns inside the AVX-512 headers); on a
# GPU machine, scripts/gpu_check.sh.
NVCC := $(shell command -v nvcc 2>/dev/null)
cuda: deps
ifeq ($(NVCC),)
	@echo "cuda: nvcc not found on this machine; the CUDA sources were NOT compiled"
else
	cmake -S . -B .build/cuda $(HERE_ONLY) -DSCATTER_ADD_CUDA=ON -DSCATTER_ADD_CUDA_WERROR=ON -DSCATTER_ADD_TESTS=OFF -DSCATTER_ADD_BENCH=OFF >/dev/null
	cmake --build .build/cuda -j $(JOBS) --target scatter_add_cuda combine_cuda_example cuda_host_sim
	@readelf -d .build/cuda/combine_cuda_example | grep -q 'NEEDED.*libcudart\.so' || \
	  { echo "cuda: combine_cuda_example does not link the shared CUDA runtime"; exit 1; }
	.build/cuda/cuda_host_sim
	cmake -S . -B .build/cuda-asan $(HERE_ONLY) -DSCATTER_ADD_CUDA=ON -DSCATTER_ADD_CUDA_ARCHS=90 -DSCATTER_ADD_SANITIZE="address;undefined" -DSCATTER_ADD_TESTS=OFF -DSCATTER_ADD_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" -DCMAKE_CUDA_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" >/dev/null
	cmake --build .build/cuda-asan -j $(JOBS) --target cuda_host_sim
	.build/cuda-asan/cuda_host_sim --quick
endif

# A second torch, pip's CUDA build (no GPU needed), in its own venv with the test requirements:
# the hub variants are loaded and tested on it too. Nothing here runs a GPU kernel, so two parts of
# its 5.8 GB are left out (4.0 GB remain): triton (0.9 GB, it compiles GPU kernels; torch imports
# without it, and pip ends by saying torch requires it) and cuDNN's engine libraries (0.8 GB,
# which libcudnn.so.9, the one library torch links, loads for cuDNN's work on a GPU; its graph
# library stays, since the host-only cudnnGetVersion, torch.backends.cudnn.version(), loads it
# and aborts the process without it). So this venv is for this machine's tests, not for a GPU
# (no triton: torch.compile of CUDA code would fail). pip keeps no cache of these downloads.
CUDA_TORCH ?= torch==2.14.1
CUDNN_LAZY_LIBS := adv cnn engines_precompiled engines_runtime_compiled engines_tensor_ir ext heuristic ops
$(VENV_CUDA)/.installed: requirements.txt
	@test -x $(VENV_CUDA)/bin/python || $(PYTHON) -m venv $(VENV_CUDA)
	grep -vE '^(torch|matplotlib)==' requirements.txt > $(VENV_CUDA)/requirements-test.txt
	@echo "Installing $(CUDA_TORCH) (CUDA 13.0) and the test requirements into $(VENV_CUDA) (once): torch and its nvidia-* packages are about 2.5 GB to download, 4.0 GB on disk. pip shows each file's size and progress."
	$(VENV_CUDA)/bin/python -m pip install --no-cache-dir --no-deps $(CUDA_TORCH)
	$(VENV_CUDA)/bin/python -c 'import importlib.metadata as m; print("\n".join(r for r in m.requires("torch") if not r.startswith("triton") and "extra ==" not in r))' > $(VENV_CUDA)/requirements-torch.txt
	$(VENV_CUDA)/bin/python -m pip install --no-cache-dir -r $(VENV_CUDA)/requirements-torch.txt -r $(VENV_CUDA)/requirements-test.txt
	@echo "($(VENV_CUDA) leaves triton out on purpose: pip's note above that torch requires it is expected.)"
	rm -f $(patsubst %,$(VENV_CUDA)/lib/python3*/site-packages/nvidia/cudnn/lib/libcudnn_%.so.9,$(CUDNN_LAZY_LIBS))
	$(VENV_CUDA)/bin/python -c 'import torch; print("torch", torch.__version__, "imports; cuDNN", torch.backends.cudnn.version())'
	@touch $@

# The CPU stable variant on that torch through the loader (backend="cpu"), under the Python suite.
# test-python alone runs the 4.3 GB test, build.toml's checks against CMake's configure and the
# README's commands (about this checkout; the ops they call are tested on this torch below) and
# the 4-rank expert-parallel runs (the 2-rank ones run here too); cuda-hub runs the CUDA variant's
# test once it has built that variant.
test-python-venv-cuda: hub $(VENV_CUDA)/.installed
	SCATTER_ADD_BACKEND=cpu $(VENV_CUDA)/bin/python -m pytest tests/python -q -rs \
	  --ignore tests/python/test_build_toml.py --ignore tests/python/test_readme.py \
	  -k "not test_distributed_expert_parallel_matches_single_process or 2_ranks" \
	  --deselect tests/python/test_errors.py::test_huge_tensor_offsets_past_2_31 \
	  --deselect tests/python/test_stable_abi.py::test_cuda_variant_loads_and_registers_cuda_kernels

# The cu<ver> hub variant, built against that torch (compile and link only), then the binary
# checks of every variant in build/ and the CUDA variant's registrations through the loader.
cuda-hub: deps
ifeq ($(NVCC),)
	@echo "cuda-hub: nvcc not found on this machine; the CUDA variant was NOT built"
else
	$(MAKE) $(VENV_CUDA)/.installed
	$(VENV_CUDA)/bin/python scripts/build_hub.py --cuda --jobs $(JOBS)
	$(VENV_CUDA)/bin/python -m pytest tests/python/test_stable_abi.py -q
endif

# make compat TORCH=2.15.0: the CPU stable variant on another torch from PyPI (several GB), under
# the Python suite; prints one result line.
compat: hub
	$(PYTHON) scripts/compat.py $(TORCH)

# torch_scatter has no PyPI wheels: this builds it from source into .venv (about 10 min on
# 2 cores). `make bench` includes it when it is installed and says so when it is not.
peers: venv
	$(PY) -m pip install --no-build-isolation torch-scatter==2.1.2

# The MoE combine shapes against the stream ceiling, then shapes from every corner of the sweep with
# each strategy forced: its sort (plan) and its row walk timed apart.
bench-cpp: cpp
	$(BUILD)/benchmarks/bench_scatter_add
	$(BUILD)/benchmarks/bench_scatter_add --strategies

bench: hub
	$(PY) benchmarks/bench_torch.py
	$(PY) benchmarks/bench_sweep.py

# The extension built without Python's headers (for machines without python3-dev) imports and runs.
hub-no-python-h: venv
	$(PY) scripts/check_no_python_h.py

bench-quick: hub
	$(PY) benchmarks/bench_torch.py --quick --out .build/bench-quick
	$(PY) benchmarks/bench_sweep.py --quick --out .build/bench-quick
	$(PY) benchmarks/bench_cuda.py --smoke --out .build/bench-cuda-smoke

clean:
	rm -rf .build build results
