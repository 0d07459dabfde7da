#!/usr/bin/env python3
"""The MoE-layer half of `make bench`: transformers' own sparse MoE blocks (the models' code, built
from configs, random weights, bf16) with each experts implementation, side by side.

    blocks:  Mixtral (8 experts, top-2) at hidden 1024 / intermediate 3584 and at Mixtral-8x7B's
             real sizes, hidden 4096 / intermediate 14336 (token counts that fit in memory and
             time only); Qwen3-MoE (128 experts, top-8) at hidden 1024 / intermediate 384
    tokens:  1, 8, 64, 512, 2048, 8192
    modes:   forward (no grad), forward + backward (gradients of the input and every weight)
    columns: eager (the model's own loop), grouped_mm (transformers' default), batched_mm (where its
             per-token copies of the expert weights fit in memory), ours (scatter_add.moe), ours'
             speedup over the best of them, and each one's max error against a float64 reference
             (the same routing, experts computed in float64)
    split:   for ours, the time of dispatch (routing sort + the gathers of each gate group's rows;
             with backward, the one gather and its index_add backward), the expert products (with
             backward, also their gradients of the rows and every expert weight) and combine
             (index_add; with backward, also its gradients of the rows and routing weights), each
             timed alone on the same inputs

Timings: the implementations run in interleaved rounds (one call of each per round, the order
rotated from round to round) so that this machine's drifting speed hits them alike, except batched_mm, timed in rounds of its own after the
others' (its weight copies slow whatever runs next); each cell is the median of the rounds, and
the table says how far the fastest and slowest rounds of ours were from it.

    .venv/bin/python benchmarks/bench_moe.py [--quick | --make-bench] [--blocks mixtral,...] [--threads N] [--cpu-time] [--out DIR]
    .venv/bin/python benchmarks/bench_moe.py --plot-only results/bench_moe.json --out DIR   (redraw only)
"""
import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

IMPLS = ["eager", "grouped_mm", "batched_mm", "ours"]
BUILTINS = ["eager", "grouped_mm", "batched_mm"]
TIMED_ALONE = ["batched_mm"]  # see MoEBench._row
BATCHED_MM_MAX_BYTES = 3 << 30  # batched_mm copies each pair's expert weights: skipped above this
# The eager loop's backward writes a full-size gradient of every expert weight per expert it ran
# (autograd of weight[e]) and sums them: skipped when that traffic would pass this.
EAGER_BACKWARD_MAX_BYTES = 24 << 30
GOALS = {"fwd": (1.0, 1.3, 512), "fwd_bwd": (1.2, 1.2, 0)}  # (everywhere, from tokens on, tokens)

# name: (label, config class, config kwargs, forward token counts, forward+backward token counts)
BLOCKS = {
    "mixtral": ("Mixtral, hidden 1024, intermediate 3584, 8 experts top-2", "MixtralConfig",
                dict(hidden_size=1024, intermediate_size=3584, num_local_experts=8, num_experts_per_tok=2),
                [1, 8, 64, 512, 2048, 8192], [1, 8, 64, 512, 2048, 8192]),
    "qwen3_moe": ("Qwen3-MoE, hidden 1024, intermediate 384, 128 experts top-8", "Qwen3MoeConfig",
                  dict(hidden_size=1024, moe_intermediate_size=384, num_experts=128, num_experts_per_tok=8,
                       norm_topk_prob=True),
                  [1, 8, 64, 512, 2048, 8192], [1, 8, 64, 512, 2048, 8192]),
    # 2.8 GB of bf16 expert weights; a forward at 2048 tokens is ~1.4 TFLOP of products, and the
    # eager loop's backward writes a full-size weight gradient per expert: forward+backward at the
    # small token counts only.
    "mixtral_8x7b": ("Mixtral-8x7B sizes, hidden 4096, intermediate 14336, 8 experts top-2", "MixtralConfig",
                     dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2),
                     [1, 8, 64, 512, 2048], [8, 64]),
}
# `make test`'s smoke run: one block at 8 tokens (at 64, the built-ins' bf16 backward alone took 45
# s of it on a CPU without oneDNN's bf16 products).
QUICK = {"mixtral": ([8], [8])}
# `make bench` (through bench_torch.py): every token count forward; forward+backward at 1, 64, 512
# and 2048 tokens; Mixtral-8x7B's sizes forward at 1 and 512 tokens only; 3 timed rounds (a 0.3 s
# budget; a median of 3 sets aside one disturbed round, which a median of 2 averages in: the 8x7B
# one-token row read 0.83x-0.90x in two runs where ours' rounds spread +-44-56%): the MoE part
# takes a few minutes. bench_moe.py alone runs all of BLOCKS.
MAKE_BENCH = {"mixtral": ([1, 8, 64, 512, 2048, 8192], [1, 64, 512, 2048]),
              "qwen3_moe": ([1, 8, 64, 512, 2048, 8192], [1, 64, 512, 2048]),
              "mixtral_8x7b": ([1, 512], [])}
