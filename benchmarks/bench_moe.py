"""The MoE-layer half of `make bench`: the Mixtral-style block of examples/moe_layer.py compiled
whole with torch.compile, combine (and dispatch) by scatter-add vs native torch, over a sweep of
token counts. Reports layer time both ways, the combine step's share, its speedup, the dispatch
step (our gather vs native indexing) and the max difference between the two outputs."""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from moe_layer import MixtralSparseMoE, combine, dispatch  # noqa: E402


def _median_times(fns, budget=1.5, min_reps=5, max_reps=25):
    """Median seconds of each fn, timed in interleaved rounds (one call of each per round) so that
    this machine's drifting speed hits every variant alike."""
    for f in fns.values():
        f()
    ts = {k: [] for k in fns}
    start = time.perf_counter()
    rounds = 0
    while rounds < min_reps or (time.perf_counter() - start < budget and rounds < max_reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            ts[k].append(time.perf_counter() - t0)
        rounds += 1
    return {k: statistics.median(v) for k, v in ts.items()}


class MoEBench:
    def __init__(self, sa, mixtral=False, quick=False):
        self.sa = sa
        self.hidden, self.inter = (4096, 14336) if mixtral else (1024, 3584)
        self.tokens = [128] if quick else ([256, 1024] if mixtral else [128, 512, 2048])
        self.moe = MixtralSparseMoE(self.hidden, self.inter)

    def run(self, progress_cls):
        sa, moe = self.sa, self.moe
        torch._dynamo.reset()
        # Layer variants: "native" (indexing + index_add_), "ours" (native indexing dispatch, our
        # combine: isolates the combine step) and "ours_both" (our gather and our combine).
        variants = {"native": ("native", "native"), "ours": ("ours", "native"), "ours_both": ("ours", "ours")}
        layer = {name: torch.compile(lambda x, c=c, d=d: moe(x, c, sa, dispatch_impl=d), fullgraph=True)
                 for name, (c, d) in variants.items()}
        comb = {impl: torch.compile(lambda h, st, sw, t, impl=impl: combine(h, st, sw, t, impl, sa), fullgraph=True)
                for impl in ("ours", "native")}
        disp = {impl: torch.compile(lambda x, st, impl=impl: dispatch(x, st, impl, sa), fullgraph=True)
                for impl in ("ours", "native")}
        prog = progress_cls(len(self.tokens), "moe layer")
        rows = []
        with torch.no_grad():
            for t in self.tokens:
                x = torch.randn(t, self.hidden, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
                out = {impl: layer[impl](x) for impl in layer}
                lt = _median_times({impl: (lambda impl=impl: layer[impl](x)) for impl in layer})
                st, sw = moe.plan(x)
                h = moe.experts(dispatch(x, st, "native"))
                ct = _median_times({impl: (lambda impl=impl: comb[impl](h, st, sw, t)) for impl in comb}, budget=0.5)
                dt = _median_times({impl: (lambda impl=impl: disp[impl](x, st)) for impl in disp}, budget=0.5)
                diff = (out["ours"].float() - out["native"].float()).abs().max().item()
                rows.append({
                    "tokens": t, "hidden": self.hidden, "intermediate": self.inter, "experts": moe.num_experts,
                    "top_k": moe.top_k, "capacity_factor": moe.capacity_factor, "capacity": moe.capacity(t),
                    "dtype": "bfloat16",
                    "layer_ms": {k: v * 1e3 for k, v in lt.items()}, "layer_speedup": lt["native"] / lt["ours"],
                    "combine_ms": {k: v * 1e3 for k, v in ct.items()}, "combine_speedup": ct["native"] / ct["ours"],
                    "combine_share": {k: ct[k] / lt[k] for k in ct},
                    "dispatch_ms": {k: v * 1e3 for k, v in dt.items()}, "dispatch_speedup": dt["native"] / dt["ours"],
                    "layer_speedup_both": lt["native"] / lt["ours_both"],
                    "max_abs_diff": diff, "max_abs_out": out["native"].float().abs().max().item(),
                })
                prog.step(f"tokens={t}")
        return rows

    def print_table(self, rows):
        r0 = rows[0]
        print(f"\nMoE layer (Mixtral-style: hidden {r0['hidden']}, intermediate {r0['intermediate']}, "
              f"{r0['experts']} experts, top-{r0['top_k']}, capacity factor {r0['capacity_factor']}, bf16, "
              f"torch.compile fullgraph), combine by ours vs native index_add_")
        print("layer ours = native dispatch + our combine; ours_both = our gather + our combine")
        print(f"{'tokens':>6} {'cap':>5} {'layer ours':>11} {'layer nat':>10} {'speedup':>8} {'ours_both':>10} {'comb ours':>10} "
              f"{'comb nat':>9} {'comb x':>7} {'share ours':>10} {'share nat':>9} {'disp ours':>10} "
              f"{'disp nat':>9} {'max diff':>9}")
        for r in rows:
            print(f"{r['tokens']:>6} {r['capacity']:>5} {r['layer_ms']['ours']:9.2f}ms {r['layer_ms']['native']:8.2f}ms "
                  f"{r['layer_speedup']:7.2f}x {r['layer_speedup_both']:9.2f}x {r['combine_ms']['ours']:8.3f}ms {r['combine_ms']['native']:7.3f}ms "
                  f"{r['combine_speedup']:6.1f}x {100 * r['combine_share']['ours']:9.1f}% "
                  f"{100 * r['combine_share']['native']:8.1f}% {r['dispatch_ms']['ours']:8.3f}ms "
                  f"{r['dispatch_ms']['native']:7.3f}ms {r['max_abs_diff']:9.2e}")
