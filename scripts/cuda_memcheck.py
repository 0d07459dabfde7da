#!/usr/bin/env python3
"""Every CUDA kernel variant once at small shapes, for compute-sanitizer (scripts/gpu_check.sh runs
`compute-sanitizer --tool memcheck` on it): dtype x 16-byte or scalar
chunks x weight x ignore_index, index_add and gather, a bad index, and a partial last tile."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
from conftest import load_sa  # noqa: E402

sa = load_sa()
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
    for d in (136, 520, 3):  # 16-byte chunks with a partial tile, and one-element chunks
        for idt in (torch.int32, torch.int64):
            for weighted in (False, True):
                for ignore in (None, -1):
                    x = torch.randn(37, d, generator=g).to(dtype).cuda()
                    src = torch.randn(90, d, generator=g).to(dtype).cuda()
                    index = torch.randint(0, 37, (90,), generator=g).to(idt)
                    if ignore is not None:
                        index[::4] = ignore
                    index = index.cuda()
                    w = torch.rand(90, generator=g).cuda() if weighted else None
                    sa.scatter_add(x, index, src, weight=w, ignore_index=ignore)
                    sa.gather(x, index, weight=w, ignore_index=ignore)
bad = torch.tensor([0, 99, 1], device="cuda")
try:
    sa.scatter_add(torch.zeros(4, 64, device="cuda"), bad, torch.ones(3, 64, device="cuda"))
    sys.exit("no error for a bad index")
except IndexError:
    pass
torch.cuda.synchronize()
print("cuda_memcheck: all variants ran")