# the float64 reference covers the first tokens of each input (the same for every row of a block)
REF_TOKENS = {"mixtral": 256, "qwen3_moe": 256, "mixtral_8x7b": 32}


def build_block(name, sa):
    import transformers

    _, cls_name, kw, _, _ = BLOCKS[name]
    cfg = getattr(transformers, cls_name)(**kw)
    cfg._experts_implementation = "eager"
    if cls_name == "MixtralConfig":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 directly: 8x7B's weights are 2.8 GB
    try:
        with torch.device("meta"):
            block = Block(cfg)
        block = block.to_empty(device="cpu")
    finally:
        torch.set_default_dtype(default)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():  # transformers' initializer_range
            p.copy_(torch.empty(p.shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=g))
    return block, cfg


def set_impl(cfg, impl, name):
    cfg._experts_implementation = name if impl == "ours" else impl


def batched_mm_bytes(block, tokens, backward):
    ex = block.experts
    per_pair = (ex.gate_up_proj[0].numel() + ex.down_proj[0].numel()) * ex.gate_up_proj.element_size()
    pairs = tokens * block_top_k(block)
    return per_pair * pairs * (3 if backward else 1)


def block_top_k(block):
    return block.gate.top_k


def eager_backward_bytes(block, tokens):
    ex = block.experts
    active = min(ex.num_experts, tokens * block_top_k(block))
    return 3 * active * (ex.gate_up_proj.numel() + ex.down_proj.numel()) * ex.gate_up_proj.element_size()


def experts_inputs(block, x2d):
    """What the block hands its experts module for the rows x2d: (hidden states, top-k expert ids,
    top-k routing weights), from the block's own routing."""
    seen = []
    hook = block.experts.register_forward_pre_hook(lambda mod, args: seen.append(args))
    with torch.no_grad():
        block(x2d[None])
    hook.remove()
    return seen[0]


def reference(block, x2d):
    """The block's output in float64 for the rows x2d: the block's own bf16 routing (so that near
    ties pick the same experts), every expert product and the combine in float64."""
    ex = block.experts
    h, idx, w = experts_inputs(block, x2d)
    h64, w64 = h.double(), w.double()
    out = torch.zeros(h.shape, dtype=torch.float64)
    act = ex.act_fn
    for e in idx.unique().tolist():
        tok, pos = (idx == e).nonzero(as_tuple=True)
        gu = h64[tok] @ ex.gate_up_proj[e].double().t()
        gate, up = gu.chunk(2, dim=-1)
        y = (act(gate) * up) @ ex.down_proj[e].double().t()
        out.index_add_(0, tok, y * w64[tok, pos, None])
    return out


