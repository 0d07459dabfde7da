"""The binaries in build/ as a user's machine sees them: the hub's own ABI checker
(kernel-abi-check: manylinux_2_28 and the Python 3.9 limited API), imports from torch limited to
its C shim at the targeted version, one exported symbol, two builds side by side in one process,
and the CUDA variant's registrations on a CUDA build of torch.

Every .so under build/ is checked: `make test` runs this file once after `make hub` (CPU variant,
torch 2.13) and again after `make cuda-hub` (both variants, torch 2.14.1)."""
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from conftest import ROOT, variant_dir

SO_FILES = sorted((ROOT / "build").glob("*/*.so"))
STABLE_SO = [p for p in SO_FILES if p.parent.name.startswith("torch-stable-abi")]
CONFIG = tomllib.loads((ROOT / "build.toml").read_text())
TORCH_INCLUDE = Path(torch.__file__).parent / "include"


def ids(paths):
    return [f"{p.parent.name}/{p.name}" for p in paths]


def nm(so, *flags):
    out = subprocess.run(["nm", "-D", *flags, str(so)], check=True, capture_output=True, text=True).stdout
    return [line.split()[-1] for line in out.splitlines() if line.strip()]


def target_of(so):
    """The stable-ABI target (major, minor) of a variant, from its directory name."""
    m = re.match(r"torch-stable-abi(\d)(\d+)-(cpu|cu\d+)-", so.parent.name)
    return (int(m.group(1)), int(m.group(2))), m.group(3)


def test_build_has_stable_variants():
    assert STABLE_SO, "build/ has no torch-stable-abi variant: run `make hub`"
    legacy = [p.parent.name for p in SO_FILES if re.match(r"torch\d+-", p.parent.name)]
    assert legacy == [], f"per-torch-version variants are no longer built, found {legacy}"


@pytest.mark.parametrize("so", SO_FILES, ids=ids(SO_FILES))
def test_kernel_abi_check_manylinux_2_28_and_abi3(so):
    import kernel_abi_check as kac

    obj = kac.ObjectFile(str(so))
    assert obj.check_manylinux("manylinux_2_28") == []
    assert obj.check_python_abi("3.9") == []


@pytest.mark.parametrize("so", STABLE_SO, ids=ids(STABLE_SO))
def test_variant_name_and_metadata(so):
    from kernels._rust import Metadata

    (major, minor), backend = target_of(so)
    kind = "cpu" if backend == "cpu" else "cuda"
    assert CONFIG["torch"]["stable-abi"][kind] == f"{major}.{minor}"
    assert so.parent.name == f"torch-stable-abi{major}{minor}-{backend}-{os.uname().machine}-linux"
    meta = json.loads((so.parent / "metadata.json").read_text())
    assert so.name == f"{meta['id']}.abi3.so"
    assert re.fullmatch(rf"_scatter_add_{backend}_[0-9a-f]{{7}}", meta["id"]), meta["id"]
    assert meta["name"] == CONFIG["general"]["name"] and meta["version"] == CONFIG["general"]["version"]
    assert meta["backend"]["type"] == kind
    parsed = Metadata.read_from_file(so.parent / "metadata.json")  # the loader's own parser
    assert parsed.id == meta["id"] and parsed.version == meta["version"]


@pytest.mark.parametrize("so", STABLE_SO, ids=ids(STABLE_SO))
def test_imports_no_cxx_torch_symbols(so):
    """Only torch's C shim may come from torch: a C++ symbol of c10, ATen or torch would tie the
    binary to one torch build."""
    undefined = subprocess.run(["nm", "-D", "--undefined-only", "-C", str(so)], check=True, capture_output=True,
                               text=True).stdout
    cxx = [line.strip() for line in undefined.splitlines() if re.search(r"\b(c10|at|torch|caffe2)::", line)]
    assert cxx == []
    needed = subprocess.run(["readelf", "-d", str(so)], check=True, capture_output=True, text=True).stdout
    libs = re.findall(r"Shared library: \[(.+?)\]", needed)
    assert not [lib for lib in libs if lib.startswith(("libc10", "libtorch_python", "libtorch.so"))], libs
    assert "BIND_NOW" in needed or "NOW" in needed, "imports must bind at load (-z now)"


