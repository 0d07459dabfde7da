"""An experts implementation for Hugging Face transformers' MoE models (Mixtral, Qwen2/3-MoE, OLMoE,
DeepSeek-V3, GPT-OSS and every other model whose experts module uses
`@use_experts_implementation`).

    from scatter_add import moe
    moe.register()                                   # -> "scatter_add"
    model.set_experts_implementation("scatter_add")  # or experts_implementation="scatter_add"

The layer, for S = T * top_k (token, expert) pairs:

    route:    the pairs sorted by expert (stable: token order within an expert), per-expert offsets
    dispatch: xs = gather(hidden_states, token_of_pair)             one contiguous block per expert
    experts:  h = xs @ gate_up_proj[e] (+ bias), act = gate(h), y = act @ down_proj[e] (+ bias),
              each on its expert's block of rows (expert ids >= num_experts, the expert-parallel
              sentinels, get no rows of compute and are skipped by ignore_index below)
    combine:  out = index_add(zeros, token_of_pair, y, weight=routing_weight_of_pair)
              routing weights fused, float32 accumulation, one rounding per output element

Autograd flows through every step (the grouped products are ops with their own backward), so
training works; the result is bitwise the same for every thread count. torch.compile traces the
whole function into one graph. transformers is imported only by `register`.
"""
from typing import List, Optional

import torch
import torch.nn.functional as F

from ._api import gather, index_add
from ._ops import add_op_namespace_prefix

__all__ = ["experts_forward", "register", "NAME"]

NAME = "scatter_add"
_IGNORE = -1


# --- the grouped product: y[rows of e] = x[rows of e] @ W[e] (+ b[e]) -----------------------------
#
# An op of its own (opaque to torch.compile, like transformers' grouped_mm fallback) because its
# loop bounds are data-dependent. offsets[e] is the end row of expert e; rows from offsets[-1] on
# belong to no expert and come out zero.


def _bounds(offsets: torch.Tensor) -> List[int]:
    return offsets.tolist()  # the one host sync of the op


def _expert_weight(weight: torch.Tensor, e: int, transposed: bool) -> torch.Tensor:
    # not transposed: weight is [E, out, in]; transposed: [E, in, out]. Returns [in, out].
    return weight[e] if transposed else weight[e].t()


def _grouped_linear_impl(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                         bias: Optional[torch.Tensor], transposed: bool) -> torch.Tensor:
    n_out = weight.shape[2] if transposed else weight.shape[1]
    out = x.new_empty(x.shape[0], n_out)
    start = 0
    for e, end in enumerate(_bounds(offsets)):
        if end > start:
            rows = out[start:end]
            if bias is None:
                torch.mm(x[start:end], _expert_weight(weight, e, transposed), out=rows)
            else:
                torch.addmm(bias[e], x[start:end], _expert_weight(weight, e, transposed), out=rows)
        start = end
    out[start:].zero_()
    return out


def _grouped_linear_fake(x, weight, offsets, bias, transposed):
    n_out = weight.shape[2] if transposed else weight.shape[1]
    return x.new_empty(x.shape[0], n_out)


def _grouped_linear_backward_impl(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                  offsets: torch.Tensor, has_bias: bool, transposed: bool,
                                  need_x: bool, need_weight: bool) -> List[torch.Tensor]:
    grad = grad.to(x.dtype)
    n_out = weight.shape[2] if transposed else weight.shape[1]
    grad_x = torch.zeros_like(x) if need_x else x.new_empty(0)
    grad_w = torch.zeros_like(weight) if need_weight else weight.new_empty(0)
    grad_b = weight.new_zeros(weight.shape[0], n_out) if (need_weight and has_bias) else weight.new_empty(0)
    start = 0
    for e, end in enumerate(_bounds(offsets)):
        if end > start:
            g, xe = grad[start:end], x[start:end]
            w = _expert_weight(weight, e, transposed)  # [in, out]
            if need_x:
                torch.mm(g, w.t(), out=grad_x[start:end])
            if need_weight:
                if transposed:
                    torch.mm(xe.t(), g, out=grad_w[e])
                else:
                    torch.mm(g.t(), xe, out=grad_w[e])
                if has_bias:
                    grad_b[e] = g.sum(0, dtype=torch.float32)
        start = end
    return [grad_x, grad_w, grad_b]


def _grouped_linear_backward_fake(grad, x, weight, offsets, has_bias, transposed, need_x, need_weight):
    n_out = weight.shape[2] if transposed else weight.shape[1]
    return [torch.empty_like(x) if need_x else x.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0),
            weight.new_empty(weight.shape[0], n_out) if (need_weight and has_bias) else weight.new_empty(0)]