class Timer:
    """Interleaved rounds: one call of each function per round, each round in the order of the
    last rotated by one (a call that leaves the caches or the allocator worse for the next one
    then slows each of the others alike), until min_rounds are done and the
    budget is spent (or max_rounds). Each function is called once first (warm-up, timed); one
    slower than `slow` seconds keeps that one call as its time and leaves the rounds, and when the
    rounds are slow, min_rounds is where they stop."""

    def __init__(self, budget=2.0, min_rounds=3, max_rounds=15, slow=2.0, clock=time.perf_counter):
        self.budget, self.min_rounds, self.max_rounds, self.slow = budget, min_rounds, max_rounds, slow
        self.clock = clock

    def __call__(self, fns):
        clock = self.clock
        ts = {}
        for k, f in fns.items():
            t0 = clock()
            f()
            ts[k] = [clock() - t0]
        rounds_of = [k for k in fns if ts[k][0] <= self.slow]
        for k in rounds_of:
            ts[k] = []
        start = time.perf_counter()
        rounds = 0
        while rounds_of and (rounds < self.min_rounds or
                             (time.perf_counter() - start < self.budget and rounds < self.max_rounds)):
            turn = rounds % len(rounds_of)  # each round starts one further on: no one always follows the same
            for k in rounds_of[turn:] + rounds_of[:turn]:
                t0 = clock()
                fns[k]()
                ts[k].append(clock() - t0)
            rounds += 1
            if rounds >= self.min_rounds and time.perf_counter() - start > self.budget:
                break
        return ts


