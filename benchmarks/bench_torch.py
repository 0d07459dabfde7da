#!/usr/bin/env python3
"""`make bench`: scatter-add against what a PyTorch user would otherwise use, on this machine.

1. Op benchmark at MoE shapes: out[index[i]] += src[i] with D in {2048, 4096}, tokens N in
   {512, 2048, 8192, 32768}, top-2 (K = 2N), bf16 and f32, index distributions moe_top2 / uniform /
   hot_row. Ours (int32 index, the hub kernel's) against torch index_add_ (int64 and int32 index),
   scatter_add_ with an expanded index, torch.compile'd index_add, torch_scatter (if installed) and
   np.add.at. Each row: median ms, GB/s and % of a stream ceiling measured in this run, our speedup,
   max error against a float64 reference, and bitwise reproducibility across 1 and 2 threads.
   Bytes moved (the floor): K*D*s (src read) + 2*R*D*s (each touched row read and written once) +
   K*4 (int32 index), R = number of distinct destination rows, s = element size.
2. MoE layer benchmark (benchmarks/bench_moe.py): transformers' Mixtral and Qwen3-MoE blocks with
   each experts implementation (eager, grouped_mm, batched_mm, ours), forward and forward+backward.
3. results/bench.json (every figure, machine, torch, git commit) and PNG plots in results/.

    .venv/bin/python benchmarks/bench_torch.py [--quick] [--out DIR]
    .venv/bin/python benchmarks/bench_torch.py --plot-only results/bench.json --out DIR   (redraw only)
"""
import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_moe import MAKE_BENCH, MoEBench, plot_moe  # noqa: E402
import plotting  # noqa: E402

NP_ADD_AT_MAX_ELEMENTS = 1 << 25  # np.add.at runs ~60 M elements/s here: above this, skipped


def load_ours():
    import kernels

    return kernels.get_local_kernel(ROOT)


class Progress:
    def __init__(self, total, label):
        self.total, self.done, self.label, self.t0 = total, 0, label, time.time()

    def step(self, what):
        self.done += 1
        width = 30
        filled = int(width * self.done / self.total)
        el = time.time() - self.t0
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                         f"{el:5.0f}s {what:<40.40}")
        sys.stderr.flush()
        if self.done == self.total:
            sys.stderr.write("\n")


def timeit(fn, budget=0.3, min_reps=3, max_reps=30, reps_out=None):
    """Median seconds of fn() after one warm-up call: at least min_reps calls, more while the
    budget lasts; a call slower than 1 s is timed once (those peers are 10x+ off anyway)."""
    fn()  # warm-up
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < budget and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if times[-1] > 1.0:
            break
    if reps_out is not None:
        reps_out.append(len(times))
    return statistics.median(times)


class StreamCeiling:
    """a += b over float32 buffers far larger than the last-level cache (3 * bytes per pass), with
    all torch threads. This machine's bandwidth drifts over minutes, so each row re-measures it
    right before its own timings."""

    def __init__(self, n=64 << 20):
        self.a = torch.ones(n)
        self.b = torch.full((n,), 2.0)

    def measure(self, budget=0.2):
        s = timeit(lambda: self.a.add_(self.b), budget=budget)
        return 3 * self.a.numel() * 4 / s / 1e9


