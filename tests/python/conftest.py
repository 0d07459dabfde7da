"""Loads the package the way users do, through the kernels loader, from build/<variant>/
(written by scripts/build_hub.py; `make test` runs it first)."""
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="session")
def sa():
    import kernels

    if not (ROOT / "build").is_dir():
        pytest.fail("build/ is missing: run `make test` (it builds the hub package first)")
    return kernels.get_local_kernel(ROOT)


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def pytest_report_header(config):
    return f"torch {torch.__version__}, threads {torch.get_num_threads()}, devices {DEVICES}, " \
           f"SCATTER_ADD_CPU_ISA={os.environ.get('SCATTER_ADD_CPU_ISA', '(best)')}"
