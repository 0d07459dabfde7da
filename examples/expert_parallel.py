"""Expert parallelism for a transformers MoE block (Mixtral's here): each rank holds E / W of the
block's experts and its own tokens; rows travel by all_to_all (scatter_add.distributed.ExpertParallel),
and the rank's experts run as the block's own experts module, cut down to its experts, with
whichever experts implementation it is set to (eager, scatter_add, ...).

    torchrun --nproc_per_node=2 examples/expert_parallel.py      (gloo on CPU; nccl on GPUs)

Two layouts: static capacity (C = ceil(capacity_factor * T * top_k / E) slots per expert; pairs past
an expert's capacity are dropped, in token order; every rank must hold the same token count) and
dropless (every pair is sent). Each is the block's own forward on the same routing, the dropped
pairs' weights set to zero.
"""
import copy
import math
import sys
import time

import torch
from torch import nn


def local_experts(experts: nn.Module, first: int, count: int) -> nn.Module:
    """A copy of a transformers *Experts module that holds experts [first, first + count) only
    (every parameter of such a module is stacked over the experts, biases included)."""
    memo = {}
    for pname, p in experts.named_parameters():
        if p.shape[0] != experts.num_experts:
            raise ValueError(f"{pname} is not stacked over the {experts.num_experts} experts: {tuple(p.shape)}")
        memo[id(p)] = nn.Parameter(p.detach()[first:first + count].clone(), requires_grad=p.requires_grad)
    local = copy.deepcopy(experts, memo)
    local.num_experts = count
    return local


def slot_positions(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T * k]: each pair's place in its expert's queue; pairs queue in token order, then choice
    order."""
    flat = experts.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # expert-major, pair order within an expert
    counts = torch.bincount(flat, minlength=num_experts)
    pos = torch.empty_like(flat)
    pos[order] = torch.arange(flat.numel(), device=flat.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    return pos


def capacity_keep(experts: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """[T, k] bool: whether pair (t, j) gets one of its expert's `capacity` slots."""
    return (slot_positions(experts, num_experts) < capacity).view(experts.shape)


def capacity_slots(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity: int):
    """Static-shape slot tables: slot_token [E*C] (token id, or -1 for an empty slot) and
    slot_weight [E*C] (float32), the pairs of capacity_keep in their slots."""
    t, k = experts.shape
    flat_e = experts.reshape(-1)
    pos = slot_positions(experts, num_experts)
    total = num_experts * capacity
    slot = torch.where(pos < capacity, flat_e * capacity + pos, torch.full_like(pos, total))
    token = torch.arange(t, device=experts.device).repeat_interleave(k)
    slot_token = torch.full((total + 1,), -1, dtype=torch.long, device=experts.device)
    slot_token = slot_token.scatter(0, slot, token)[:total]
    slot_weight = torch.zeros(total + 1, dtype=torch.float32, device=experts.device)
    slot_weight = slot_weight.scatter(0, slot, weights.reshape(-1).float())[:total]
    return slot_token, slot_weight


class ExpertParallelMoE(nn.Module):
    """The rank-local part of a transformers sparse MoE block whose `gate` returns (logits,
    top_k_weights, top_k_index) and whose `experts` is a stacked *Experts module: the router
    (replicated) and this rank's experts."""

    def __init__(self, block: nn.Module, ep, capacity_factor: float = 1.25):
        super().__init__()
        self.ep, self.router, self.capacity_factor = ep, block.gate, capacity_factor
        self.num_experts = block.experts.num_experts
        self.experts = local_experts(block.experts, ep.first_expert, ep.local_experts)
        self.expert_seconds = 0.0

    def capacity(self, tokens: int, top_k: int) -> int:
        return max(1, math.ceil(self.capacity_factor * tokens * top_k / self.num_experts))

    def route(self, x: torch.Tensor):
        """(top_k_weights, top_k_index) of the block's router."""
        _, w, e = self.router(x)
        return w, e

    def run_experts(self, rows: torch.Tensor, counts) -> torch.Tensor:
        """rows [R, H] grouped by local expert, counts[j] rows for expert j: each row through its
        expert by the experts module itself (top-1 routing, weight 1, which multiplies exactly)."""
        t0 = time.perf_counter()
        ids = torch.repeat_interleave(torch.arange(len(counts), device=rows.device),
                                      torch.as_tensor(counts, device=rows.device))
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
        y = self.experts(rows, ids[:, None], ones)
        self.expert_seconds += time.perf_counter() - t0
        return y

    def forward(self, x: torch.Tensor, mode: str = "dropless", routing=None) -> torch.Tensor:
        """x [T, H] -> [T, H]; routing = (weights, experts) [T, k] overrides the router."""
        w, e = routing if routing is not None else self.route(x)
        t, h = x.shape
        if mode == "static":
            slot_token, slot_weight = capacity_slots(e, w, self.num_experts, self.capacity(t, e.shape[1]))
            xe = self.ep.dispatch_static(x, slot_token)  # [E_local, W * C, H]
            y = self.run_experts(xe.reshape(-1, h), [xe.shape[1]] * xe.shape[0])
            return self.ep.combine_static(y.view(xe.shape), slot_token, slot_weight, t)
        if mode != "dropless":
            raise ValueError(f"mode must be 'static' or 'dropless', got {mode!r}")
        rows, state = self.ep.dispatch_dropless(x, e, w)
        return self.ep.combine_dropless(self.run_experts(rows, state.local_counts), state, t)


def mixtral_block(hidden: int, intermediate: int, num_experts: int = 8, top_k: int = 2, dtype=torch.float32,
                  seed: int = 0, experts_implementation: str = "eager"):
    """transformers' MixtralSparseMoeBlock with seeded random weights (the same on every rank)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=intermediate, num_local_experts=num_experts,
                        num_experts_per_tok=top_k)
    cfg._experts_implementation = experts_implementation
    block = MixtralSparseMoeBlock(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return block.to(dtype).eval()


def reference(block: nn.Module, x: torch.Tensor, routing, keep=None) -> torch.Tensor:
    """The block's own experts on this routing in one process; keep [T, k] zeroes dropped pairs."""
    w, e = routing
    if keep is not None:
        w = w * keep
    return block.experts(x, e, w)


if __name__ == "__main__":
    from pathlib import Path

    import kernels
    import torch.distributed as dist

    dist.init_process_group("gloo")
    sa = kernels.get_local_kernel(Path(__file__).resolve().parents[1])
    sa.moe.register()
    torch.set_num_threads(1)
    block = mixtral_block(hidden=128, intermediate=256, dtype=torch.float64)
    layer = ExpertParallelMoE(block, sa.distributed.ExpertParallel(block.experts.num_experts))
    layer.experts.config._experts_implementation = "scatter_add"
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(dist.get_rank()), dtype=torch.float64)
    with torch.no_grad():
        diff = (layer(x, "dropless") - block(x[None])[0]).abs().max().item()
    # One write with its newline: the ranks share stdout, and print's separate writes of the text
    # and the newline can interleave.
    sys.stdout.write(f"rank {dist.get_rank()}: expert-parallel vs single-process max diff {diff:.2e}\n")
    sys.stdout.flush()
    dist.destroy_process_group()