def llc_bytes():
    """Size of the last-level cache (0 when the OS does not say)."""
    best = 0
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (d / "size").read_text().strip()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1)
            best = max(best, int(size.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            pass
    return best


def make_index(dist, n, k, gen):
    if dist == "moe_top2":  # every token routed twice; source rows come expert-sorted (shuffled)
        idx = torch.arange(k) % n
        return idx[torch.randperm(k, generator=gen)]
    if dist == "uniform":
        return torch.randint(0, n, (k,), generator=gen)
    hot = torch.randint(0, n, (k,), generator=gen)  # hot_row: 90% of rows into row 0
    hot[torch.rand(k, generator=gen) < 0.9] = 0
    return hot


def peers(sa, compiled_index_add, torch_scatter):
    """name -> (setup(x, idx64, idx32, src) -> callable that updates and returns its output)."""
    def ours(x, i64, i32, s):
        return lambda: sa.scatter_add(x, i32, s)

    def torch_i64(x, i64, i32, s):
        return lambda: x.index_add_(0, i64, s)

    def torch_i32(x, i64, i32, s):
        return lambda: x.index_add_(0, i32, s)

    def scatter_add_(x, i64, i32, s):
        e = i64[:, None].expand(-1, s.shape[1])
        return lambda: x.scatter_add_(0, e, s)

    def compiled(x, i64, i32, s):
        return lambda: compiled_index_add(x, i64, s)

    def np_add_at(x, i64, i32, s):
        if x.dtype == torch.bfloat16:
            return None
        if s.numel() > NP_ADD_AT_MAX_ELEMENTS:
            return "skipped"
        xn, sn, inp = x.numpy(), s.numpy(), i64.numpy()

        def run():
            np.add.at(xn, inp, sn)
            return x
        return run

    out = {"ours": ours, "torch_index_add_i64": torch_i64, "torch_index_add_i32": torch_i32,
           "torch_scatter_add_": scatter_add_, "torch_compile_index_add": compiled}
    if torch_scatter is not None:
        def ts(x, i64, i32, s):
            return lambda: torch_scatter.scatter_add(s, i64, dim=0, out=x)
        out["torch_scatter"] = ts
    out["np_add_at"] = np_add_at
    return out


def op_benchmark(sa, args, stream):
    compiled_index_add = torch.compile(lambda x, i, s: x.index_add(0, i, s), dynamic=True)
    try:
        import torch_scatter  # noqa: F401
        ts_note = f"torch_scatter {torch_scatter.__version__}"
    except Exception as e:  # noqa: BLE001
        torch_scatter = None
        ts_note = (f"torch_scatter not installed ({type(e).__name__}); it has no PyPI wheel: `make peers` builds "
                   "it from source (about 10 minutes on 2 cores), then `make bench` includes it")
    print(f"peers: {ts_note}")
    methods = peers(sa, compiled_index_add, torch_scatter)
    ds = [2048] if args.quick else [2048, 4096]
    ns = [512] if args.quick else [512, 2048, 8192, 32768]
    dists = ["moe_top2", "hot_row"] if args.quick else ["moe_top2", "uniform", "hot_row"]
    dtypes = [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float32]
    configs = [(dt, d, n, dist) for dt in dtypes for d in ds for n in ns for dist in dists]
    prog = Progress(len(configs), "op bench")
    rows = []
    threads = torch.get_num_threads()
    for dt, d, n, dist in configs:
        gen = torch.Generator().manual_seed(n * 7 + d)
        k = 2 * n
        i64 = make_index(dist, n, k, gen)
        i32 = i64.to(torch.int32)
        src = torch.randn(k, d, generator=gen).to(dt)
        x0 = torch.randn(n, d, generator=gen).to(dt)
        ref = x0.double().index_add_(0, i64, src.double())
        r = int(torch.unique(i64).numel())
        es = src.element_size()
        nbytes = k * d * es + 2 * r * d * es + k * 4
        ceiling = stream.measure()
        working_set = k * d * es + n * d * es + k * 4  # src, out and the index
        row = {"dtype": plotting.dtype_name(dt), "D": d, "N": n, "K": k, "dist": dist, "R": r,
               "bytes": nbytes, "working_set_bytes": working_set, "fits_llc": bool(working_set <= llc_bytes()),
               "ceiling_gbs": ceiling, "methods": {}}
        for name, setup in methods.items():
            res = {}
            x = x0.clone()
            fn = setup(x, i64, i32, src)
            if fn is None or fn == "skipped":
                res["note"] = "no bfloat16 in numpy" if fn is None else \
                    f"skipped: K*D > 2^{int(math.log2(NP_ADD_AT_MAX_ELEMENTS))} (~{src.numel() / 6e7:.0f} s a call)"
                row["methods"][name] = res
                continue
            # accuracy and reproducibility: one call from x0 at 2 threads, one at 1 thread
            outs = []
            for t in (threads, 1):
                torch.set_num_threads(t)
                x.copy_(x0)
                outs.append(fn().clone())
            torch.set_num_threads(threads)
            res["max_err"] = float((outs[0].double() - ref).abs().max())
            res["bitwise_reproducible"] = bool(torch.equal(outs[0].view(torch.uint8), outs[1].view(torch.uint8)))
            x.copy_(x0)
            reps = []
            s = timeit(fn, reps_out=reps)
            res["reps"] = reps[0]
            res["ms"] = s * 1e3
            res["gbs"] = nbytes / s / 1e9
            res["pct_ceiling"] = 100 * res["gbs"] / ceiling
            row["methods"][name] = res
            del fn
        ours_ms = row["methods"]["ours"]["ms"]
        for name, res in row["methods"].items():
            if "ms" in res:
                res["ours_speedup"] = res["ms"] / ours_ms
        rows.append(row)
        prog.step(f"{row['dtype']} D={d} N={n} {dist}")
    return rows, ts_note


def print_op_table(rows, ceiling):
    names = list(rows[0]["methods"].keys())
    short = {"ours": "ours", "torch_index_add_i64": "ia_i64", "torch_index_add_i32": "ia_i32",
             "torch_scatter_add_": "scatter_", "torch_compile_index_add": "compiled", "torch_scatter": "t_scatter",
             "np_add_at": "np.add.at"}
    print(f"\nOp benchmark: ms (speedup of ours over it) | %ceil against the stream ceiling measured right "
          f"before each row (median {ceiling:.1f} GB/s) | det = bitwise same at 1 and 2 threads")
    head = f"{'dtype':8} {'D':>5} {'N':>6} {'dist':8} {'ours ms':>8} {'GB/s':>6} {'ceil':>5} {'%ceil':>6} {'err':>8} {'det':>3} |"
    for nm in names[1:]:
        head += f" {short.get(nm, nm):>17}"
    print(head)
    for r in rows:
        o = r["methods"]["ours"]
        line = (f"{r['dtype']:8} {r['D']:>5} {r['N']:>6} {r['dist']:8} {o['ms']:8.2f} {o['gbs']:6.1f} {r['ceiling_gbs']:5.1f} "
                f"{o['pct_ceiling']:5.0f}{'%c' if r.get('fits_llc') else '% '}{o['max_err']:8.1e} {'yes' if o['bitwise_reproducible'] else 'NO':>3} |")
        for nm in names[1:]:
            m = r["methods"][nm]
            if "ms" in m:
                cell = f"{m['ms']:.1f}({m['ours_speedup']:.1f}x){'' if m['bitwise_reproducible'] else '*'}"
            else:
                cell = "n/a" if "numpy" in m.get("note", "") else "skip"
            line += f" {cell:>17}"
        print(line)
    print("* = not bitwise reproducible across 1 and 2 threads. skip = np.add.at above 2^25 elements.")
    llc = llc_bytes()
    print(f"%c = the row's data (src, out and index) fits in the {llc / 2**20:.0f} MiB last-level cache, so repeated calls "
          "can be served from it: %ceil above 100% means that, since the ceiling streams 512 MiB through DRAM.")
    print("max error against float64 (ours | peers at the same dtype):")
    for r in rows:
        errs = " ".join(f"{short.get(k, k)}={v['max_err']:.1e}" for k, v in r["methods"].items() if "max_err" in v)
        print(f"  {r['dtype']} D={r['D']} N={r['N']} {r['dist']}: {errs}")


def plot_speedup_vs_tokens(rows, info, path):
    """Ours' speedup over each peer against N, moe_top2 rows: colour = peer, line style = D."""
    dtypes = [dt for dt in ("bfloat16", "float16", "float32", "float64") if any(r["dtype"] == dt for r in rows)]
    fig, axes = plotting.figure(1, len(dtypes), width=5.2, height=4.2, sharey=True)
    peers_seen, ds_seen, speedups = [], [], []
    for ax, dt in zip(axes[0], dtypes):
        sel = [r for r in rows if r["dtype"] == dt and r["dist"] == "moe_top2"]
        for d in sorted({r["D"] for r in sel}):
            pts = sorted(((r["N"], r) for r in sel if r["D"] == d), key=lambda t: t[0])
            ls, marker = plotting.d_style(d)
            for nm in pts[0][1]["methods"]:
                xs = [n for n, r in pts if nm != "ours" and "ours_speedup" in r["methods"][nm]]
                ys = [r["methods"][nm]["ours_speedup"] for n, r in pts if n in xs]
                if not xs:
                    continue
                ax.plot(xs, ys, color=plotting.method_color(nm), linestyle=ls, marker=marker, ms=4, lw=1.3)
                speedups += ys
                peers_seen += [nm] if nm not in peers_seen else []
            ds_seen += [d] if d not in ds_seen else []
        ns = sorted({r["N"] for r in sel})
        plotting.plain_log_axis(ax, ns, "x", fmt=lambda v: f"{v:.0f}")
        ax.set_xlim(ns[0] / 1.4, ns[-1] * 1.4)
        ax.set_xlabel("tokens N (K = 2N rows added, top-2)")
        ax.set_title(f"{dt}, moe_top2 index")
    plotting.speedup_axis(axes[0][0], min(speedups, default=1), max(speedups, default=1))
    for ax in axes[0][1:]:
        ax.axhline(1.0, color="#444444", lw=1, zorder=1)
    axes[0][0].set_ylabel("speedup of ours over the peer (x, log)\nabove 1x: ours is faster")
    leg = plotting.legend_outside(fig, plotting.method_handles(peers_seen), [plotting.method_label(n) for n in peers_seen],
                                  title="peer (colour)")
    fig.add_artist(leg)
    plotting.legend_outside(fig, plotting.d_handles(ds_seen), [f"D = {d}" for d in ds_seen],
                            title="row width (line style)", y=0.2, loc="upper left")
    fig.suptitle(plotting.run_title("MoE combine: speedup of scatter_add over each peer", info), y=1.02)
    fig.tight_layout()
    return plotting.save(fig, path)


def plot_gbs_vs_shape(rows, ceiling, info, path):
    """GB/s of every method at every shape: one panel per dtype x index distribution, the shapes as
    categories (points, not lines), the ceiling measured before each row as a dash."""
    dtypes = [dt for dt in ("bfloat16", "float16", "float32", "float64") if any(r["dtype"] == dt for r in rows)]
    dists = [d for d in ("moe_top2", "uniform", "hot_row") if any(r["dist"] == d for r in rows)]
    names = [nm for nm in rows[0]["methods"] if any("gbs" in r["methods"][nm] for r in rows)]
    fig, axes = plotting.figure(len(dtypes), len(dists), width=4.6, height=3.4, sharey=True)
    for i, dt in enumerate(dtypes):
        for j, dist in enumerate(dists):
            ax = axes[i][j]
            sel = sorted((r for r in rows if r["dtype"] == dt and r["dist"] == dist), key=lambda r: (r["D"], r["N"]))
            cats = [f"{r['N']}\nD{r['D']}" for r in sel]
            series = {nm: [r["methods"][nm].get("gbs") for r in sel] for nm in names}
            plotting.dodged_points(ax, cats, series, ms=3.5)
            ax.plot(range(len(sel)), [r["ceiling_gbs"] for r in sel], linestyle="none", marker="_", ms=22, mew=2,
                    color=plotting.method_color("ceiling"))
            ax.set_title(f"{dt}, {dist}")
            ax.tick_params(axis="x", labelsize=7)
            if j == 0:
                ax.set_ylabel("GB/s (bytes moved / median time)")
            if i == len(dtypes) - 1:
                ax.set_xlabel("tokens N and row width D")
    top = max([m["gbs"] for r in rows for m in r["methods"].values() if "gbs" in m] + [r["ceiling_gbs"] for r in rows])
    axes[0][0].set_ylim(0, top * 1.06)
    handles = plotting.method_handles(names, linestyle="none") + [
        plotting.Line2D([], [], color=plotting.method_color("ceiling"), marker="_", ms=14, mew=2, linestyle="none")]
    labels = [plotting.method_label(n) for n in names] + [
        f"ceiling: a += b measured right before\neach row (median {ceiling:.1f} GB/s)"]
    plotting.legend_outside(fig, handles, labels)
    fig.suptitle(plotting.run_title("GB/s by shape. Bytes moved = K*D*s + 2*R*D*s + 4K, the same for every method; "
                                    "above the ceiling: rows that stay in the caches", info), y=1.02)
    fig.tight_layout()
    return plotting.save(fig, path)


def plots(rows, ceiling, out_dir, info=None):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"plots skipped: {e}")
        return []
    files = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        files.append(str(out_dir / name))
        plt.close(fig)

    info = info or plotting.run_info()
    files.append(plot_speedup_vs_tokens(rows, info, out_dir / "speedup_vs_tokens.png"))
    files.append(plot_gbs_vs_shape(rows, ceiling, info, out_dir / "gbs_vs_shape.png"))
    return files


def distributed_benchmark(args, out_dir):
    """Runs benchmarks/bench_distributed.py on 2 ranks with torchrun (gloo, loopback)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = out_dir / "distributed.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={port}", str(ROOT / "benchmarks" / "bench_distributed.py"),
           str(out)] + (["--quick"] if args.quick else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode != 0:
        raise RuntimeError("distributed benchmark failed:\n" + r.stdout[-2000:] + r.stderr[-2000:])
    res = json.loads(out.read_text())
    print(f"\nExpert parallel, {res['world']} ranks (gloo on loopback, 1 thread each), hidden {res['hidden']}, "
          f"intermediate {res['intermediate']}, {res['tokens_per_rank']} tokens per rank, {res['dtype']}:")
    print(f"{'mode':>9} {'layer ms':>9} {'dispatch':>9} {'experts':>9} {'comm':>9} {'combine':>9}")
    for mode, m in res["modes"].items():
        print(f"{mode:>9} {m['layer_ms']:9.2f} {m['dispatch_ms']:9.2f} {m['experts_ms']:9.2f} "
              f"{m['communication_ms']:9.2f} {m['combine_ms']:9.2f}")
    return res


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


cpu_model = plotting.cpu_model


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small subset (make test runs it)")
    ap.add_argument("--out", default=str(ROOT / "results"), help="directory for bench.json and plots")
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--plot-only", metavar="BENCH_JSON",
                    help="measure nothing: print the op table and redraw the plots of a saved bench.json into --out")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.plot_only:
        saved = json.loads(Path(args.plot_only).read_text())
        m = saved["machine"]
        info = {"cpu": m["cpu"], "cpus": m["cpus"], "threads": m["torch_threads"], "torch": saved["torch"],
                "date": saved["date"][:10], "commit": saved.get("git_commit")}
        print_op_table(saved["op_benchmark"], saved["stream_ceiling_gbs"])
        files = plots(saved["op_benchmark"], saved["stream_ceiling_gbs"], out_dir, info)
        files += plot_moe(saved.get("moe_layer") or [], out_dir, info)
        print(f"\nwrote {len(files)} plots from {args.plot_only} (run of {saved['date']}, commit {saved['git_commit'][:7]})")
        return
    torch.manual_seed(0)
    sa = load_ours()
    t0 = time.time()
    stream = StreamCeiling()
    print(f"scatter-add benchmark | {cpu_model()} | {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()} | "
          f"torch {torch.__version__} | stream ceiling (a += b) {stream.measure(1.0):.1f} GB/s at start")
    rows, ts_note = op_benchmark(sa, args, stream)
    ceiling = statistics.median(r["ceiling_gbs"] for r in rows)
    print_op_table(rows, ceiling)
    moe_rows = []
    if not args.skip_moe:
        moe = MoEBench(sa, quick=args.quick, sizes=MAKE_BENCH)
        moe_rows = moe.run(Progress)
        moe.print_table(moe_rows)
    dist_res = None if args.skip_moe else distributed_benchmark(args, out_dir)
    info = dict(plotting.run_info(), commit=git_commit())
    files = plots(rows, ceiling, out_dir, info) + plot_moe(moe_rows, out_dir, info)
    result = {
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "platform": platform.platform()},
        "torch": torch.__version__, "python": platform.python_version(), "git_commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "quick": args.quick,
        "stream_ceiling_gbs": ceiling, "peers_note": ts_note, "op_benchmark": rows, "moe_layer": moe_rows,
        "expert_parallel": dist_res,
        "plots": files, "wall_s": time.time() - t0,
    }
    (out_dir / "bench.json").write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out_dir / 'bench.json'} and {len(files)} plots in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
