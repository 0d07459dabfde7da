"""The three ways the kernels loader finds this package: get_local_kernel(repo), get_kernel with
LOCAL_KERNELS, and get_kernel from an offline hub cache (HF_HUB_OFFLINE=1). Each runs in a fresh
interpreter since the loader reads its environment once."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import BACKEND, ROOT

REPO = "scatter-add-org/scatter-add"
# The loader's backend: SCATTER_ADD_BACKEND=cpu takes the CPU variant on a CUDA build of torch.
BACKEND_ARG = f", backend={BACKEND!r}" if BACKEND else ""
CHECK = """
import torch, kernels, sys
sa = {load}
x = torch.zeros(4, 8, dtype=torch.bfloat16)
sa.scatter_add(x, torch.tensor([0, 0, 3], dtype=torch.int32), torch.ones(3, 8, dtype=torch.bfloat16), lnc=2)
assert x[0].eq(2).all() and x[3].eq(1).all() and x[1].eq(0).all(), x
assert sa.ScatterAdd(lnc=2)(torch.zeros(2, 2), torch.tensor([1]), torch.ones(1, 2))[1].eq(1).all()
print("loaded", sa.__name__, sorted(sa.__all__))
"""


def run(load, env_extra, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "LOCAL_KERNELS", "KERNELS_"))}
    env.update(env_extra)
    r = subprocess.run([sys.executable, "-c", CHECK.format(load=load)], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "loaded _scatter_add_" in r.stdout
    return r.stdout


def test_get_local_kernel(tmp_path):
    run(f"kernels.get_local_kernel(__import__('pathlib').Path({str(ROOT)!r}){BACKEND_ARG})", {}, tmp_path)


def test_get_kernel_through_local_kernels(tmp_path):
    run(f"kernels.get_kernel({REPO!r}, version=1{BACKEND_ARG})", {"LOCAL_KERNELS": f"{REPO}={ROOT}", "HF_HUB_OFFLINE": "1",
                                                      "HF_HUB_CACHE": str(tmp_path / "empty-cache")}, tmp_path)


def test_get_kernel_from_offline_hub_cache(tmp_path):
    cache = tmp_path / "hub"
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = cache / ("kernels--" + REPO.replace("/", "--"))
    shutil.copytree(ROOT / "build", repo_dir / "snapshots" / sha / "build",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "v1").write_text(sha)
    meta = json.loads(next((repo_dir / "snapshots" / sha / "build").glob("*-cpu-*/metadata.json")).read_text())
    assert meta["name"] == "scatter-add" and meta["version"] == 1 and meta["python-depends"] == []
    out = run(f"kernels.get_kernel({REPO!r}, version=1{BACKEND_ARG})", {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)},
              tmp_path)
    assert meta["id"] in out
