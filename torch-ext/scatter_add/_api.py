"""The Python API over the per-build ops.

Each function makes one kernel call on the success path. Errors are sorted out only after a call
fails: a non-tensor argument gives TypeError naming it, a shape / dtype / device problem gives the
ValueError of the shared checks (the same ones the fake kernels run under torch.compile), and the
kernel's own error is raised as the exception its message names (see docs/errors.md).
"""
from typing import Optional

import torch

from . import _fake  # noqa: F401  (registers the fake kernels)
from . import _autograd  # noqa: F401  (registers scatter_add_'s ADInplaceOrView kernel)
from ._checks import check_args, check_types, ignore_index_arg, lnc_arg, typed_error
from ._ops import add_op_namespace_prefix, ops

_scatter_add_ = ops.scatter_add_.default
_index_add = ops.index_add.default
_gather = ops.gather.default
# The same op without OpOverload's Python frame, for the eager fast path below.
_scatter_add_eager = getattr(_scatter_add_, "_op", _scatter_add_)

_grad_enabled = torch.is_grad_enabled
_compiling = torch.compiler.is_compiling
_increment_version = torch._C._increment_version
_BelowADInplaceOrView = torch._C._AutoDispatchBelowADInplaceOrView


_NO_SRC = object()


def _raise(op: str, e: Exception, input, index, src, weight):
    """Raises the error a failed call reports to the user (always raises)."""
    if src is _NO_SRC:
        check_types(op, input=input, index=index, weight=weight)
        src = None
    else:
        check_types(op, input=input, index=index, src=src, weight=weight)
    try:
        check_args(op, input, index, src, weight)
    except RuntimeError as checked:
        e = checked
    typed = typed_error(op, e)
    if typed is None:
        raise e
    raise typed from None


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

    input [N, D] and src [K, D] float32, float64, bfloat16 or float16 (the same dtype); index [K]
    int32 or int64; weight [K] float32, float64, bfloat16 or float16, or None. Duplicate indices
    are summed exactly in source order (float32 accumulation for bf16/fp16); rows whose index
    equals ignore_index are skipped. On any error input is left untouched. lnc is accepted for
    compatibility with the Neuron hub kernel and has no effect here.

    Like torch's own in-place ops, this bumps input's version counter (autograd then refuses a
    saved tensor modified afterwards) and refuses an inference tensor outside inference_mode.
    With autograd recording (input, src or weight requires grad), the update is differentiable.
    """
    if lnc is not None:
        lnc_arg("scatter_add", lnc)
    if ignore_index is not None:
        ignore_index = ignore_index_arg("scatter_add", ignore_index)
    try:
        if _grad_enabled() and (input.requires_grad or src.requires_grad or (weight is not None and weight.requires_grad)):
            # Differentiable in-place update: computed out of place, then copy_ (tracked by autograd).
            return input.copy_(_index_add(input, index, src, weight, ignore_index))
        if _compiling() or input.is_inference():
            # Through the op's ADInplaceOrView kernel (inference-tensor check, version bump).
            _scatter_add_(input, index, src, weight, ignore_index)
        else:
            # That kernel inlined: nothing to check for a normal tensor, and the version bump
            # here costs a fraction of a Python kernel's dispatch.
            with _BelowADInplaceOrView():
                _scatter_add_eager(input, index, src, weight, ignore_index)
            _increment_version((input,))
    except Exception as e:
        _raise("scatter_add", e, input, index, src, weight)
    return input


def index_add(
    input: torch.Tensor,
    index: torch.Tensor,
    src: torch.Tensor,
    *,
    weight: Optional[torch.Tensor] = None,
    ignore_index: Optional[int] = None,
) -> torch.Tensor:
    """Out of place: a new contiguous tensor, input with weight[i] * src[i, :] added to row
    index[i]. The same arguments as scatter_add. Differentiable with respect to input, src and
    weight."""
    if ignore_index is not None:
        ignore_index = ignore_index_arg("index_add", ignore_index)
    try:
        return _index_add(input, index, src, weight, ignore_index)
    except Exception as e:
        _raise("index_add", e, input, index, src, weight)


def gather(
    input: torch.Tensor,
    index: torch.Tensor,
    *,
    weight: Optional[torch.Tensor] = None,
    ignore_index: Optional[int] = None,
) -> torch.Tensor:
    """Returns [K, D] with row i = weight[i] * input[index[i]]; rows at ignore_index are zero.
    Differentiable with respect to input and weight (its backward is index_add of the gradient)."""
    if ignore_index is not None:
        ignore_index = ignore_index_arg("gather", ignore_index)
    try:
        return _gather(input, index, weight, ignore_index)
    except Exception as e:
        _raise("gather", e, input, index, _NO_SRC, weight)


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
