"""One rank of tests/python/test_distributed.py (launched by torchrun, gloo, loopback only): the
expert-parallel layer of examples/expert_parallel.py over transformers' Mixtral block against the
block's own experts in one process on this rank's tokens, in float64, for every (mode, case) of
CASES in one process group (a launch of torchrun and its ranks' imports cost several seconds).
Writes {"rank", "world", "max_diff", "max_out", "shape", "dropped"} as JSON to
<out_dir>/<mode>-<case>-rank<r>.json, and the tensors' use counts after each of a series of
transfers to <out_dir>/transfers-rank<r>.json."""
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from expert_parallel import ExpertParallelMoE, capacity_keep, mixtral_block, reference  # noqa: E402


CASES = [("static", "routed"), ("dropless", "routed"), ("static", "one_rank"), ("dropless", "one_rank")]


def run_case(sa, rank, world, mode, case, out_dir):
    hidden, inter, tokens = 48, 96, 40
    block = mixtral_block(hidden, inter, num_experts=8, top_k=2, dtype=torch.float64)
    # static capacity with factor 1.0 drops pairs whenever the routing is uneven
    layer = ExpertParallelMoE(block, sa.distributed.ExpertParallel(8), capacity_factor=1.0)
    layer.experts.config._experts_implementation = "scatter_add"  # this rank's experts by ours
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens + (rank if mode == "dropless" else 0), hidden, generator=g, dtype=torch.float64)
    if case == "one_rank":  # every token to experts 0 and 1, both owned by rank 0
        w = torch.rand(x.shape[0], 2, generator=g)  # float32, as the router gives
        routing = (w / w.sum(1, keepdim=True), torch.tensor([[0, 1]]).repeat(x.shape[0], 1))
    else:
        routing = layer.route(x)
    keep = None
    if mode == "static":
        keep = capacity_keep(routing[1], 8, layer.capacity(x.shape[0], 2))
    with torch.no_grad():
        ours = layer(x, mode, routing=routing)
        ref = reference(block, x, routing, keep)  # the block's experts module, eager
    result = {"rank": rank, "world": world, "max_diff": (ours - ref).abs().max().item(),
              "max_out": ref.abs().max().item(), "shape": list(ours.shape),
              "dropped": 0 if keep is None else int((~keep).sum())}
    Path(out_dir, f"{mode}-{case}-rank{rank}.json").write_text(json.dumps(result))


def transfers(sa, rank, out_dir):
    """Use counts of each transfer's tensors as the call returns: gloo's worker thread must have let
    go of them by then (else a process that exits right after its last transfer can abort). On the
    default group (init_process_group() with no backend: "cpu:gloo") and on a group made with
    backend="gloo"; and a plain all_reduce run inside distributed.settled()."""
    result = {}
    for name, group in (("default", None), ("named", dist.new_group(backend="gloo"))):
        ep = sa.distributed.ExpertParallel(8, group=group)
        counts = []
        for i in range(30):
            src = torch.full((64, 32), float(i))
            out = ep._all_to_all(src, None, None)
            counts.append([src._use_count(), out._use_count()])
        result[name] = counts
    reduced = []  # a plain all_reduce inside settled(), on the default group
    for i in range(30):
        t = torch.full((256,), float(i))
        with sa.distributed.settled(t):
            dist.all_reduce(t)
        reduced.append([t._use_count(), 1])
    result["settled_all_reduce"] = reduced
    Path(out_dir, f"transfers-rank{rank}.json").write_text(json.dumps(result))


def compiled(sa, rank, out_dir):
    """The static dispatch under torch.compile(fullgraph=True): one graph, the eager rows."""
    ep = sa.distributed.ExpertParallel(8)
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(12, 16, generator=g)
    slot_token = torch.randint(-1, 12, (8 * 3,), generator=g)
    eager = ep.dispatch_static(x, slot_token)
    fn = torch.compile(lambda x, s: ep.dispatch_static(x, s) * 1, backend="eager", fullgraph=True)
    same = bool(torch.equal(fn(x, slot_token), eager))
    Path(out_dir, f"compiled-rank{rank}.json").write_text(json.dumps({"same": same}))


def uneven_static(sa, rank, world, out_dir):
    """Static capacity with a different token count on each rank, or a table of the wrong shape
    on one: a ValueError on every rank."""
    block = mixtral_block(16, 32, num_experts=8, top_k=2, dtype=torch.float64)
    layer = ExpertParallelMoE(block, sa.distributed.ExpertParallel(8), capacity_factor=1.0)
    x = torch.randn(8 + 8 * rank, 16, dtype=torch.float64)
    try:
        with torch.no_grad():
            layer(x, "static")
        message = None
    except ValueError as e:
        message = str(e)
    # a table of the wrong shape on the last rank only: the same error everywhere, nobody waits
    ep = sa.distributed.ExpertParallel(8)
    table = torch.full((8 * 2,), -1)
    try:
        ep.dispatch_static(x, table.view(8, 2) if rank == world - 1 else table)
        shape_message = None
    except ValueError as e:
        shape_message = str(e)
    Path(out_dir, f"uneven-rank{rank}.json").write_text(json.dumps({"error": message, "shape_error": shape_message}))


def main(out_dir: str):
    import kernels

    dist.init_process_group()  # no backend named: gloo on the CPU
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    sa = kernels.get_local_kernel(ROOT, backend=os.environ.get("SCATTER_ADD_BACKEND") or None)
    sa.moe.register()
    for mode, case in CASES:
        run_case(sa, rank, world, mode, case, out_dir)
    transfers(sa, rank, out_dir)
    compiled(sa, rank, out_dir)
    uneven_static(sa, rank, world, out_dir)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
