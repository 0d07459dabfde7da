#!/usr/bin/env python3
"""Builds the kernels-hub package build/<variant>/ with the torch installed in this Python.

    .venv/bin/python scripts/build_hub.py [--cuda] [--jobs N]

The extension uses torch's stable ABI only, so one build serves every torch from the target version
on: the variant is torch-stable-abi<maj><min>-<cpu|cuXY>-<arch>-linux, where <maj>.<min> is the
target of build.toml's [torch.stable-abi] for the backend (the installed torch must be that
version or newer: its headers build it). The op namespace is _scatter_add_<backend>_<7 hex of the
sources' sha1>. Both are computed, never hard-coded. CMake builds the extension with
-DTORCH_EXTENSION_NAME=<namespace> into .build/<variant>/ (plus a second build of the same code
under the namespace <namespace>_twin, for the test that loads two builds into one process); the
package is then laid out as the loader expects: __init__.py, _ops.py, layers.py, ...,
<ops>.abi3.so, metadata.json. Per-torch-version variants (torch<XY>-cxx11-...) are no longer built:
stale ones of this package are removed from build/. Prints the variant directory.
"""
import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["include", "csrc", "torch-ext", "CMakeLists.txt", "build.toml"]


def build_config() -> dict:
    return tomllib.loads((ROOT / "build.toml").read_text())


def stable_abi_target(backend_kind: str) -> str:
    """The oldest torch (major.minor) the `cpu` or `cuda` build supports, from build.toml."""
    target = build_config()["torch"]["stable-abi"][backend_kind]
    if not re.fullmatch(r"\d+\.\d+", target):
        sys.exit(f"build.toml: [torch.stable-abi] {backend_kind} = {target!r} is not <major>.<minor>")
    return target


def variant_name(backend: str, target: str) -> str:
    major, minor = target.split(".")
    return f"torch-stable-abi{major}{minor}-{backend}-{platform.machine()}-linux"


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


def cmake_cuda_archs() -> list[str]:
    """The CUDA architectures the top-level CMakeLists.txt compiles for, as "8.0", "9.0"."""
    text = (ROOT / "CMakeLists.txt").read_text()
    m = re.search(r'set\(SCATTER_ADD_CUDA_ARCHS "([0-9;]+)"', text)
    return [f"{a[:-1]}.{a[-1]}" for a in m.group(1).split(";")] if m else []


OPS_PY = '''import torch

from . import {ops}

ops = torch.ops.{ops}


def add_op_namespace_prefix(op_name: str) -> str:
    """Prefix op by namespace."""
    return f"{ops}::{{op_name}}"
'''


def cmake_configure(build_dir: Path, ops: str, target: str, cuda: bool, extra: list[str] = (),
                    python: str = sys.executable) -> None:
    """Configures the extension's build. Everything linked into it (the core too) is compiled with
    -fno-gnu-unique, as build.toml asks of kernel-builder (see torch-ext/CMakeLists.txt); CMake's
    file API is asked for the code model, which tests/python/test_build_toml.py reads."""
    query = build_dir / ".cmake" / "api" / "v1" / "query" / "codemodel-v2"
    query.parent.mkdir(parents=True, exist_ok=True)
    query.touch()
    cmake = [
        "cmake", "-S", str(ROOT), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
        "-DSCATTER_ADD_TESTS=OFF", "-DSCATTER_ADD_BENCH=OFF", "-DSCATTER_ADD_TORCH=ON",
        f"-DSCATTER_ADD_OPS_NAME={ops}", f"-DSCATTER_ADD_TORCH_TARGET={target}",
        f"-DPython_EXECUTABLE={python}", f"-DSCATTER_ADD_CUDA={'ON' if cuda else 'OFF'}",
        "-DCMAKE_CXX_FLAGS=-fno-gnu-unique", *(["-DCMAKE_CUDA_FLAGS=-Xcompiler=-fno-gnu-unique"] if cuda else []),
        *extra,
    ]
    subprocess.run(cmake, check=True, stdout=subprocess.DEVNULL)


def write_package(out: Path, ops: str, so: Path, metadata: dict) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in sorted((ROOT / "torch-ext" / "scatter_add").glob("*.py")):
        shutil.copy2(f, out / f.name)
    (out / "_ops.py").write_text(OPS_PY.format(ops=ops))
    shutil.copy2(so, out / so.name)
    (out / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")


def remove_stale_variants(backend: str) -> None:
    """Per-torch-version variants of this backend left by earlier builds (the loader would not pick
    them over the stable one, but an upload of build/ would carry them)."""
    for d in (ROOT / "build").glob(f"torch[0-9]*-{backend}-*"):
        if d.is_dir() and (d / "metadata.json").is_file() and \
                json.loads((d / "metadata.json").read_text()).get("name") == "scatter-add":
            shutil.rmtree(d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cuda", action="store_true", help="build the CUDA variant (needs a CUDA torch and nvcc)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()

    backend = backend_name(args.cuda)
    target = stable_abi_target("cuda" if args.cuda else "cpu")
    variant = variant_name(backend, target)
    ops = f"_scatter_add_{backend}_{source_hash()}"
    build_dir = ROOT / ".build" / variant
    cmake_configure(build_dir, ops, target, args.cuda, ["-DSCATTER_ADD_TWIN=ON"])
    subprocess.run(["cmake", "--build", str(build_dir), "-j", str(args.jobs), "--target", "scatter_add_ext",
                    "scatter_add_ext_twin"], check=True)

    config = build_config()["general"]
    backend_meta = {"type": "cuda", "archs": cmake_cuda_archs()} if args.cuda else {"type": "cpu"}
    metadata = {
        "id": ops,
        "name": config["name"],
        "version": config["version"],
        "license": config["license"],
        "python-depends": [],
        "backend": backend_meta,
    }
    remove_stale_variants(backend)
    out = ROOT / "build" / variant
    write_package(out, ops, build_dir / "torch-ext" / f"{ops}.abi3.so", metadata)
    print(out)


if __name__ == "__main__":
    main()
