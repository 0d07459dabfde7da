"""One rank of tests/python/test_distributed.py (launched by torchrun, gloo, loopback only): the
expert-parallel MoE layer against the single-process layer on this rank's tokens, in float64, for
every (mode, case) of CASES in one process group (a launch of torchrun and its ranks' imports cost
several seconds). Writes {"rank", "world", "max_diff", "max_out", "shape"} as JSON to
<out_dir>/<mode>-<case>-rank<r>.json."""
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from expert_parallel import ExpertParallelMoE  # noqa: E402
from moe_layer import MixtralSparseMoE  # noqa: E402


CASES = [("static", "routed"), ("dropless", "routed"), ("static", "one_rank"), ("dropless", "one_rank")]


def run_case(sa, rank, world, mode, case, out_dir):
    hidden, inter, tokens = 48, 96, 40
    cf = 1.0 if mode == "static" else 8.0  # dropless reference: capacity that drops nothing
    full = MixtralSparseMoE(hidden, inter, num_experts=8, top_k=2, capacity_factor=cf, dtype=torch.float64)
    layer = ExpertParallelMoE(full, sa.distributed.ExpertParallel(full.num_experts))
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens + (rank if mode == "dropless" else 0), hidden, generator=g, dtype=torch.float64)
    routing = None
    if case == "one_rank":  # every token to experts 0 and 1, both owned by rank 0
        w = torch.rand(x.shape[0], 2, generator=g)
        routing = (w / w.sum(1, keepdim=True), torch.tensor([[0, 1]]).repeat(x.shape[0], 1))
    with torch.no_grad():
        ours = layer(x, mode, routing=routing)
        ref = full(x, "native", routing=routing)
    result = {"rank": rank, "world": world, "max_diff": (ours - ref).abs().max().item(),
              "max_out": ref.abs().max().item(), "shape": list(ours.shape)}
    Path(out_dir, f"{mode}-{case}-rank{rank}.json").write_text(json.dumps(result))


def main(out_dir: str):
    import kernels

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    sa = kernels.get_local_kernel(ROOT, backend=os.environ.get("SCATTER_ADD_BACKEND") or None)
    for mode, case in CASES:
        run_case(sa, rank, world, mode, case, out_dir)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
