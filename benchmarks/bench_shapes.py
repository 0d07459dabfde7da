#!/usr/bin/env python3
"""scatter_add and gather at workload shapes beyond MoE rows, one thread, thread CPU time.

    .venv/bin/python benchmarks/bench_shapes.py     (after `make hub`)

Embedding-gradient-like (N >> K), histogram-like (D = 1), GNN-like (K >> N) and sorted-index
shapes, float32, int32 index for ours. "torch" is the best of index_add_ (int64 and int32 index) and
scatter_add_ with an expanded index; for gather, the best of index_select and x[idx]. Prints a
Markdown table (medians of 7 to 21 calls; one thread so that a busy machine does not distort it).
"""
import statistics
import time
from pathlib import Path

import kernels
import torch

ROOT = Path(__file__).resolve().parents[1]
ROWS = [  # N, K, D, index
    (262_144, 4_096, 1, "uniform"), (262_144, 4_096, 8, "uniform"), (1_000_000, 100_000, 1, "uniform"),
    (1_000_000, 100_000, 32, "uniform"), (1_000_000, 100_000, 256, "uniform"), (100_000, 1_000_000, 1, "uniform"),
    (1_000, 1_000_000, 2, "sorted"), (4_096, 4_096, 1, "uniform"),
]


def median_ms(f, reps):
    f()
    ts = []
    for _ in range(reps):
        t0 = time.thread_time()
        f()
        ts.append(time.thread_time() - t0)
    return statistics.median(ts) * 1e3


def main():
    torch.set_num_threads(1)
    sa = kernels.get_local_kernel(ROOT)
    g = torch.Generator().manual_seed(0)
    print("| N | K | D | dtype | index | ours ms | torch ms (best) | ours vs torch | gather ms | "
          "index_select ms | gather vs torch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n, k, d, dist in ROWS:
        idx = torch.randint(0, n, (k,), generator=g)
        if dist == "sorted":
            idx = idx.sort().values
        i32 = idx.int()
        out, src = torch.zeros(n, d), torch.randn(k, d, generator=g)
        exp = idx[:, None].expand(-1, d)
        reps = 7 if n * d + k * d > 2e7 else 21
        ours = median_ms(lambda: sa.scatter_add(out, i32, src), reps)
        best = min(median_ms(lambda: out.index_add_(0, idx, src), reps),
                   median_ms(lambda: out.index_add_(0, i32, src), reps),
                   median_ms(lambda: out.scatter_add_(0, exp, src), reps))
        x = torch.randn(n, d, generator=g)
        g_ours = median_ms(lambda: sa.gather(x, i32), reps)
        g_best = min(median_ms(lambda: x.index_select(0, idx), reps), median_ms(lambda: x[idx], reps))
        print(f"| {n:,} | {k:,} | {d} | f32 | {dist} | {ours:.3f} | {best:.3f} | {best / ours:.2f}x | "
              f"{g_ours:.3f} | {g_best:.3f} | {g_best / g_ours:.2f}x |")


if __name__ == "__main__":
    main()
