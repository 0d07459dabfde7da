"""The Python API over the per-build ops.

Each function makes one kernel call on the success path. Errors are sorted out only after a call
fails: a non-tensor argument gives TypeError naming it, a shape / dtype / device problem gives the
ValueError of the shared checks (the same ones the fake kernels run under torch.compile), and the
kernel's own error is raised as the exception its message names (see docs/errors.md).
"""
from typing import Optional

import torch

from . import _fake  # noqa: F401  (registers the fake kernels)
from ._autograd import _forward_ad
from ._checks import check_args, check_types, ignore_index_arg, lnc_arg, typed_error
from ._ops import ops

_scatter_add_ = ops.scatter_add_.default
_index_add = ops.index_add.default
_gather = ops.gather.default


def _eager(overload):
    """The op without OpOverload's Python frame, for the eager fast paths below."""
    return getattr(overload, "_op", overload)


# Under a functorch transform (vmap, grad, ...), a dispatch mode or torch.jit.trace: the ops below
# their autograd kernels, which keeps their batching rules and what a tracer records.
_scatter_add_eager = _eager(_scatter_add_)
_index_add_eager = _eager(_index_add)
_gather_eager = _eager(_gather)
# Otherwise: the plain twins, the same kernels with nothing registered above the backend, so
# that a call with nothing to record needs no dispatch-key guard.
_scatter_add_plain = _eager(ops.scatter_add_plain_.default)
_index_add_plain = _eager(ops.index_add_plain.default)
_gather_plain = _eager(ops.gather_plain.default)
_functorch_active = torch._C._are_functorch_transforms_active
_dispatch_modes = torch._C._len_torch_dispatch_stack
_jit_tracing = torch._C._get_tracing_state


# A call with nothing to record takes the plain twins unless one of these is active: a functorch
# transform (its batching rules), a dispatch mode (make_fx and other tracers would record the twin,
# and a replayed graph would lose the autograd and in-place kernels) or torch.jit.trace. The tests
# are written out in each function below: a helper's frame would cost more than all three.

_grad_enabled = torch.is_grad_enabled
# Dynamo folds this to True while it traces; in eager it is one Python call that returns False.
# torch.compiler.is_compiling() (two calls, and True in other tracers too, which a dispatch mode
# routes below) took 1.5 us right after a call that filled the L2 with data (0.1 us for this).
_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)
_increment_version = torch._C._increment_version
_BelowADInplaceOrView = torch._C._AutoDispatchBelowADInplaceOrView
_BelowAutograd = torch._C._AutoDispatchBelowAutograd


_NO_SRC = object()


def _raise(op: str, e: Exception, input, index, src, weight):
    """Raises the error a failed call reports to the user (always raises)."""
    if _compiling():
        raise e  # while tracing, the fake kernel's error as it is (see docs/errors.md)
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
    saved tensor modified afterwards), refuses an inference tensor outside inference_mode and a
    leaf that requires grad. The update is differentiable with respect to input, src and weight,
    in reverse and forward mode (torch.autograd, torch.func), and works under vmap when input is
    batched.
    """
    if lnc is not None:
        lnc_arg("scatter_add", lnc)
    if ignore_index is not None:
        ignore_index = ignore_index_arg("scatter_add", ignore_index)
    try:
        # Grad mode first: under no_grad / inference_mode (inference, the calls that are small) it
        # skips the requires_grad reads. torch.compile folds _compiling() to True, so a traced call
        # never reaches the tests after it.
        if (_grad_enabled() and (input.requires_grad or src.requires_grad or (weight is not None and weight.requires_grad))
                or _forward_ad._current_level >= 0 or _compiling() or input.is_inference()):
            # Through the dispatcher: the op's Autograd kernel records a differentiable update (and
            # refuses a leaf that requires grad), its ADInplaceOrView kernel refuses an inference
            # tensor and bumps the version counter, and the kernel checks everything before it
            # writes, whichever of these paths a call takes.
            _scatter_add_(input, index, src, weight, ignore_index)
        else:
            # Those kernels inlined: nothing to record or check for a normal tensor, and the
            # version bump here costs a fraction of a Python kernel's dispatch.
            if _functorch_active() or _dispatch_modes() or _jit_tracing() is not None:
                with _BelowADInplaceOrView():
                    _scatter_add_eager(input, index, src, weight, ignore_index)
            else:
                _scatter_add_plain(input, index, src, weight, ignore_index)
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
    weight, in reverse and forward mode, under torch.autograd and torch.func (grad, vjp, jvp,
    jacrev, jacfwd, hessian, vmap)."""
    if ignore_index is not None:
        ignore_index = ignore_index_arg("index_add", ignore_index)
    try:
        if (_grad_enabled() and (input.requires_grad or src.requires_grad or (weight is not None and weight.requires_grad))
                or _forward_ad._current_level >= 0 or _compiling()):
            return _index_add(input, index, src, weight, ignore_index)  # through the op's Autograd kernel
        if _functorch_active() or _dispatch_modes() or _jit_tracing() is not None:
            with _BelowAutograd():
                return _index_add_eager(input, index, src, weight, ignore_index)
        return _index_add_plain(input, index, src, weight, ignore_index)  # nothing to differentiate
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
    Differentiable with respect to input and weight (its backward is index_add of the gradient),
    under torch.autograd and torch.func."""
    if ignore_index is not None:
        ignore_index = ignore_index_arg("gather", ignore_index)
    try:
        if (_grad_enabled() and (input.requires_grad or (weight is not None and weight.requires_grad))
                or _forward_ad._current_level >= 0 or _compiling()):
            return _gather(input, index, weight, ignore_index)
        if _functorch_active() or _dispatch_modes() or _jit_tracing() is not None:
            with _BelowAutograd():
                return _gather_eager(input, index, weight, ignore_index)
        return _gather_plain(input, index, weight, ignore_index)
    except Exception as e:
        _raise("gather", e, input, index, _NO_SRC, weight)
