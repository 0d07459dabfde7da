#!/usr/bin/env python3
"""Builds the torch extension with SCATTER_ADD_NO_PYTHON_H=ON (the module entry point declared
without Python's headers, for build machines without python3-dev) into .build/no-python-h, and
checks that the package imports with it and its ops run (make test runs this)."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from build_hub import cmake_configure, stable_abi_target  # noqa: E402

OPS = "_scatter_add_cpu_nopythonh"
build = ROOT / ".build" / "no-python-h"
# Unoptimised (-O0, no debug information): what is checked is how the module is declared and
# loaded, and -O0 compiles the core's kernels in a fraction of -O2's time.
cmake_configure(build, OPS, stable_abi_target("cpu"), cuda=False,
                extra=["-DSCATTER_ADD_NO_PYTHON_H=ON", "-DCMAKE_BUILD_TYPE=Debug", "-DCMAKE_CXX_FLAGS_DEBUG=-O0"])
flags = (build / "torch-ext" / "CMakeFiles" / "scatter_add_ext.dir" / "flags.make").read_text()
assert "SCATTER_ADD_NO_PYTHON_H=1" in flags, "the option did not reach the compiler"
subprocess.run(["cmake", "--build", str(build), "-j", "2", "--target", "scatter_add_ext"], check=True,
               stdout=subprocess.DEVNULL)
pkg = build / "pkg" / "sa_no_python_h"
shutil.rmtree(pkg.parent, ignore_errors=True)
pkg.mkdir(parents=True)
for f in (ROOT / "torch-ext" / "scatter_add").glob("*.py"):
    shutil.copy2(f, pkg / f.name)
(pkg / "_ops.py").write_text(
    f"import torch\n\nfrom . import {OPS}\n\nops = torch.ops.{OPS}\n\n\n"
    f"def add_op_namespace_prefix(op_name: str) -> str:\n    return f\"{OPS}::{{op_name}}\"\n")
shutil.copy2(build / "torch-ext" / f"{OPS}.abi3.so", pkg)
sys.path.insert(0, str(pkg.parent))
import sa_no_python_h as sa  # noqa: E402

mod = sys.modules[f"sa_no_python_h.{OPS}"]
assert re.fullmatch(rf"sa_no_python_h\.{OPS}", mod.__name__), mod.__name__
x = torch.zeros(4, 3)
out = sa.index_add(x, torch.tensor([0, 2, 2]), torch.ones(3, 3), weight=torch.tensor([1.0, 2.0, 3.0]))
assert torch.equal(out, torch.tensor([[1.0] * 3, [0.0] * 3, [5.0] * 3, [0.0] * 3])), out
torch.library.opcheck(sa.ops.gather, (out, torch.tensor([2, 0]), None, None))
print(f"no-python-h build: {mod.__name__} imports, ops run")
