#!/usr/bin/env python3
"""Builds the kernels-hub package build/<variant>/ for the torch installed in this Python.

    .venv/bin/python scripts/build_hub.py [--cuda] [--jobs N]

The variant name (torch<maj><min>-cxx11-<cpu|cuXY>-<arch>-linux) and the op namespace
(_scatter_add_<backend>_<7 hex of the sources' sha1>) are computed, never hard-coded. CMake builds
the extension with -DTORCH_EXTENSION_NAME=<namespace> into .build/<variant>/; the package is then
laid out as the loader expects: __init__.py, _ops.py, layers.py, <ops>.abi3.so, metadata.json.
Prints the variant directory.
"""
import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["include", "csrc", "torch-ext", "CMakeLists.txt"]


def variant_name(backend: str) -> str:
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    abi = "cxx11" if torch.compiled_with_cxx11_abi() else "cxx98"
    return f"torch{major}{minor}-{abi}-{backend}-{platform.machine()}-linux"


def backend_name(cuda: bool) -> str:
    import torch

    if not cuda:
        return "cpu"
    if torch.version.cuda is None:
        sys.exit("--cuda needs a CUDA build of torch")
    major, minor = torch.version.cuda.split(".")[:2]
    return f"cu{major}{minor}"


def source_hash() -> str:
    h = hashlib.sha1()
    for top in SOURCES:
        p = ROOT / top
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and "__pycache__" not in f.parts)
        for f in files:
            h.update(str(f.relative_to(ROOT)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:7]


OPS_PY = '''import torch

from . import {ops}

ops = torch.ops.{ops}


def add_op_namespace_prefix(op_name: str) -> str:
    """Prefix op by namespace."""
    return f"{ops}::{{op_name}}"
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cuda", action="store_true", help="build the CUDA variant (needs a CUDA torch and nvcc)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()

    backend = backend_name(args.cuda)
    variant = variant_name(backend)
    ops = f"_scatter_add_{backend}_{source_hash()}"
    build_dir = ROOT / ".build" / variant
    cmake = [
        "cmake", "-S", str(ROOT), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
        "-DSCATTER_ADD_TESTS=OFF", "-DSCATTER_ADD_BENCH=OFF", "-DSCATTER_ADD_TORCH=ON",
        f"-DSCATTER_ADD_OPS_NAME={ops}", f"-DPython_EXECUTABLE={sys.executable}",
        f"-DSCATTER_ADD_CUDA={'ON' if args.cuda else 'OFF'}",
    ]
    subprocess.run(cmake, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build_dir), "-j", str(args.jobs), "--target", "scatter_add_ext"], check=True)

    out = ROOT / "build" / variant
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    pkg = ROOT / "torch-ext" / "scatter_add"
    for f in sorted(pkg.glob("*.py")):
        shutil.copy2(f, out / f.name)
    (out / "_ops.py").write_text(OPS_PY.format(ops=ops))
    so = build_dir / "torch-ext" / f"{ops}.abi3.so"
    shutil.copy2(so, out / so.name)
    metadata = {
        "id": ops,
        "name": "scatter-add",
        "version": 1,
        "license": "Apache-2.0",
        "python-depends": [],
        "backend": {"type": "cuda" if args.cuda else "cpu"},
    }
    (out / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    print(out)


if __name__ == "__main__":
    main()
