"""The plot style shared by every benchmark of this project.

- One fixed colour per method, the same in every plot and every run, whichever peers are installed
  (METHOD_STYLE; a name not listed gets a colour derived from the name itself, never from the order
  in which methods happen to be plotted).
- Line style (and marker) tells the row width D apart; colour never does.
- Plain tick labels (512, 2048, 1x, 2x, 10x), no 2^11 or 6x10^0.
- Legends outside the data, on the right.
- Titles carry the machine, torch version and date of the run (run_title).
- Categorical axes get points (dodged per method) or bars, never lines joining unrelated cases.
- Full dtype names: bfloat16, float16, float32, float64.

    from plotting import figure, save, method_color, ...
"""
import hashlib
import os
import platform
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # noqa: E402

# name -> (colour, label). Colours: Okabe-Ito and tab10 hues, told apart by colour-blind readers.
METHOD_STYLE = {
    "ours": ("#000000", "ours (scatter_add, int32 index)"),
    "ours_int64": ("#555555", "ours, int64 index"),
    "ours_nowait": ("#999999", "ours, no-wait index check"),
    "ours_graph": ("#000000", "ours, CUDA graph"),
    "ours_both": ("#555555", "ours: gather + combine"),
    "torch_index_add_i64": ("#0072B2", "torch index_add_ (int64 index)"),
    "torch_index_add": ("#0072B2", "torch index_add_"),
    "native": ("#0072B2", "native (index_add_)"),
    "torch_index_add_graph": ("#0072B2", "torch index_add_, CUDA graph"),
    "torch_index_add_i32": ("#56B4E9", "torch index_add_ (int32 index)"),
    "torch_index_add_deterministic": ("#56B4E9", "torch index_add_, deterministic mode"),
    "torch_scatter_add_": ("#009E73", "torch scatter_add_ (expanded index)"),
    "torch_compile_index_add": ("#E69F00", "torch.compile(index_add)"),
    "torch_scatter": ("#CC79A7", "torch_scatter.scatter_add"),
    "np_add_at": ("#8C564B", "np.add.at"),
    "ceiling": ("#D55E00", "stream ceiling a += b"),
    # transformers' experts implementations (benchmarks/bench_moe.py)
    "eager": ("#E41A1C", "eager (the model's loop)"),
    "grouped_mm": ("#4DAF4A", "grouped_mm (transformers' default)"),
    "batched_mm": ("#984EA3", "batched_mm"),
}
_FALLBACK = ["#E41A1C", "#377EB8", "#4DAF4A", "#984EA3", "#FF7F00", "#A65628", "#F781BF", "#17BECF"]

# Row width D -> (line style, marker). Solid for the narrowest rows the benchmarks use by default.
D_STYLE = {512: (":", "v"), 1024: ("-.", "^"), 2048: ("-", "o"), 4096: ("--", "s"), 7168: ((0, (5, 1, 1, 1)), "D"),
           8192: ((0, (1, 1)), "P"), 14336: ((0, (3, 1, 1, 1, 1, 1)), "X")}

DTYPE_NAMES = {"bf16": "bfloat16", "f16": "float16", "fp16": "float16", "half": "float16", "f32": "float32",
               "fp32": "float32", "float": "float32", "f64": "float64", "fp64": "float64", "double": "float64"}


def dtype_name(dtype) -> str:
    """Full dtype name for torch dtypes, numpy dtypes and short names alike: 'bfloat16'."""
    s = str(dtype).replace("torch.", "")
    return DTYPE_NAMES.get(s, s)


def method_color(name: str) -> str:
    if name in METHOD_STYLE:
        return METHOD_STYLE[name][0]
    digest = hashlib.sha1(name.encode()).digest()  # stable across runs and peer sets
    return _FALLBACK[digest[0] % len(_FALLBACK)]


def method_label(name: str) -> str:
    return METHOD_STYLE[name][1] if name in METHOD_STYLE else name


def d_style(d: int):
    """(linestyle, marker) for row width d."""
    if d in D_STYLE:
        return D_STYLE[d]
    dashes = [(0, (2, 1 + i % 4)) for i in range(8)]
    return dashes[d % 8], "o"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_info(threads=None, date=None) -> dict:
    """The facts every title carries. threads: the thread count the run used (torch's by default)."""
    import torch

    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "threads": threads or torch.get_num_threads(),
            "torch": torch.__version__, "date": date or time.strftime("%Y-%m-%d")}


def run_title(what: str, info: dict) -> str:
    commit = f", commit {info['commit'][:7]}" if info.get("commit") else ""
    threads = f"{info['threads']} thread" + ("" if info["threads"] == 1 else "s")
    return f"{what}\n{info['cpu']}, {info['cpus']} CPUs, {threads}, torch {info['torch']}, {info['date']}{commit}"


