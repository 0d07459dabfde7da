#!/usr/bin/env python3
"""Every CUDA kernel variant at small shapes, for compute-sanitizer (scripts/gpu_check.sh runs it
under `--tool memcheck` and `--tool initcheck`): dtype x 16-byte or one-element chunks x weight x
ignore_index, index_add and gather, at K = 90 (the one-block plan), K = 700 with a hot row (more
than 64 contributions: narrow column tiles) and K = 5000 with two hot rows (check_index, CUB's
radix sort and emit_runs), plus a bad index in the deferred and sync check modes and a partial last
tile. Each result is compared with the CPU op bit for bit, so a wrong read shows up here too."""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
from conftest import load_sa  # noqa: E402

sa = load_sa()
g = torch.Generator().manual_seed(0)
calls = 0


def index_for(k, n, hot):
    index = torch.randint(0, n, (k,), generator=g)
    if hot >= 1:
        index[torch.rand(k, generator=g) < 0.5] = 1   # a hot row
    if hot >= 2:
        index[torch.rand(k, generator=g) < 0.2] = n - 1  # and another
    return index


for k, hot in ((90, 0), (700, 1), (5000, 2)):
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        # 16-byte chunks with a partial tile, and one-element chunks (every shape at K = 90)
        for d in ((136, 520, 3) if k == 90 else (136, 3)):
            for idt in (torch.int32, torch.int64):
                for weighted in (False, True):
                    for ignore in ((None, -1) if k == 90 else (-1,)):
                        x = torch.randn(37, d, generator=g).to(dtype)
                        src = torch.randn(k, d, generator=g).to(dtype)
                        index = index_for(k, 37, hot).to(idt)
                        if ignore is not None:
                            index[::4] = ignore
                        w = torch.rand(k, generator=g) if weighted else None
                        expected = sa.index_add(x, index, src, weight=w, ignore_index=ignore)
                        gathered = sa.gather(x, index, weight=w, ignore_index=ignore)
                        xc = x.cuda()
                        wc = None if w is None else w.cuda()
                        sa.scatter_add(xc, index.cuda(), src.cuda(), weight=wc, ignore_index=ignore)
                        gc = sa.gather(x.cuda(), index.cuda(), weight=wc, ignore_index=ignore)
                        if not (torch.equal(xc.cpu().view(torch.uint8), expected.view(torch.uint8)) and
                                torch.equal(gc.cpu().view(torch.uint8), gathered.view(torch.uint8))):
                            sys.exit(f"cuda_memcheck: K={k} {dtype} D={d} {idt} weighted={weighted} "
                                     f"ignore={ignore}: differs from the CPU")
                        calls += 2

# A bad index writes nothing: deferred (reported by the next call) and sync (raised in the call).
x = torch.zeros(4, 64, device="cuda")
for k in (3, 5000):
    bad = torch.zeros(k, dtype=torch.int64)
    bad[k // 2] = 99
    os.environ.pop("SCATTER_ADD_CUDA_CHECK", None)
    sa.scatter_add(x, bad.cuda(), torch.ones(k, 64, device="cuda"))
    torch.cuda.synchronize()
    try:
        sa.gather(x, torch.tensor([0], device="cuda"))
        sys.exit("cuda_memcheck: the deferred bad index was not reported")
    except IndexError:
        pass
    os.environ["SCATTER_ADD_CUDA_CHECK"] = "sync"
    for op in (lambda: sa.scatter_add(x, bad.cuda(), torch.ones(k, 64, device="cuda")),
               lambda: sa.gather(x, bad.cuda())):
        try:
            op()
            sys.exit("cuda_memcheck: no error for a bad index in sync mode")
        except IndexError:
            pass
    os.environ.pop("SCATTER_ADD_CUDA_CHECK")
torch.cuda.synchronize()
assert torch.count_nonzero(x) == 0
print(f"cuda_memcheck: {calls} calls, every variant ran and matched the CPU bit for bit")