def summarize(times):
    med = statistics.median(times)
    return {"ms": med * 1e3, "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3, "rounds": len(times)}


class MoEBench:
    def __init__(self, sa, quick=False, blocks=None, cpu_time=False, sizes=None):
        """cpu_time: time with the calling thread's CPU time instead of the wall clock (one thread
        only): on a machine shared with other work, it leaves out the time slices others take.
        sizes: {block: (forward token counts, forward+backward token counts)} instead of BLOCKS'
        (MAKE_BENCH: the subset `make bench` runs)."""
        self.sizes = {b: v[3:] for b, v in BLOCKS.items()}
        self.sizes.update(QUICK if quick else (sizes or {}))
        self.sa = sa
        self.quick = quick
        self.name = sa.moe.register()
        self.blocks = list(QUICK) if quick else (blocks or list(sizes or BLOCKS))
        if cpu_time and torch.get_num_threads() != 1:
            raise ValueError(f"cpu_time needs 1 thread, got torch.get_num_threads() = {torch.get_num_threads()}")
        self.clock_name = "thread CPU time" if cpu_time else "wall clock"
        clock = time.thread_time if cpu_time else time.perf_counter
        self.timer = (Timer(budget=0.5, min_rounds=2, max_rounds=3, clock=clock) if quick else
                      Timer(budget=0.3, min_rounds=3, clock=clock) if sizes else Timer(clock=clock))
        self.split_timer = (Timer(budget=0.3, min_rounds=3, max_rounds=10, clock=clock) if sizes else
                            Timer(budget=0.5, min_rounds=3, max_rounds=10, clock=clock))
        self.refs = {}

    def plan(self):
        out = []
        for b in self.blocks:
            fwd, fb = self.sizes[b]
            out += [(b, "fwd", t) for t in fwd] + [(b, "fwd_bwd", t) for t in fb]
        return out

    def run(self, progress_cls):
        rows = []
        todo = self.plan()
        prog = progress_cls(len(todo), "moe layer")
        for bname in self.blocks:
            block, cfg = build_block(bname, self.sa)
            hidden = block.experts.gate_up_proj.shape[2]
            cases = [(m, t) for b, m, t in todo if b == bname]
            x_all = torch.randn(max(t for _, t in cases), hidden, generator=torch.Generator().manual_seed(1)).bfloat16()
            for mode, tokens in cases:
                rows.append(self._row(bname, block, cfg, x_all[:tokens], mode))
                prog.step(f"{bname} {mode} tokens={tokens}")
                gc.collect()
            del block
            gc.collect()
        return rows

    def _row(self, bname, block, cfg, x2d, mode):
        tokens = x2d.shape[0]
        backward = mode == "fwd_bwd"
        skipped = {}
        if batched_mm_bytes(block, tokens, backward) > BATCHED_MM_MAX_BYTES:
            skipped["batched_mm"] = (f"(mem) its per-pair copies of the expert weights: "
                                     f"{batched_mm_bytes(block, tokens, backward) / 2**30:.0f} GiB")
        if backward and eager_backward_bytes(block, tokens) > EAGER_BACKWARD_MAX_BYTES:
            skipped["eager"] = (f"(slow) its backward writes a full-size weight gradient per expert: "
                                f"~{eager_backward_bytes(block, tokens) / 2**30:.0f} GiB of memory traffic")
        impls = [i for i in IMPLS if i not in skipped]
        x = x2d[None]
        probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).bfloat16()
        params = list(block.parameters())

        def call(impl):
            def fwd():
                set_impl(cfg, impl, self.name)
                with torch.no_grad():
                    return block(x)

            def fwd_bwd():
                set_impl(cfg, impl, self.name)
                for p in params:
                    p.grad = None
                xg = x.detach().requires_grad_(True)
                block(xg).backward(probe)
                return xg.grad
            return fwd_bwd if backward else fwd

        # accuracy of the forward output against float64, on the first REF_TOKENS rows
        n_ref = min(tokens, REF_TOKENS[bname])
        key = (bname, n_ref)
        if key not in self.refs:
            self.refs[key] = reference(block, x2d[:n_ref])
        ref = self.refs[key]
        errors, same_1t = {}, {}
        threads = torch.get_num_threads()
        for impl in impls:
            set_impl(cfg, impl, self.name)
            seen = []  # the experts' inputs, as the router made them
            hook = block.experts.register_forward_pre_hook(lambda mod, args: seen.append(args))
            with torch.no_grad():
                try:
                    out = block(x2d[:n_ref][None])[0]
                finally:
                    hook.remove()
                # the experts alone at 1 and 2 threads: the router's own products may differ in
                # the last bit between thread counts, which would hide what the experts do
                ys = block.experts(*seen[0])
                torch.set_num_threads(1 if threads != 1 else 2)  # the other of 1 and 2 threads
                try:
                    ys1 = block.experts(*seen[0])
                finally:
                    torch.set_num_threads(threads)
            errors[impl] = float((out.double() - ref).detach().abs().max())
            same_1t[impl] = bool(torch.equal(ys.view(torch.int16), ys1.view(torch.int16)))  # 1 vs 2 threads
        # batched_mm in rounds of its own, after the others': its per-pair copies of the expert
        # weights (up to BATCHED_MM_MAX_BYTES) leave the caches and the allocator to whatever runs
        # next, which made that call slower (Mixtral, 64 tokens, forward, two threads, ours: 13.1
        # ms right after batched_mm, 11.1 ms right after itself), and in interleaved rounds the
        # same implementation always came next.
        ts = self.timer({impl: call(impl) for impl in impls if impl not in TIMED_ALONE})
        for impl in impls:
            if impl in TIMED_ALONE:
                ts.update(self.timer({impl: call(impl)}))
        row = {"block": bname, "label": BLOCKS[bname][0], "mode": mode, "tokens": tokens,
               "experts": block.experts.num_experts, "top_k": block_top_k(block), "dtype": "bfloat16",
               "threads": torch.get_num_threads(), "error_tokens": n_ref,
               "impls": {i: dict(summarize(ts[i]), max_err=errors[i], same_at_1_thread=same_1t[i]) for i in impls},
               "skipped": skipped}
        best = min((i for i in impls if i in BUILTINS), key=lambda i: row["impls"][i]["ms"])
        row["best_builtin"] = best
        row["speedup"] = row["impls"][best]["ms"] / row["impls"]["ours"]["ms"]
        row["speedup_vs"] = {i: row["impls"][i]["ms"] / row["impls"]["ours"]["ms"] for i in impls if i != "ours"}
        row["split_ms"] = self._split(block, cfg, x2d, backward)
        row["products_ms"] = row["split_ms"].pop("products")
        set_impl(cfg, "eager", self.name)
        return row

    def _split(self, block, cfg, x2d, backward=False):
        """Ours in three parts, each timed alone on the block's own routing: forward, or forward and
        backward (the part's gradients of everything the layer's backward asks of it)."""
        moe, sa = self.sa.moe, self.sa
        ex = block.experts
        h, idx, w = experts_inputs(block, x2d)
        e = ex.gate_up_proj.shape[0]
        with torch.no_grad():
            token, order, offsets = moe._route(idx, e)
            xs = sa.gather(h, token, ignore_index=-1)
            ys = moe._experts_loop(xs, offsets, ex.gate_up_proj, None, ex.down_proj, None, False, ex._apply_gate)
            pw = w.reshape(-1)[order]
        width = ex.gate_up_proj.shape[1]
        if backward:
            g = torch.Generator().manual_seed(1)
            probe_xs, probe_ys, probe_out = (torch.randn(t.shape, generator=g).to(t.dtype) for t in (xs, ys, h))
            weights = (ex.gate_up_proj, ex.down_proj)

            def dispatch():  # the training path's one gather, and its backward (an index_add)
                hg = h.detach().requires_grad_(True)
                tk, _, _ = moe._route(idx, e)
                sa.gather(hg, tk, ignore_index=-1).backward(probe_xs)

            def experts():  # the products and gate, and their gradients of the rows and weights
                for p in weights:
                    p.grad = None
                xg = xs.detach().requires_grad_(True)
                moe._Experts.apply(xg, offsets, ex.gate_up_proj, None, ex.down_proj, None, False,
                                   ex._apply_gate, moe._silu_gate(ex)).backward(probe_ys)

            def combine():  # the weighted index_add, and its gradients of the rows and the weights
                yg, pg = ys.detach().requires_grad_(True), pw.detach().requires_grad_(True)
                sa.index_add(h.new_zeros(h.shape), token, yg, weight=pg, ignore_index=-1).backward(probe_out)
        else:
            def dispatch():  # what the forward gathers: each gate group's rows in turn
                tk, _, off = moe._route(idx, e)
                for grp in moe._gate_groups(list(moe._blocks(off)), width):
                    sa.gather(h, tk[grp[0][1]:grp[-1][2]], ignore_index=-1)

            def experts():
                return moe._experts_loop(xs, offsets, ex.gate_up_proj, None, ex.down_proj, None, False, ex._apply_gate)

            def combine():
                return sa.index_add(h.new_zeros(h.shape), token, ys, weight=pw, ignore_index=-1)
        products = self._products(ex, xs, offsets, backward, probe_ys if backward else None)
        with torch.set_grad_enabled(backward):
            ts = self.split_timer({"dispatch": dispatch, "experts": experts, "combine": combine, "products": products})
        for p in block.parameters():
            p.grad = None
        return {k: statistics.median(v) * 1e3 for k, v in ts.items()}

    def _products(self, ex, xs, offsets, backward, probe_ys=None):
        """The matrix products inside ours' experts part, alone (a part of it, not a fourth part):
        ours' expert loop (forward), or its forward and backward, with a gate that computes nothing
        (its output and its gradient of the pre-activations are new tensors of zeros laid out as
        the real gate's: left uninitialised, they made the products 1.5x slower at Qwen3-MoE's 64
        tokens, forward+backward, likely by subnormal values), so that every product runs as in
        the layer (the same calls, groups and layouts, the weight gradients in new memory) and the
        gate's passes do not."""
        moe = self.sa.moe
        w_in, w_out = ex.gate_up_proj, ex.down_proj
        inter = w_out.shape[2]

        class NoGate(torch.autograd.Function):
            @staticmethod
            def forward(ctx, h):
                ctx.h = h
                return torch.zeros_like(h[..., :inter])

            @staticmethod
            def backward(ctx, grad):
                return torch.zeros_like(ctx.h)
        if not backward:
            return lambda: moe._experts_loop(xs, offsets, w_in, None, w_out, None, False, NoGate.apply)

        def run():
            for p in (w_in, w_out):
                p.grad = None
            xg = xs.detach().requires_grad_(True)
            moe._Experts.apply(xg, offsets, w_in, None, w_out, None, False, NoGate.apply, False).backward(probe_ys)
        return run

    def print_table(self, rows):
        print(f"\nMoE layer: transformers' sparse MoE blocks, bf16, {rows[0]['threads']} threads, {self.clock_name}; ms per call "
              f"(median of interleaved rounds, batched_mm's apart); x = ours' speedup over the best built-in; err = max |out - float64| "
              f"on the first 256 tokens (32 at 8x7B sizes) of the forward")
        for bname in dict.fromkeys(r["block"] for r in rows):
            sel = [r for r in rows if r["block"] == bname]
            print(f"\n{sel[0]['label']}")
            print(f"{'mode':>7} {'tokens':>6} | {'eager':>9}  {'grouped':>9}  {'batched':>9}  {'ours':>9}  | {'x best':>7} "
                  f"{'best':>10} | {'ours round':>13} | {'err eager':>9} {'err grp':>8} {'err ours':>8} | {'det':>5} | "
                  f"{'dispatch':>8} {'experts':>8} {'combine':>8} {'products':>8}")
            for r in sel:
                im = r["impls"]

                def cell(i):
                    if i not in im:
                        return f"{r['skipped'][i].split()[0]:>9} "
                    return f"{im[i]['ms']:9.2f}" + ("*" if im[i]["rounds"] == 1 else " ")
                o = im["ours"]
                spread = f"{o['min_ms'] / o['ms'] - 1:+.0%}/{o['max_ms'] / o['ms'] - 1:+.0%}"
                split = ""
                if "split_ms" in r:
                    s = r["split_ms"]
                    split = f"{s['dispatch']:8.2f} {s['experts']:8.2f} {s['combine']:8.2f} " + (
                        f"{r['products_ms']:8.2f}" if "products_ms" in r else f"{'-':>8}")
                det = "".join(("y" if im[i]["same_at_1_thread"] else "n") if i in im else "-"
                              for i in ("eager", "grouped_mm", "ours"))

                def err(i):
                    return f"{im[i]['max_err']:.2e}" if i in im else "-"
                print(f"{r['mode']:>7} {r['tokens']:>6} | {cell('eager')} {cell('grouped_mm')} {cell('batched_mm')} "
                      f"{cell('ours')} | {r['speedup']:6.2f}x {r['best_builtin']:>10} | {spread:>13} | "
                      f"{err('eager'):>9} {err('grouped_mm'):>8} {o['max_err']:8.2e} | {det:>5} | {split}")
        print("\n(mem) = batched_mm skipped: its per-pair copies of the expert weights would exceed 3 GiB. "
              "(slow) = eager's forward+backward skipped: it writes a full-size gradient of the expert weights per "
              "expert it runs, over 24 GiB of memory traffic here. * = one call (a call over 2 s is timed once). "
              "ours round = fastest/slowest round of ours against its median. det = the experts' output on the error "
              "tokens (the router's output held) bitwise the same at 1 and 2 threads (eager, grouped_mm, ours: y/n; where "
              "n, torch's expert products differ). dispatch/experts/combine = ours' time in three parts, each timed alone (ms; "
              "forward+backward rows: each part's forward and backward). products = the matrix products within experts, "
              "timed alone: the same experts part with a gate that computes nothing (its output, and its gradient, zeros "
              "laid out as the gate's), every product as in the layer. forward+backward: ours writes each expert weight's "
              "gradient into a buffer it keeps for that weight (SCATTER_ADD_MOE_KEEP_GRADS=0 turns that off); the "
              "built-ins' gradients take new memory, unless glibc is told to keep freed memory (MALLOC_MMAP_THRESHOLD_, "
              "MALLOC_TRIM_THRESHOLD_: see the README).")
        self.print_goals(rows)

    @staticmethod
    def print_goals(rows):
        for mode, (everywhere, high, from_tokens) in GOALS.items():
            sel = [r for r in rows if r["mode"] == mode]
            if not sel:
                continue
            low = min(sel, key=lambda r: r["speedup"])
            line = f"goal {mode}: >= {everywhere}x everywhere: min {low['speedup']:.2f}x ({low['block']}, {low['tokens']} tokens)"
            big = [r for r in sel if r["tokens"] >= from_tokens]
            if from_tokens and big:
                lowb = min(big, key=lambda r: r["speedup"])
                line += f"; >= {high}x from {from_tokens} tokens: min {lowb['speedup']:.2f}x ({lowb['block']}, {lowb['tokens']} tokens)"
            print(line)
            short = [r for r in sel if "products_ms" in r and r["speedup"] < (high if r["tokens"] >= from_tokens else everywhere)]
            if short:
                print("  rows below it, the matrix products' share of ours' split: " + ", ".join(
                    f"{r['block']} {r['tokens']} {r['products_ms'] / sum(r['split_ms'].values()):.0%}" for r in short))