def _define(name, fn, fake, schema):
    """Defines op `name` in this build's namespace once per process (the package may be imported
    under more than one module name)."""
    qualified = add_op_namespace_prefix(name)
    ns, short = qualified.split("::")
    existing = getattr(getattr(torch.ops, ns), short, None) if _has_op(ns, short) else None
    if existing is not None:
        return existing, False
    torch.library.custom_op(qualified, fn, mutates_args=(), schema=schema)
    torch.library.register_fake(qualified, fake)
    return getattr(getattr(torch.ops, ns), short), True


def _has_op(ns, short):
    try:
        getattr(getattr(torch.ops, ns), short)
        return True
    except (AttributeError, RuntimeError):
        return False


_grouped_linear, _fresh = _define(
    "moe_grouped_linear", _grouped_linear_impl, _grouped_linear_fake,
    "(Tensor x, Tensor weight, Tensor offsets, Tensor? bias, bool transposed) -> Tensor")
_grouped_linear_backward, _ = _define(
    "moe_grouped_linear_backward", _grouped_linear_backward_impl, _grouped_linear_backward_fake,
    "(Tensor grad, Tensor x, Tensor weight, Tensor offsets, bool has_bias, bool transposed, "
    "bool need_x, bool need_weight) -> Tensor[]")


def _setup(ctx, inputs, output):
    x, weight, offsets, bias, transposed = inputs
    ctx.save_for_backward(x, weight, offsets)
    ctx.has_bias = bias is not None
    ctx.transposed = transposed


def _backward(ctx, grad):
    x, weight, offsets = ctx.saved_tensors
    need_x, need_w, _, need_b = ctx.needs_input_grad[:4]
    grad_x, grad_w, grad_b = _grouped_linear_backward(
        grad, x, weight, offsets, ctx.has_bias, ctx.transposed, need_x, need_w or need_b)
    return (grad_x if need_x else None, grad_w if need_w else None, None,
            grad_b.to(weight.dtype) if need_b else None, None)


if _fresh:
    torch.library.register_autograd(add_op_namespace_prefix("moe_grouped_linear"), _backward, setup_context=_setup)


# --- the experts function -------------------------------------------------------------------------


def _route(top_k_index: torch.Tensor, num_experts: int):
    """(token of each pair in expert order with -1 for sentinels, the sort order, end offset of
    each expert's rows)."""
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    expert_sorted, order = torch.sort(flat, stable=True)
    if flat.numel() and not torch.compiler.is_compiling():
        low = int(expert_sorted[0])
        if low < 0:
            raise ValueError(f"top_k_index must hold expert ids >= 0, got {low}")
    token = torch.div(order, k, rounding_mode="floor")
    token = torch.where(expert_sorted < num_experts, token, torch.full_like(token, _IGNORE))
    bounds = torch.arange(1, num_experts + 1, device=flat.device, dtype=flat.dtype)
    offsets = torch.searchsorted(expert_sorted, bounds, right=False)
    return token, order, offsets


def _check_inputs(hidden_states, top_k_index, top_k_weights) -> None:
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be 2-D (tokens, hidden), got shape {tuple(hidden_states.shape)}")
    if top_k_index.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"top_k_index must be int64 or int32, got {top_k_index.dtype}")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"top_k_index must have shape (tokens, top_k) with tokens = {hidden_states.shape[0]}, "
                         f"got shape {tuple(top_k_index.shape)}")
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"top_k_weights must have the shape of top_k_index {tuple(top_k_index.shape)}, "
                         f"got shape {tuple(top_k_weights.shape)}")
    if not top_k_weights.is_floating_point():
        raise TypeError(f"top_k_weights must be a float tensor, got {top_k_weights.dtype}")


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The `ExpertsInterface` function: (T, H) hidden states, (T, K) expert ids and routing
    weights -> (T, H) in hidden_states.dtype."""
    _check_inputs(hidden_states, top_k_index, top_k_weights)
    weight_in = self.gate_up_proj if self.has_gate else self.up_proj
    bias_in = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    bias_out = self.down_proj_bias if self.has_bias else None
    num_experts = weight_in.shape[0]

    with torch.no_grad():
        token, order, offsets = _route(top_k_index, num_experts)
    pair_weight = top_k_weights.reshape(-1)[order]

    xs = gather(hidden_states, token, ignore_index=_IGNORE).to(weight_in.dtype)
    h = _grouped_linear(xs, weight_in, offsets, bias_in, self.is_transposed)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    y = _grouped_linear(h, self.down_proj, offsets, bias_out, self.is_transposed)
    if self.has_post_expert_norm:
        y = self.post_expert_norm(y)
    out = hidden_states.new_zeros(hidden_states.shape)
    return index_add(out, token, y.to(hidden_states.dtype), weight=pair_weight, ignore_index=_IGNORE)


def register(name: str = NAME) -> str:
    """Adds `experts_forward` to transformers' ExpertsInterface under `name`; returns `name`."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, experts_forward)
    return name