def style():
    plt.rcParams.update({"figure.dpi": 110, "axes.grid": True, "grid.alpha": 0.3, "axes.axisbelow": True,
                         "font.size": 9, "axes.titlesize": 10, "legend.fontsize": 8, "legend.frameon": False})


def figure(nrows=1, ncols=1, width=6.0, height=4.0, **kw):
    """plt.subplots with this style; width and height are per panel, in inches."""
    style()
    return plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False, **kw)


def plain_log_axis(ax, values, axis="x", fmt=None):
    """Log scale with ticks exactly at `values`, labelled plainly (512, 2048, ...)."""
    fmt = fmt or (lambda v: f"{v:g}")
    getattr(ax, f"set_{axis}scale")("log")
    a = ax.xaxis if axis == "x" else ax.yaxis
    a.set_major_locator(FixedLocator(list(values)))
    a.set_major_formatter(FuncFormatter(lambda v, _: fmt(v)))
    a.set_minor_locator(NullLocator())


def speedup_axis(ax, lo, hi, axis="y"):
    """Log speedup axis covering [lo, hi], ticks at 1-2-5 steps labelled 0.5x, 1x, 2x, 5x, 10x..."""
    ticks = [m * 10 ** e for e in range(-2, 4) for m in (1, 2, 5)]
    lo = max([t for t in ticks if t <= min(lo, 1.0)], default=ticks[0])  # a labelled tick below the data
    hi = min([t for t in ticks if t >= max(hi, 1.0)], default=ticks[-1])  # and one above
    plain_log_axis(ax, [t for t in ticks if lo <= t <= hi], axis, fmt=lambda v: f"{v:g}x")
    getattr(ax, f"set_{axis}lim")(lo / 1.1, hi * 1.1)
    (ax.axhline if axis == "y" else ax.axvline)(1.0, color="#444444", lw=1, zorder=1)


def legend_outside(fig, handles, labels, title=None, y=0.5, loc="center left"):
    """A legend to the right of all panels (y: where, in figure height)."""
    return fig.legend(handles, labels, loc=loc, bbox_to_anchor=(1.0, y), title=title, handlelength=3.2)


def method_handles(names, marker="o", linestyle="-"):
    return [Line2D([], [], color=method_color(n), marker=marker, linestyle=linestyle) for n in names]


def d_handles(ds):
    return [Line2D([], [], color="#444444", linestyle=d_style(d)[0], marker=d_style(d)[1]) for d in ds]


def dodged_points(ax, categories, series, log=False, ms=5):
    """A categorical x axis: one slot per category, each method's point offset within the slot so
    that none hide another; no lines join the categories. series: {method: [value or None]}."""
    n = max(len(series), 1)
    width = 0.7
    for j, (name, values) in enumerate(series.items()):
        off = -width / 2 + width * (j + 0.5) / n
        xs = [i + off for i, v in enumerate(values) if v is not None]
        ys = [v for v in values if v is not None]
        ax.plot(xs, ys, linestyle="none", marker="o", ms=ms, color=method_color(name), label=method_label(name))
    ax.set_xticks(range(len(categories)))
    ax.set_xticklabels(categories)
    ax.set_xlim(-0.5, len(categories) - 0.5)
    for i in range(1, len(categories)):
        ax.axvline(i - 0.5, color="#DDDDDD", lw=0.8, zorder=0)
    ax.grid(False, axis="x")
    if log:
        ax.set_yscale("log")


def save(fig, path):
    """Saved with the outside legend inside the image."""
    path = Path(path)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return str(path)


def speedup_heatmap(ax, grid, xlabels, ylabels, lo=0.25, hi=4.0, fmt="{:.1f}"):
    """A grid of speedups (rows = ylabels, cols = xlabels; NaN = not measured) on a fixed scale:
    red below 1x, green above, the same colours for the same value in every plot and run. Each
    cell is written out, so the colour is never the only carrier of the number."""
    import numpy as np
    from matplotlib.colors import LogNorm

    grid = np.asarray(grid, dtype=float)
    im = ax.imshow(grid, origin="lower", aspect="auto", cmap="RdYlGn", norm=LogNorm(vmin=lo, vmax=hi))
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            if not np.isnan(grid[i, j]):
                v = grid[i, j]
                dark = v >= hi / 1.6 or v <= lo * 1.6  # the ends of the scale are dark: white text
                ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=8, color="white" if dark else "black")
    ax.set_xticks(range(len(xlabels)), xlabels)
    ax.set_yticks(range(len(ylabels)), ylabels)
    ax.grid(False)
    return im


def speedup_colorbar(fig, im, axes, label="speedup (x)", lo=0.25, hi=4.0):
    ticks = [t for t in (0.1, 0.25, 0.5, 1, 2, 4, 10) if lo <= t <= hi]
    cb = fig.colorbar(im, ax=axes, shrink=0.8)
    cb.set_ticks(ticks, labels=[f"{t:g}x" for t in ticks])
    cb.minorticks_off()
    cb.set_label(label)
    return cb
