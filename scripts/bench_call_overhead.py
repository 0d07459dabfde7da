#!/usr/bin/env python3
"""Per-call cost of a tiny call (K=16 indices, D=1) through torch.ops, next to torch's index_add_.

    .venv/bin/python scripts/bench_call_overhead.py [--so NAME=PATH ...] [--rounds 15] [--calls 2000]

Loads build/'s variant through the kernels loader (and any extra builds given with --so, e.g. a
build of another revision, to compare against), then times each op in rounds, interleaved so that
machine noise hits every column alike. Prints the median and the spread (min..max) of the
per-round means, in microseconds per call.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--so", action="append", default=[], help="NAME=PATH of another build's .so to time too")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import kernels

    sa = kernels.get_local_kernel(ROOT)
    n, k, d = 64, 16, 1
    g = torch.Generator().manual_seed(0)
    x = torch.zeros(n, d)
    idx = torch.randint(0, n, (k,), generator=g)
    src = torch.randn(k, d, generator=g)
    cols = {"torch index_add_": lambda: x.index_add_(0, idx, src),
            f"ops.scatter_add_ ({sa.ops.__name__.split('.')[-1]})": lambda: sa.ops.scatter_add_(x, idx, src, None, None)}
    for spec in args.so:
        name, path = spec.split("=", 1)
        torch.ops.load_library(path)
        ns = Path(path).name.split(".")[0]
        op = getattr(torch.ops, ns).scatter_add_
        cols[f"ops.scatter_add_ ({name})"] = lambda op=op: op(x, idx, src, None, None)
    for f in cols.values():  # warm up
        for _ in range(200):
            f()
    per = {c: [] for c in cols}
    for _ in range(args.rounds):
        for c, f in cols.items():
            t0 = time.perf_counter()
            for _ in range(args.calls):
                f()
            per[c].append((time.perf_counter() - t0) / args.calls * 1e6)
    print(f"torch {torch.__version__}, K={k}, D={d}, N={n}, threads {torch.get_num_threads()}, "
          f"{args.rounds} interleaved rounds of {args.calls} calls; us per call: median (min..max)")
    for c, v in per.items():
        print(f"  {c:<45} {statistics.median(v):6.2f}  ({min(v):.2f}..{max(v):.2f})")


if __name__ == "__main__":
    sys.exit(main())