def shim_versions():
    """Every function of torch's C shim headers, with the torch version from which the headers
    declare it. Functions outside a TORCH_FEATURE_VERSION block count as (2, 9), the first stable
    ABI release: the headers do not say more, and `make compat TORCH=<target>` loads the binary on
    the target torch itself (it binds every import at load)."""
    versions = {}
    for header in [TORCH_INCLUDE / "torch/csrc/stable/c/shim.h",
                   TORCH_INCLUDE / "torch/csrc/inductor/aoti_torch/c/shim.h"]:
        stack = []
        for line in header.read_text().splitlines():
            s = line.strip()
            m = re.match(r"#if TORCH_FEATURE_VERSION >= TORCH_VERSION_(\d+)_(\d+)_0", s)
            if m:
                stack.append((int(m.group(1)), int(m.group(2))))
            elif s.startswith("#if"):
                stack.append(None)
            elif s.startswith(("#else", "#elif")) and stack:
                stack[-1] = None
            elif s.startswith("#endif") and stack:
                stack.pop()
            for name in re.findall(r"\b((?:aoti_)?torch_\w+)\s*\(", s):
                gates = [v for v in stack if v is not None]
                versions.setdefault(name, max(gates) if gates else (2, 9))
    return versions


@pytest.mark.parametrize("so", STABLE_SO, ids=ids(STABLE_SO))
def test_shim_imports_exist_at_the_target_version(so):
    """A shim function newer than the target would tie the binary to that newer torch."""
    target, _ = target_of(so)
    versions = shim_versions()
    imported = [s for s in nm(so, "--undefined-only") if s.startswith(("aoti_torch_", "torch_"))]
    assert imported, "no shim import found"
    unknown = [s for s in imported if s not in versions]
    assert unknown == [], f"not declared by torch {torch.__version__}'s C shim headers: {unknown}"
    newer = {s: versions[s] for s in imported if versions[s] > target}
    assert newer == {}, f"imported shim functions newer than the target {target}: {newer}"


@pytest.mark.parametrize("so", STABLE_SO, ids=ids(STABLE_SO))
def test_exports_only_the_module_init(so):
    meta = json.loads((so.parent / "metadata.json").read_text())
    assert nm(so, "--defined-only") == [f"PyInit_{meta['id']}"]
    symbols = subprocess.run(["readelf", "-sW", str(so)], check=True, capture_output=True, text=True).stdout
    assert " UNIQUE " not in symbols, "GNU unique symbols are shared process-wide (build with -fno-gnu-unique)"


