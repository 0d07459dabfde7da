"""Loads the package the way users do, through the kernels loader, from build/<variant>/
(written by scripts/build_hub.py; `make test` runs it first).

SCATTER_ADD_BACKEND=cpu|cuda picks the loader's backend (on a CUDA build of torch the loader picks
the CUDA variant; `backend="cpu"` takes the CPU one), as `make test` does on torch 2.14.1."""
import json
import os
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
BACKEND = os.environ.get("SCATTER_ADD_BACKEND") or None


def _torch_version():
    return tuple(int(v) for v in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())


def _backend():
    if BACKEND is not None:
        return BACKEND
    return "cpu" if torch.version.cuda is None else "cuda"


def variant_dir():
    """The build/ variant the kernels loader would pick for this torch and backend: a stable-ABI
    variant whose version is at most torch's (the newest such), for this CPU architecture and
    backend (for CUDA, the same major version and a minor at most torch's CUDA minor)."""
    torch_v = _torch_version()
    backend = _backend()
    cuda_v = tuple(int(v) for v in torch.version.cuda.split(".")[:2]) if torch.version.cuda else None
    best = None
    for d in (ROOT / "build").glob(f"torch-stable-abi*-*-{os.uname().machine}-linux"):
        m = re.fullmatch(r"torch-stable-abi(\d)(\d+)-(cpu|cu(\d+)(\d))-.*", d.name)
        if m is None or not (d / "metadata.json").is_file():
            continue
        abi = (int(m.group(1)), int(m.group(2)))
        if abi > torch_v:
            continue
        if backend == "cpu":
            if m.group(3) != "cpu":
                continue
            key = (abi, 0)
        else:
            if m.group(4) is None or cuda_v is None:
                continue
            cu = (int(m.group(4)), int(m.group(5)))
            if cu[0] != cuda_v[0] or cu[1] > cuda_v[1]:
                continue
            key = (abi, cu[1])
        if best is None or key > best[0]:
            best = (key, d)
    if best is None:
        raise FileNotFoundError(f"build/ has no variant for torch {torch.__version__} ({backend}): run `make hub`")
    return best[1]


def _direct_import():
    """Imports the variant the way the loader does (for the GPU machine, whose image has no
    `kernels` package), under its metadata id."""
    import importlib.util
    import sys

    variant = variant_dir()
    ident = json.loads((variant / "metadata.json").read_text())["id"]
    spec = importlib.util.spec_from_file_location(ident, variant / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[ident] = module
    spec.loader.exec_module(module)
    return module


def load_sa():
    """The package from build/: through the kernels loader, or (SCATTER_ADD_DIRECT_IMPORT=1, or
    no `kernels` installed, as on the GPU machine) imported directly."""
    if os.environ.get("SCATTER_ADD_DIRECT_IMPORT") == "1":
        return _direct_import()
    try:
        import kernels
    except ImportError:
        return _direct_import()
    return kernels.get_local_kernel(ROOT, backend=BACKEND)


@pytest.fixture(scope="session")
def sa():
    if not (ROOT / "build").is_dir():
        pytest.fail("build/ is missing: run `make test` (it builds the hub package first)")
    return load_sa()


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def pytest_report_header(config):
    return f"torch {torch.__version__}, threads {torch.get_num_threads()}, devices {DEVICES}, " \
           f"backend {BACKEND or '(loader default)'}, " \
           f"SCATTER_ADD_CPU_ISA={os.environ.get('SCATTER_ADD_CPU_ISA', '(best)')}"
