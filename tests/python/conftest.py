"""Loads the package the way users do, through the kernels loader, from build/<variant>/
(written by scripts/build_hub.py; `make test` runs it first)."""
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _direct_import():
    """Imports build/<variant>/ the way the loader does (for the GPU machine, whose image has no
    `kernels` package): the variant of this torch, under its metadata id."""
    import importlib.util
    import json
    import sys

    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    backend = "cpu" if torch.version.cuda is None else "cu" + "".join(torch.version.cuda.split(".")[:2])
    variant = ROOT / "build" / f"torch{major}{minor}-cxx11-{backend}-{os.uname().machine}-linux"
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
    return kernels.get_local_kernel(ROOT)


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
           f"SCATTER_ADD_CPU_ISA={os.environ.get('SCATTER_ADD_CPU_ISA', '(best)')}"
