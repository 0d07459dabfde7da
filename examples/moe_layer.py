"""A Mixtral-style sparse MoE block with static expert capacity, whose dispatch and combine steps
run either on scatter-add (`ours`) or on native torch indexing / index_add_ (`native`).

    router: logits = x @ Wg; p = softmax(logits); top-2 experts per token, weights renormalised
    capacity: C = ceil(capacity_factor * T * top_k / E) slots per expert; overflow tokens dropped,
              empty slots padded with ignore_index = -1 (the static-capacity MoE convention)
    dispatch: xe[e*C + j] = x[slot_token[e*C + j]]           (gather, zero rows for padding)
    experts:  SwiGLU  h = (silu(xe @ W1) * (xe @ W3)) @ W2,  per expert (bmm)
    combine:  y[slot_token[s]] += slot_weight[s] * h[s]      (scatter-add, padding skipped)

This hand-written block is the static-capacity building block of the expert-parallel example
(examples/expert_parallel.py), its test and benchmark. For transformers' own MoE models (Mixtral,
Qwen-MoE, OLMoE, DeepSeek-V3, GPT-OSS) use scatter_add.moe instead: examples/transformers_moe.py;
the MoE-layer benchmark (benchmarks/bench_moe.py) runs those models' code.

Run it: .venv/bin/python examples/moe_layer.py  (loads the built package; prints both outputs' diff)
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -1


def route(logits: torch.Tensor, top_k: int):
    probs = torch.softmax(logits.float(), dim=-1)
    w, e = probs.topk(top_k, dim=-1)
    return w / w.sum(-1, keepdim=True), e


def capacity_slots(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity: int):
    """Static-shape slot tables: slot_token [E*C] (token id or -1) and slot_weight [E*C] (float32).
    Tokens claim slots of their expert in token order; those past the capacity are dropped."""
    t, k = experts.shape
    flat_e = experts.reshape(-1)
    onehot = F.one_hot(flat_e, num_experts)
    pos = (onehot.cumsum(0) - 1).gather(1, flat_e[:, None]).squeeze(1)
    total = num_experts * capacity
    slot = torch.where(pos < capacity, flat_e * capacity + pos, torch.full_like(pos, total))
    token = torch.arange(t, device=experts.device).repeat_interleave(k)
    slot_token = torch.full((total + 1,), IGNORE, dtype=torch.long, device=experts.device)
    slot_token = slot_token.scatter(0, slot, token)[:total]
    slot_weight = torch.zeros(total + 1, dtype=torch.float32, device=experts.device)
    slot_weight = slot_weight.scatter(0, slot, weights.reshape(-1).float())[:total]
    return slot_token, slot_weight


class MixtralSparseMoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int = 8, top_k: int = 2,
                 capacity_factor: float = 1.25, dtype=torch.bfloat16, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.hidden, self.intermediate = hidden, intermediate
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor

        def param(*shape, fan_in):
            return nn.Parameter((torch.randn(*shape, generator=g) / math.sqrt(fan_in)).to(dtype))

        self.gate = param(hidden, num_experts, fan_in=hidden)
        self.w1 = param(num_experts, hidden, intermediate, fan_in=hidden)
        self.w3 = param(num_experts, hidden, intermediate, fan_in=hidden)
        self.w2 = param(num_experts, intermediate, hidden, fan_in=intermediate)

    def capacity(self, tokens: int) -> int:
        return max(1, math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts))

    def route(self, x: torch.Tensor):
        """(weights [T, k] float32, experts [T, k])."""
        return route(x @ self.gate, self.top_k)

    def plan(self, x: torch.Tensor, routing=None):
        w, e = routing if routing is not None else self.route(x)
        return capacity_slots(e, w, self.num_experts, self.capacity(x.shape[0]))

    def experts(self, xe: torch.Tensor) -> torch.Tensor:
        e = self.num_experts
        xe = xe.view(e, -1, self.hidden)
        h = F.silu(torch.bmm(xe, self.w1)) * torch.bmm(xe, self.w3)
        return torch.bmm(h, self.w2).view(-1, self.hidden)

    def forward(self, x: torch.Tensor, impl: str = "ours", sa=None, dispatch_impl: Optional[str] = None,
                routing=None) -> torch.Tensor:
        """impl picks the combine step (and the dispatch step unless dispatch_impl is given);
        routing = (weights, experts) overrides the router."""
        slot_token, slot_weight = self.plan(x, routing)
        xe = dispatch(x, slot_token, dispatch_impl or impl, sa)
        h = self.experts(xe)
        return combine(h, slot_token, slot_weight, x.shape[0], impl, sa)


def dispatch(x, slot_token, impl: str, sa=None):
    if impl == "ours":
        return sa.gather(x, slot_token, ignore_index=IGNORE)
    # native: a zero row appended for padding, then plain indexing
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
    return padded[torch.where(slot_token < 0, x.shape[0], slot_token)]


def combine(h, slot_token, slot_weight, tokens: int, impl: str, sa=None):
    if impl == "ours":
        out = h.new_zeros(tokens, h.shape[1])
        return sa.scatter_add(out, slot_token, h, weight=slot_weight, ignore_index=IGNORE)
    # native: weights multiplied in, padding sent to a dummy row that is sliced off
    out = h.new_zeros(tokens + 1, h.shape[1])
    index = torch.where(slot_token < 0, tokens, slot_token)
    out.index_add_(0, index, h * slot_weight[:, None].to(h.dtype))
    return out[:tokens]


if __name__ == "__main__":
    from pathlib import Path

    import kernels

    sa = kernels.get_local_kernel(Path(__file__).resolve().parents[1])
    moe = MixtralSparseMoE(hidden=256, intermediate=896)
    x = torch.randn(64, 256).to(torch.bfloat16)
    with torch.no_grad():
        a, b = moe(x, "ours", sa), moe(x, "native")
    print(f"tokens 64, hidden 256: max |ours - native| = {(a.float() - b.float()).abs().max():.3e}, "
          f"max |out| = {b.float().abs().max():.3e}")
