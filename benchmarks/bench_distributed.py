"""The expert-parallel line of `make bench`: transformers' Mixtral sparse MoE block split over W
ranks (examples/expert_parallel.py; gloo, loopback, one thread per rank; each rank's experts by
scatter_add.moe), time per layer and its split into dispatch (local gathers), experts,
communication (all_to_all) and combine (index_add), for static capacity and dropless.

    .venv/bin/python -m torch.distributed.run --nproc_per_node=2 benchmarks/bench_distributed.py OUT.json [--quick]
Rank 0 writes the figures (max over ranks of each phase, median over iterations) to OUT.json.
"""
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from expert_parallel import ExpertParallelMoE, mixtral_block  # noqa: E402


def main():
    import kernels

    out_path = sys.argv[1]
    quick = "--quick" in sys.argv
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    sa = kernels.get_local_kernel(ROOT)
    sa.moe.register()
    hidden, inter, tokens = (256, 512, 64) if quick else (1024, 3584, 512)
    iters = 2 if quick else 5
    dtype = torch.bfloat16  # the models' dtype; gloo moves bf16 rows
    block = mixtral_block(hidden, inter, dtype=dtype)
    results = {"world": world, "hidden": hidden, "intermediate": inter, "tokens_per_rank": tokens,
               "dtype": str(dtype).replace("torch.", ""), "modes": {}}
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(rank)).to(dtype)
    for mode in ("static", "dropless"):
        ep = sa.distributed.ExpertParallel(block.experts.num_experts, profile=True)
        layer = ExpertParallelMoE(block, ep)
        layer.experts.config._experts_implementation = "scatter_add"
        samples = []
        with torch.no_grad():
            layer(x, mode)  # warm-up
            for _ in range(iters):
                ep.timings = {k: 0.0 for k in ep.timings}
                layer.expert_seconds = 0.0
                dist.barrier()
                t0 = time.perf_counter()
                layer(x, mode)
                total = time.perf_counter() - t0
                phases = torch.tensor([total, ep.timings["dispatch"], layer.expert_seconds,
                                       ep.timings["communication"], ep.timings["combine"]], dtype=torch.float64)
                with sa.distributed.settled(phases):  # the last collective before the process ends
                    dist.all_reduce(phases, op=dist.ReduceOp.MAX)
                samples.append(phases.tolist())
        med = [statistics.median(s[i] for s in samples) * 1e3 for i in range(5)]
        results["modes"][mode] = dict(zip(["layer_ms", "dispatch_ms", "experts_ms", "communication_ms", "combine_ms"], med))
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