TWO_BUILDS = r"""
import importlib.util, json, os, shutil, sys, tempfile
from pathlib import Path
import torch, kernels
root, variant, twin_so, backend = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] or None
a = kernels.get_local_kernel(root, backend=backend)
# The second build: the same package around the twin .so (another op namespace).
ns = twin_so.name.split(".")[0]
pkg = Path(tempfile.mkdtemp()) / "scatter_add_twin"
pkg.mkdir()
for f in variant.glob("*.py"):
    shutil.copy2(f, pkg / f.name)
(pkg / "_ops.py").write_text(f"import torch\nfrom . import {ns}\nops = torch.ops.{ns}\n\n"
                             f"def add_op_namespace_prefix(op_name):\n    return f'{ns}::{{op_name}}'\n")
shutil.copy2(twin_so, pkg / twin_so.name)
spec = importlib.util.spec_from_file_location("scatter_add_twin", pkg / "__init__.py")
b = importlib.util.module_from_spec(spec)
sys.modules["scatter_add_twin"] = b
spec.loader.exec_module(b)
na, nb = a.ops.__name__.split(".")[-1], b.ops.__name__.split(".")[-1]
assert na != nb, (na, nb)
maps = open("/proc/self/maps").read()
assert f"{na}.abi3.so" in maps and f"{nb}.abi3.so" in maps
g = torch.Generator().manual_seed(0)
x = torch.randn(50, 24, generator=g)
idx = torch.randint(0, 50, (300,), generator=g)
src = torch.randn(300, 24, generator=g)
w = torch.rand(300, generator=g)
ya, yb = a.index_add(x, idx, src, weight=w), b.index_add(x, idx, src, weight=w)
ga, gb = a.gather(x, idx), b.gather(x, idx)
assert torch.equal(ya, yb) and torch.equal(ga, gb)
assert torch.equal(ya, x.double().index_add(0, idx, src.double() * w.double()[:, None]).float()) or \
    torch.allclose(ya, x.index_add(0, idx, src * w[:, None]), atol=1e-5)
for m in (a, b):
    try:
        m.ops.gather(x, torch.tensor([50]), None, None)
    except RuntimeError as e:
        assert "IndexError: gather: index[0] = 50" in str(e), str(e)
    else:
        raise AssertionError("no error")
print("two builds:", na, nb)
"""


def test_two_builds_in_one_process(tmp_path):
    """Two builds of this kernel with different op namespaces (as two versions from the hub would
    be) load into one process and each runs its own ops."""
    variant = variant_dir()
    meta = json.loads((variant / "metadata.json").read_text())
    build_dir = ROOT / ".build" / variant.name / "torch-ext"
    twin = build_dir / f"{meta['id']}_twin.abi3.so"
    assert twin.is_file(), f"{twin} is missing: scripts/build_hub.py builds it next to the variant"
    r = subprocess.run([sys.executable, "-c", TWO_BUILDS, str(ROOT), str(variant), str(twin),
                        os.environ.get("SCATTER_ADD_BACKEND", "")], capture_output=True, text=True, cwd=tmp_path,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"two builds: {meta['id']} {meta['id']}_twin" in r.stdout


CUDA_SO = [p for p in STABLE_SO if "-cu" in p.parent.name]


@pytest.mark.skipif(torch.version.cuda is None, reason=f"torch {torch.__version__} is a CPU build: the CUDA "
                    "variant is loaded by `make cuda-hub` with .venv-cuda's CUDA torch")
def test_cuda_variant_loads_and_registers_cuda_kernels(tmp_path):
    """The CUDA variant through the loader on a CUDA build of torch (no GPU needed to load it)."""
    assert CUDA_SO, "build/ has no CUDA variant: run `make cuda-hub`"
    major = torch.version.cuda.split(".")[0]
    if not any(re.search(rf"-cu{major}\d-", p.parent.name) for p in CUDA_SO):
        pytest.skip(f"build/'s CUDA variants ({', '.join(p.parent.name for p in CUDA_SO)}) are for another CUDA "
                    f"major version than this torch's {torch.version.cuda}")
    code = ("import torch, kernels, pathlib, sys\n"
            "sa = kernels.get_local_kernel(pathlib.Path(sys.argv[1]), backend='cuda')\n"
            "ns = sa.ops.__name__.split('.')[-1]\n"
            "for op in ('scatter_add_', 'index_add', 'gather'):\n"
            "    for key in ('CPU', 'CUDA'):\n"
            "        assert torch._C._dispatch_has_kernel_for_dispatch_key(f'{ns}::{op}', key), (op, key)\n"
            "x = torch.zeros(4, 3)\n"
            "sa.scatter_add(x, torch.tensor([1, 1]), torch.ones(2, 3))\n"
            "assert x[1].eq(2).all() and x[0].eq(0).all()\n"
            "print('cuda variant', ns)\n")
    r = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, cwd=tmp_path,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"cuda variant _scatter_add_cu\d+_[0-9a-f]{7}", r.stdout), r.stdout
