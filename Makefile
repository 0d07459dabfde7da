# scatter-add. Two commands do everything on a fresh Debian 12 machine:
#   make bench   the side-by-side benchmark (installs what it needs first)
#   make test    C++ tests on every ISA level, the hub package, pytest, and a quick bench
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BUILD := .build/release
JOBS ?= $(shell nproc)

.PHONY: all deps venv cpp test test-cpp test-python hub bench bench-quick bench-cpp clean

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

test: test-cpp test-python bench-quick

bench-cpp: cpp
	$(BUILD)/benchmarks/bench_scatter_add

bench: hub
	$(PY) benchmarks/bench_torch.py

bench-quick: hub
	$(PY) benchmarks/bench_torch.py --quick --out .build/bench-quick

clean:
	rm -rf .build build results
