"""Expert parallelism for the Mixtral-style block of moe_layer.py: each rank holds E / W experts
and its own tokens; rows travel by all_to_all (scatter_add.distributed.ExpertParallel).

    torchrun --nproc_per_node=2 examples/expert_parallel.py      (gloo on CPU; nccl on GPUs)

Static capacity needs the same token count on every rank (C is derived from it); dropless does not.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

from moe_layer import MixtralSparseMoE, capacity_slots


class ExpertParallelMoE(nn.Module):
    """The rank-local part of a MixtralSparseMoE: the router (replicated) and this rank's experts."""

    def __init__(self, full: MixtralSparseMoE, ep):
        super().__init__()
        lo, hi = ep.first_expert, ep.first_expert + ep.local_experts
        self.ep, self.full = ep, full
        self.gate = full.gate
        self.w1, self.w3, self.w2 = (nn.Parameter(p.data[lo:hi].clone()) for p in (full.w1, full.w3, full.w2))
        self.expert_seconds = 0.0

    def experts(self, xe: torch.Tensor) -> torch.Tensor:  # [E_local, rows, H]
        return torch.bmm(F.silu(torch.bmm(xe, self.w1)) * torch.bmm(xe, self.w3), self.w2)

    def forward(self, x: torch.Tensor, mode: str = "static", routing=None) -> torch.Tensor:
        import time

        t = x.shape[0]
        w, e = routing if routing is not None else self.full.route(x)
        if mode == "static":
            slot_token, slot_weight = capacity_slots(e, w, self.full.num_experts, self.full.capacity(t))
            xe = self.ep.dispatch_static(x, slot_token)
            t0 = time.perf_counter()
            y = self.experts(xe)
            self.expert_seconds += time.perf_counter() - t0
            return self.ep.combine_static(y, slot_token, slot_weight, t)
        rows, state = self.ep.dispatch_dropless(x, e, w)
        t0 = time.perf_counter()
        outs, start = [], 0
        for j, n in enumerate(state.local_counts):  # variable rows per expert
            seg = rows[start:start + n]
            outs.append(self.experts_one(j, seg))
            start += n
        y = torch.cat(outs) if outs else rows
        self.expert_seconds += time.perf_counter() - t0
        return self.ep.combine_dropless(y, state, t)

    def experts_one(self, j: int, rows: torch.Tensor) -> torch.Tensor:
        return (F.silu(rows @ self.w1[j]) * (rows @ self.w3[j])) @ self.w2[j]


if __name__ == "__main__":
    from pathlib import Path

    import kernels
    import torch.distributed as dist

    dist.init_process_group("gloo")
    sa = kernels.get_local_kernel(Path(__file__).resolve().parents[1])
    torch.set_num_threads(1)
    full = MixtralSparseMoE(hidden=128, intermediate=256, dtype=torch.float64)
    layer = ExpertParallelMoE(full, sa.distributed.ExpertParallel(full.num_experts))
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(dist.get_rank()), dtype=torch.float64)
    with torch.no_grad():
        diff = (layer(x, "static") - full(x, "native")).abs().max().item()
    # One write with its newline: the ranks share stdout, and print's separate writes of the text
    # and the newline can interleave.
    sys.stdout.write(f"rank {dist.get_rank()}: expert-parallel vs single-process max diff {diff:.2e}\n")
    sys.stdout.flush()
    dist.destroy_process_group()
