#!/usr/bin/env python3
"""CUDA side-by-side at the benchmark's MoE shapes (run by scripts/gpu_check.sh on a GPU machine):
ours (int32 and int64 indices; the default check mode, which never waits for the GPU, and
SCATTER_ADD_CUDA_CHECK=sync, which waits for the stream once per call to raise a bad index at
once) vs torch index_add_ (default, and under torch.use_deterministic_algorithms(True)) and vs
torch.compile'd index_add, with GB/s against a device copy ceiling measured in the same run; then
ours and index_add_ replayed from CUDA graphs, which leaves out the host's launch costs.
Bytes moved: K*D*s + 2*R*D*s + K*4 (as the CPU benchmark). Times are CUDA-event medians.

    python3 benchmarks/bench_cuda.py [--quick] [--out DIR]
    python3 benchmarks/bench_cuda.py --smoke   # tiny shapes on the CPU when torch sees no GPU:
                                               # runs every line of the script (make test does) and
                                               # prints no timings (they would mean nothing)
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
sys.path.insert(0, str(ROOT / "benchmarks"))


DEV = "cuda" if torch.cuda.is_available() else "cpu"
_FLUSH = None


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def device_ms(fn, reps=20):
    """Median of `reps` timed calls (CUDA events on the GPU), each after 256 MB were written
    (L2 is 60 MB on an H200), so small shapes are not timed out of a warm cache."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty((256 if DEV == "cuda" else 4) << 20, dtype=torch.uint8, device=DEV)
    fn()
    sync()
    times = []
    for _ in range(reps):
        _FLUSH.zero_()
        if DEV == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graphed(fn, out):
    """fn captured in a CUDA graph and replayed (no host launch cost: the GPU's time alone); the
    returned callable gives `out`. A plain call on the CPU (smoke run)."""
    if DEV != "cuda":
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def replay():
        graph.replay()
        return out

    return replay