# transformers' experts implementations take their colours from plotting.METHOD_STYLE
MODE_STYLE = {"fwd": ("-", "o", "forward (no grad)"), "fwd_bwd": ("--", "s", "forward + backward")}
SPLIT_COLORS = {"dispatch": "#56B4E9", "products": "#999999", "gate": "#DDDDDD", "combine": "#E69F00"}
SPLIT_LABELS = ["dispatch: routing sort + gather", "expert products (matmuls), timed alone",
                "the rest of the experts part (gate)", "combine: weighted index_add"]


def split_part(r, part):
    """ms of a bar's part: the experts part as its products (timed alone, at most the part) and the
    rest; a row without the products' time shows the whole part as products."""
    s = r["split_ms"]
    products = min(r.get("products_ms", s["experts"]), s["experts"])
    return {"products": products, "gate": s["experts"] - products}.get(part, s.get(part))


def plot_moe(rows, out_dir, info, path_name="moe_layer_transformers.png"):
    """Top row: ours' speedup over each built-in experts implementation against tokens, one panel
    per block (colour = implementation, line style = forward or forward+backward; dotted: the 1.3x
    goal). Lower rows: where ours' time goes, forward and forward+backward (dispatch, the expert
    products timed alone, the rest of the experts part, combine), as shares of the three parts'
    sum. info: plotting.run_info()'s facts of the run. Rows of another format (a saved bench.json
    from before) are left out."""
    rows = [r for r in rows if "speedup_vs" in r]
    if not rows:
        return []
    try:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import plotting
        from matplotlib.patches import Patch
    except Exception as e:  # noqa: BLE001
        print(f"moe plot skipped: {e}")
        return []

    def color(impl):
        return plotting.method_color(impl)

    blocks = list(dict.fromkeys(r["block"] for r in rows))
    split_modes = [m for m in MODE_STYLE if any("split_ms" in r and r["mode"] == m for r in rows)]
    has_split = bool(split_modes)
    fig, axes = plotting.figure(1 + len(split_modes), len(blocks), width=4.6, height=3.6)
    speedups = [v for r in rows for v in r["speedup_vs"].values()]
    impls_seen = []
    for j, bname in enumerate(blocks):
        ax = axes[0][j]
        sel = [r for r in rows if r["block"] == bname]
        for mode, (ls, marker, _) in MODE_STYLE.items():
            pts = sorted((r for r in sel if r["mode"] == mode), key=lambda r: r["tokens"])
            for impl in BUILTINS:
                xy = [(r["tokens"], r["speedup_vs"][impl]) for r in pts if impl in r["speedup_vs"]]
                if xy:
                    ax.plot(*zip(*xy), linestyle=ls, marker=marker, ms=4, lw=1.3, color=color(impl))
                    impls_seen += [impl] if impl not in impls_seen else []
        ns = sorted({r["tokens"] for r in sel})
        plotting.plain_log_axis(ax, ns, "x", fmt=lambda v: f"{v:.0f}")
        ax.set_xlim(ns[0] / 1.6, ns[-1] * 1.6)
        plotting.speedup_axis(ax, min(speedups), max(speedups))
        ax.axhline(1.3, color="#444444", lw=1, linestyle=":", zorder=1)
        ax.set_title(BLOCKS[bname][0].replace(", ", "\n", 1) if bname in BLOCKS else bname)
        ax.set_xlabel("tokens")
        if j == 0:
            ax.set_ylabel("speedup of ours over the built-in (x, log)\nabove 1x: ours is faster")
        for si, mode in enumerate(split_modes):
            bx = axes[1 + si][j]
            fw = sorted((r for r in sel if "split_ms" in r and r["mode"] == mode), key=lambda r: r["tokens"])
            if not fw:
                bx.axis("off")
                bx.text(0.5, 0.5, f"no {MODE_STYLE[mode][2]} rows in this run", ha="center", va="center",
                        transform=bx.transAxes, fontsize=9, color="#666666")
                continue
            bottom = [0.0] * len(fw)
            for part, c in SPLIT_COLORS.items():
                share = [split_part(r, part) / sum(r["split_ms"].values()) * 100 for r in fw]
                bx.bar(range(len(fw)), share, bottom=bottom, color=c, width=0.7, edgecolor="white", lw=0.5)
                bottom = [b + v for b, v in zip(bottom, share)]
            bx.set_xticks(range(len(fw)), [str(r["tokens"]) for r in fw])
            bx.set_ylim(0, 100)
            bx.grid(False, axis="x")
            bx.set_xlabel(f"tokens ({MODE_STYLE[mode][2]})")
            if j == 0:
                bx.set_ylabel(f"share of ours' {MODE_STYLE[mode][2]} (%)")
            for i, r in enumerate(fw):
                bx.text(i, 101, f"{sum(r['split_ms'].values()):.{0 if sum(r['split_ms'].values()) >= 100 else 1}f} ms", ha="center", va="bottom", fontsize=7)
    leg = plotting.legend_outside(fig, [plotting.Line2D([], [], color=color(i), lw=1.3) for i in impls_seen],
                                  [f"vs {plotting.method_label(i)}" for i in impls_seen],
                                  title="built-in (colour)", y=0.85 if has_split else 0.7, loc="upper left")
    fig.add_artist(leg)
    handles = [plotting.Line2D([], [], color="#444444", linestyle=ls, marker=m) for ls, m, _ in MODE_STYLE.values()]
    handles.append(plotting.Line2D([], [], color="#444444", linestyle=":"))
    labels = [lab for _, _, lab in MODE_STYLE.values()] + ["the 1.3x goal (forward, 512+ tokens)"]
    leg = plotting.legend_outside(fig, handles, labels, title="mode (line style)", y=0.62 if has_split else 0.3,
                                  loc="upper left")
    if has_split:
        fig.add_artist(leg)
        plotting.legend_outside(fig, [Patch(color=c) for c in SPLIT_COLORS.values()], SPLIT_LABELS,
                                title="ours' time (bars)", y=0.35, loc="upper left")
    clock = f", timed by {info['clock']}" if info.get("clock") else ""
    fig.suptitle(plotting.run_title("transformers' MoE blocks, bfloat16: scatter_add.moe against each built-in "
                                    f"experts implementation{clock}", info), y=1.02)
    fig.tight_layout()
    return [plotting.save(fig, Path(out_dir) / path_name)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--blocks", default=None, help="comma-separated: " + ", ".join(BLOCKS))
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--cpu-time", action="store_true", help="time by the thread's CPU time (needs --threads 1)")
    ap.add_argument("--make-bench", action="store_true", help="the subset `make bench` runs (MAKE_BENCH)")
    ap.add_argument("--plot-only", metavar="BENCH_MOE_JSON",
                    help="measure nothing: print the tables and redraw the plot of a saved bench_moe.json into --out")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plotting
    from bench_torch import Progress, git_commit, load_ours

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.plot_only:
        saved = json.loads(Path(args.plot_only).read_text())
        bench = MoEBench.__new__(MoEBench)
        bench.clock_name = saved["info"].get("clock", "wall clock")
        bench.print_table(saved["rows"])
        files = plot_moe(saved["rows"], out_dir, saved["info"])
        print(f"\nwrote {len(files)} plot(s) from {args.plot_only}")
        return
    bench = MoEBench(load_ours(), quick=args.quick, blocks=args.blocks.split(",") if args.blocks else None,
                     cpu_time=args.cpu_time, sizes=MAKE_BENCH if args.make_bench else None)
    t0 = time.time()
    rows = bench.run(Progress)
    bench.print_table(rows)
    info = dict(plotting.run_info(), commit=git_commit(), clock=bench.clock_name)
    files = plot_moe(rows, out_dir, info)
    (out_dir / "bench_moe.json").write_text(json.dumps({"info": info, "rows": rows,
                                                        "wall_s": time.time() - t0}, indent=1))
    print(f"\nwrote {out_dir / 'bench_moe.json'} and {len(files)} plot(s) in {time.time() - t0:.0f} s")

if __name__ == "__main__":
    main()
