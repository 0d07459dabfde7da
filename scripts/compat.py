#!/usr/bin/env python3
"""Tries the CPU stable-ABI variant in build/ on another torch from PyPI (`make compat TORCH=...`).

    python3 scripts/compat.py 2.15.0

Installs torch==<version> with this project's test requirements into .build/compat-<version>/
(PyPI's Linux wheels of torch are CUDA builds: several GB), loads build/'s CPU variant through the
kernels loader with backend="cpu", runs the Python suite against it, and prints one result line.
A pip constraint file that caps torch (as on machines that preinstall one torch) is lifted for
this install only (PIP_CONSTRAINT=/dev/null). Exits non-zero when the variant does not load or a
test fails.
"""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLOW = "tests/python/test_errors.py::test_huge_tensor_offsets_past_2_31"  # 4.3 GB; runs in `make test`
# The CUDA variant against the CUDA torch it was built with (`make cuda-hub`); this checks the CPU one.
CUDA_VARIANT = "tests/python/test_stable_abi.py::test_cuda_variant_loads_and_registers_cuda_kernels"


def main() -> int:
    if len(sys.argv) != 2 or not re.fullmatch(r"\d+\.\d+(\.\d+)?", sys.argv[1]):
        print("usage: make compat TORCH=<version>, e.g. make compat TORCH=2.15.0", file=sys.stderr)
        return 2
    version = sys.argv[1]
    venv = ROOT / ".build" / f"compat-{version}"
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    reqs = venv / "requirements.txt"
    reqs.write_text("".join(line for line in (ROOT / "requirements.txt").read_text().splitlines(keepends=True)
                            if not re.match(r"(torch|matplotlib)==", line)))
    env = dict(os.environ, PIP_CONSTRAINT="/dev/null")
    print(f"compat: installing torch=={version} from PyPI into {venv.relative_to(ROOT)} "
          "(a CUDA build of torch: several GB on the first run)", flush=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    subprocess.run([str(py), "-m", "pip", "install", "-q", f"torch=={version}", "-r", str(reqs)], check=True,
                   env=env)
    installed = subprocess.run([str(py), "-c", "import torch; print(torch.__version__)"], check=True,
                               capture_output=True, text=True).stdout.strip()

    probe = subprocess.run(
        [str(py), "-c", "import kernels, pathlib, sys; sa = kernels.get_local_kernel(pathlib.Path(sys.argv[1]), "
                        "backend='cpu'); import sys; print(sa.__file__)", str(ROOT)],
        capture_output=True, text=True, cwd=venv)
    if probe.returncode != 0:
        print(probe.stdout + probe.stderr)
        print(f"compat: torch {installed}: the CPU stable variant did NOT load")
        return 1
    variant = Path(probe.stdout.strip().splitlines()[-1]).parent.name

    t0 = time.time()
    env = dict(os.environ, SCATTER_ADD_BACKEND="cpu")
    run = subprocess.run([str(py), "-m", "pytest", "tests/python", "-q", "-p", "no:cacheprovider", "--deselect", SLOW,
                          "--deselect", CUDA_VARIANT],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    log = venv / "pytest.log"
    log.write_text(run.stdout + run.stderr)
    tail = [line for line in run.stdout.splitlines() if line.strip()]
    summary = tail[-1].strip("= ") if tail else "no pytest output"
    print("\n".join(tail[-15:]) if run.returncode != 0 else "")
    print(f"compat: torch {installed} loads build/{variant} through kernels (backend=\"cpu\"); "
          f"pytest tests/python: {summary} ({time.time() - t0:.0f} s; log in {log.relative_to(ROOT)})")
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
