"""The Python API over the per-build ops: thin wrappers, argument checks that only Python can do
(lnc), and autograd registered with torch.library so torch.compile traces through."""
from typing import Optional

import torch

from . import _fake  # noqa: F401  (registers the fake kernels)
from ._ops import add_op_namespace_prefix, ops


def _check_lnc(lnc) -> None:
    # Accepted for source compatibility with the Neuron hub kernel; no effect off Neuron.
    if lnc is None:
        return
    if isinstance(lnc, bool) or not isinstance(lnc, int) or lnc <= 0:
        raise ValueError(f"lnc must be a positive int (logical NeuronCores), got {lnc!r}")


def _check_ignore(ignore_index) -> None:
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
        raise TypeError(f"ignore_index must be an int or None, got {ignore_index!r}")


def scatter_add(
    input: torch.Tensor,
    index: torch.Tensor,
    src: torch.Tensor,
    *,
    weight: Optional[torch.Tensor] = None,
    ignore_index: Optional[int] = None,
    lnc: Optional[int] = None,
) -> torch.Tensor:
    """input[index[i], :] += weight[i] * src[i, :] in place; returns input.

    Duplicate indices are summed exactly in source order (float32 accumulation for bf16/fp16);
    rows whose index equals ignore_index are skipped. On any error input is left untouched.
    """
    _check_lnc(lnc)
    _check_ignore(ignore_index)
    needs_grad = torch.is_grad_enabled() and (
        input.requires_grad or src.requires_grad or (weight is not None and weight.requires_grad)
    )
    if needs_grad:
        # Differentiable in-place update: compute out of place, then copy_ (tracked by autograd).
        return input.copy_(index_add(input, index, src, weight=weight, ignore_index=ignore_index))
    ops.scatter_add_(input, index, src, weight, ignore_index)
    return input


def index_add(
    input: torch.Tensor,
    index: torch.Tensor,
    src: torch.Tensor,
    *,
    weight: Optional[torch.Tensor] = None,
    ignore_index: Optional[int] = None,
) -> torch.Tensor:
    """Out of place: input with src rows (times weight) added at index. Differentiable with
    respect to input, src and weight."""
    _check_ignore(ignore_index)
    return ops.index_add(input, index, src, weight, ignore_index)


def gather(
    input: torch.Tensor,
    index: torch.Tensor,
    *,
    weight: Optional[torch.Tensor] = None,
    ignore_index: Optional[int] = None,
) -> torch.Tensor:
    """Returns [K, D] with row i = weight[i] * input[index[i]]; rows at ignore_index are zero.
    Differentiable; its backward is index_add of the gradient."""
    _check_ignore(ignore_index)
    return ops.gather(input, index, weight, ignore_index)


# --- autograd ------------------------------------------------------------------------------


def _row_dot(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    return (a.to(acc) * b.to(acc)).sum(dim=1).to(dtype)


def _needs(ctx, n):
    # Trailing defaulted arguments may be absent from needs_input_grad: pad with False, and the
    # backward returns only as many gradients as inputs were passed.
    flags = tuple(ctx.needs_input_grad)
    return flags + (False,) * (n - len(flags))


def _index_add_setup(ctx, inputs, output):
    input, index, src, weight, ignore_index = inputs
    ctx.ignore_index = ignore_index
    ctx.has_weight = weight is not None
    ctx.save_for_backward(index, src, weight)


def _index_add_backward(ctx, grad):
    index, src, weight = ctx.saved_tensors
    need_input, _, need_src, need_weight, _ = _needs(ctx, 5)
    grad_input = grad if need_input else None
    grad_src = ops.gather(grad, index, weight, ctx.ignore_index) if need_src else None
    grad_weight = None
    if need_weight and ctx.has_weight:
        picked = ops.gather(grad, index, None, ctx.ignore_index)
        grad_weight = _row_dot(picked, src, weight.dtype)
    return (grad_input, None, grad_src, grad_weight, None)[: len(ctx.needs_input_grad)]


def _gather_setup(ctx, inputs, output):
    input, index, weight, ignore_index = inputs
    ctx.ignore_index = ignore_index
    ctx.has_weight = weight is not None
    ctx.save_for_backward(input, index, weight)


def _gather_backward(ctx, grad):
    input, index, weight = ctx.saved_tensors
    need_input, _, need_weight, _ = _needs(ctx, 4)
    grad_input = None
    if need_input:
        grad_input = ops.index_add(torch.zeros_like(input), index, grad.to(input.dtype), weight, ctx.ignore_index)
    grad_weight = None
    if need_weight and ctx.has_weight:
        picked = ops.gather(input, index, None, ctx.ignore_index)
        grad_weight = _row_dot(picked, grad, weight.dtype)
    return (grad_input, None, grad_weight, None)[: len(ctx.needs_input_grad)]


torch.library.register_autograd(
    add_op_namespace_prefix("index_add"), _index_add_backward, setup_context=_index_add_setup
)
torch.library.register_autograd(
    add_op_namespace_prefix("gather"), _gather_backward, setup_context=_gather_setup
)
