#!/usr/bin/env python3
"""CUDA side-by-side at the benchmark's MoE shapes (run by scripts/gpu_check.sh on a GPU machine):
ours vs torch index_add_ (default, and under torch.use_deterministic_algorithms(True)) and vs
torch.compile'd index_add, with GB/s against a device copy ceiling measured in the same run.
Bytes moved: K*D*s + 2*R*D*s + K*4 (as the CPU benchmark). Times are CUDA-event medians.

    python3 benchmarks/bench_cuda.py [--quick] [--out DIR]
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def cuda_ms(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_ceiling_gbs():
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = cuda_ms(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e6


def load():
    import os

    os.environ.setdefault("SCATTER_ADD_DIRECT_IMPORT", "0")
    try:
        import kernels

        return kernels.get_local_kernel(ROOT)
    except ImportError:
        from conftest import _direct_import

        return _direct_import()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "results" / "gpu"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from bench_torch import make_index

    sa = load()
    ceiling = copy_ceiling_gbs()
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | copy ceiling {ceiling:.0f} GB/s")
    compiled = torch.compile(lambda x, i, s: x.index_add(0, i, s), dynamic=True)
    rows = []
    ds = [2048] if args.quick else [2048, 4096]
    ns = [8192] if args.quick else [512, 2048, 8192, 32768]
    for dt in [torch.bfloat16, torch.float32]:
        for d in ds:
            for n in ns:
                for dist in ["moe_top2", "uniform", "hot_row"]:
                    gen = torch.Generator().manual_seed(n + d)
                    k = 2 * n
                    i64 = make_index(dist, n, k, gen).cuda()
                    i32 = i64.int()
                    src = torch.randn(k, d, generator=gen).to(dt).cuda()
                    x0 = torch.randn(n, d, generator=gen).to(dt).cuda()
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

                    methods = {"ours": lambda: sa.scatter_add(x, i32, src),
                               "torch_index_add": lambda: x.index_add_(0, i64, src),
                               "torch_index_add_deterministic": det_torch,
                               "torch_compile_index_add": lambda: compiled(x, i64, src)}
                    for name, fn in methods.items():
                        outs = []
                        for _ in range(2):
                            x.copy_(x0)
                            outs.append(fn().clone())
                        res = {"max_err": float((outs[0].double() - ref).abs().max()),
                               "bitwise_reproducible": bool(torch.equal(outs[0].view(torch.uint8), outs[1].view(torch.uint8)))}
                        x.copy_(x0)
                        ms = cuda_ms(fn)
                        res.update(ms=ms, gbs=nbytes / ms / 1e6, pct_ceiling=100 * nbytes / ms / 1e6 / ceiling)
                        row["methods"][name] = res
                    o = row["methods"]["ours"]["ms"]
                    for m in row["methods"].values():
                        m["ours_speedup"] = m["ms"] / o
                    rows.append(row)
                    ms = row["methods"]
                    print(f"{row['dtype']:8} D={d:5} N={n:6} {dist:8} ours {ms['ours']['ms']:.3f} ms "
                          f"{ms['ours']['gbs']:6.0f} GB/s {ms['ours']['pct_ceiling']:5.1f}% det={ms['ours']['bitwise_reproducible']} | "
                          + " ".join(f"{k}={v['ms']:.3f}ms({v['ours_speedup']:.1f}x, det={v['bitwise_reproducible']})"
                                     for k, v in ms.items() if k != "ours"))
    (out / "bench_cuda.json").write_text(json.dumps({
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
        "copy_ceiling_gbs": ceiling, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