@contextlib.contextmanager
def check_mode(value):
    """SCATTER_ADD_CUDA_CHECK = value while the block runs (None: unset, the default mode)."""
    old = os.environ.get("SCATTER_ADD_CUDA_CHECK")
    if value is None:
        os.environ.pop("SCATTER_ADD_CUDA_CHECK", None)
    else:
        os.environ["SCATTER_ADD_CUDA_CHECK"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SCATTER_ADD_CUDA_CHECK", None)
        else:
            os.environ["SCATTER_ADD_CUDA_CHECK"] = old


def copy_ceiling_gbs(nbytes):
    x = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = device_ms(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e6


def load():
    from conftest import load_sa

    return load_sa()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on the CPU without a GPU")
    ap.add_argument("--out", default=str(ROOT / "results" / "gpu"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from bench_torch import make_index

    if DEV == "cpu" and not args.smoke:
        sys.exit("bench_cuda: torch sees no CUDA device (use --smoke for a CPU run of the script)")
    sa = load()
    ceiling = copy_ceiling_gbs((16 if args.smoke else 1024) << 20)
    name = torch.cuda.get_device_name() if DEV == "cuda" else "CPU"
    if args.smoke:
        print(f"bench_cuda SMOKE RUN on {name} (torch {torch.__version__}): tiny shapes, every method run "
              "once and checked against a float64 reference; it shows the script works, measures nothing, "
              "and prints no timings")
    else:
        print(f"{name} | torch {torch.__version__} | copy ceiling {ceiling:.0f} GB/s")
    compiled = torch.compile(lambda x, i, s: x.index_add(0, i, s), dynamic=True)
    rows = []
    ds = [64] if args.smoke else [2048] if args.quick else [2048, 4096]
    ns = [256] if args.smoke else [8192] if args.quick else [512, 2048, 8192, 32768]
    reps = 3 if args.smoke else 20
    for dt in [torch.bfloat16, torch.float32]:
        for d in ds:
            for n in ns:
                for dist in ["moe_top2", "uniform", "hot_row"]:
                    gen = torch.Generator().manual_seed(n + d)
                    k = 2 * n
                    i64 = make_index(dist, n, k, gen).to(DEV)
                    i32 = i64.int()
                    src = torch.randn(k, d, generator=gen).to(dt).to(DEV)
                    x0 = torch.randn(n, d, generator=gen).to(dt).to(DEV)
                    ref = x0.double().index_add_(0, i64, src.double())
                    r = int(torch.unique(i64).numel())
                    es = src.element_size()
                    nbytes = k * d * es + 2 * r * d * es + k * 4
                    row = {"dtype": str(dt)[6:], "D": d, "N": n, "dist": dist, "bytes": nbytes, "methods": {}}
                    x = x0.clone()

                    def det_torch():
                        torch.use_deterministic_algorithms(True)
                        try:
                            return x.index_add_(0, i64, src)
                        finally:
                            torch.use_deterministic_algorithms(False)

                    # (function, SCATTER_ADD_CUDA_CHECK while it runs)
                    methods = {"ours": (lambda: sa.scatter_add(x, i32, src), None),
                               "ours_int64": (lambda: sa.scatter_add(x, i64, src), None),
                               "ours_sync": (lambda: sa.scatter_add(x, i32, src), "sync"),
                               "ours_trap": (lambda: sa.scatter_add(x, i32, src), "trap"),
                               "torch_index_add": (lambda: x.index_add_(0, i64, src), None),
                               "torch_index_add_deterministic": (det_torch, None),
                               "torch_compile_index_add": (lambda: compiled(x, i64, src), None),
                               "ours_graph": (graphed(lambda: sa.scatter_add(x, i32, src), x), None),
                               "torch_index_add_graph": (graphed(lambda: x.index_add_(0, i64, src), x), None)}
                    for name, (fn, check) in methods.items():
                        with check_mode(check):
                            outs = []
                            for _ in range(2):
                                x.copy_(x0)
                                outs.append(fn().clone())
                            res = {"max_err": float((outs[0].double() - ref).abs().max()),
                                   "bitwise_reproducible": bool(torch.equal(outs[0].view(torch.uint8),
                                                                            outs[1].view(torch.uint8)))}
                            x.copy_(x0)
                            ms = device_ms(fn, reps)
                        res.update(ms=ms, gbs=nbytes / ms / 1e6, pct_ceiling=100 * nbytes / ms / 1e6 / ceiling)
                        row["methods"][name] = res
                    o = row["methods"]["ours"]["ms"]
                    for m in row["methods"].values():
                        m["ours_speedup"] = m["ms"] / o
                    rows.append(row)
                    ms = row["methods"]
                    if args.smoke:
                        print(f"smoke {row['dtype']:8} D={d} N={n} {dist:8} "
                              + " ".join(f"{k}(err={v['max_err']:.2g}, det={v['bitwise_reproducible']})"
                                         for k, v in ms.items()))
                        continue
                    print(f"{row['dtype']:8} D={d:5} N={n:6} {dist:8} ours {ms['ours']['ms']:.3f} ms "
                          f"{ms['ours']['gbs']:6.0f} GB/s {ms['ours']['pct_ceiling']:5.1f}% det={ms['ours']['bitwise_reproducible']} | "
                          + " ".join(f"{k}={v['ms']:.3f}ms({v['ours_speedup']:.1f}x, det={v['bitwise_reproducible']})"
                                     for k, v in ms.items() if k != "ours"))
    if args.smoke:
        for row in rows:  # timings of a CPU smoke run mean nothing: not kept
            for m in row["methods"].values():
                for key in ("ms", "gbs", "pct_ceiling", "ours_speedup"):
                    m.pop(key)
        (out / "bench_cuda_smoke.json").write_text(json.dumps({"smoke": True, "rows": rows}, indent=1))
        print(f"bench_cuda SMOKE RUN done: {len(rows)} shapes x {len(rows[0]['methods'])} methods ran")
        return
    print(f"\nsummary (copy ceiling {ceiling:.0f} GB/s; speedup = their ms / our ms; det = bitwise reproducible)")
    print("ours: the default check mode (never waits for the GPU); sync: SCATTER_ADD_CUDA_CHECK=sync (waits "
          "once per call); trap: SCATTER_ADD_CUDA_CHECK=trap")
    print("graph: both sides replayed from a CUDA graph (GPU time without host launch costs)")
    print(f"{'dtype':8} {'D':>5} {'N':>6} {'dist':8} {'ours ms':>8} {'GB/s':>6} {'%ceil':>6} {'sync ms':>8} "
          f"{'trap ms':>8} {'i64 ms':>7} {'x eager':>8} {'x det':>6} {'x comp':>7} {'graph ms':>8} {'%ceil':>6} "
          f"{'x eager':>8} det(ours/eager)")
    for row in rows:
        m = row["methods"]
        print(f"{row['dtype']:8} {row['D']:5} {row['N']:6} {row['dist']:8} {m['ours']['ms']:8.3f} "
              f"{m['ours']['gbs']:6.0f} {m['ours']['pct_ceiling']:6.1f} {m['ours_sync']['ms']:8.3f} "
              f"{m['ours_trap']['ms']:8.3f} {m['ours_int64']['ms']:7.3f} {m['torch_index_add']['ours_speedup']:8.2f} "
              f"{m['torch_index_add_deterministic']['ours_speedup']:6.2f} {m['torch_compile_index_add']['ours_speedup']:7.2f} "
              f"{m['ours_graph']['ms']:8.3f} {m['ours_graph']['pct_ceiling']:6.1f} "
              f"{m['torch_index_add_graph']['ms'] / m['ours_graph']['ms']:8.2f} "
              f"{m['ours']['bitwise_reproducible']}/{m['torch_index_add']['bitwise_reproducible']}")
    (out / "bench_cuda.json").write_text(json.dumps({
        "gpu": name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
        "copy_ceiling_gbs": ceiling, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
