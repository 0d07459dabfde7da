"""Dispatcher registrations beyond the compiled kernels:

- scatter_add_ (in place): an ADInplaceOrView kernel, as torch gives its own in-place ops and
  torch.library.custom_op gives mutating ops. It refuses an inference tensor outside
  torch.inference_mode() and bumps input's version counter, so autograd catches a tensor saved
  for backward and modified afterwards.
- index_add and gather: Autograd kernels over autograd.Function classes with setup_context,
  backward and jvp, applied at the op's own dispatch level, so torch.autograd (reverse and forward
  mode, higher orders) and torch.func (grad, vjp, jvp, jacrev, jacfwd, hessian, nested) all work.
- scatter_add_: an Autograd kernel of the same kind that records the in-place update (the kernel
  itself writes input, marked dirty, so every check of the in-place op runs before the write) and
  refuses a leaf that requires grad before anything is written, as torch's in-place ops do.
- vmap rules for the three ops: a batch of input / src rows is folded into the columns, one
  kernel call for the whole batch, with the same bits per sample; a batched index or weight (or,
  in place, an input whose batch cannot be folded as a view) loops over the batch. An empty batch
  gives an empty result, its shapes checked on meta tensors.
"""
import torch
import torch.autograd.forward_ad as _forward_ad
from torch._functorch.utils import enable_single_level_autograd_function as _single_level_function

from ._checks import check_tensors
from ._ops import ops

_scatter_add_ = ops.scatter_add_.default
_index_add = ops.index_add.default
_gather = ops.gather.default

_AFTER_ADINPLACEORVIEW = torch._C._after_ADInplaceOrView_keyset
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_increment_version = torch._C._increment_version
_any_requires_grad = torch._C._any_requires_grad
_BelowAutograd = torch._C._AutoDispatchBelowAutograd
_functorch_active = torch._C._are_functorch_transforms_active

_lib = torch.library.Library(_index_add.namespace, "FRAGMENT")


# --- in place ------------------------------------------------------------------------------


def check_not_inference(op: str, input: torch.Tensor) -> None:
    if input.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{op}: Inplace update to inference tensor outside InferenceMode is not allowed: input was created "
            "under torch.inference_mode(); clone it to get a normal tensor, or call this inside inference_mode")


def check_not_leaf(input: torch.Tensor) -> None:
    """torch's own refusal of an in-place update of a leaf that requires grad (or of a view of one)
    while grad mode is on, made before anything is written."""
    if input._is_view():
        base = input._base
        if base.requires_grad and base.is_leaf:
            raise RuntimeError("a view of a leaf Variable that requires grad is being used in an in-place operation.")
    elif input.is_leaf:
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")


def _scatter_add_inplace_or_view(keyset, input, index, src, weight=None, ignore_index=None):
    if input is not None and input.is_inference():
        check_not_inference("scatter_add", input)
    _scatter_add_.redispatch(keyset & _AFTER_ADINPLACEORVIEW, input, index, src, weight, ignore_index)
    _increment_version((input,))


_lib.impl("scatter_add_", _scatter_add_inplace_or_view, "ADInplaceOrView", with_keyset=True)


# --- autograd ------------------------------------------------------------------------------


def _below_autograd(op, *args):
    """The kernel call of a forward: below this level's autograd, as torch's own autograd kernels
    call theirs. Under torch.func the call goes on to the outer transform levels, which must see
    the grad modes they run with, not the ones autograd.Function turned off for this level's
    forward (torch.func's own autograd.Function support restores them the same way)."""
    if _functorch_active():
        with torch.enable_grad(), _forward_ad._set_fwd_grad_enabled(True), _BelowAutograd():
            return op(*args)
    with _BelowAutograd():
        return op(*args)


def _row_dot(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    return (a.to(acc) * b.to(acc)).sum(dim=-1).to(dtype)


# Elements per chunk of a weight gradient's row dots on the CPU (see _gathered_row_dot).
ROW_DOT_CHUNK_ELEMS = 1 << 20


def _gathered_row_dot(table: torch.Tensor, index: torch.Tensor, ignore_index, rows: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """dot(table[index[i]], rows[i]) for every i (0 where index[i] is ignore_index), summed in
    float32 (float64 for f64) and returned as dtype: a weight's gradient.

    In an eager CPU backward, a large one runs in chunks of about ROW_DOT_CHUNK_ELEMS elements, so
    that the gathered rows and both float32 copies stay in the caches: whole, they are fresh
    allocations of the [K, D] size, each page faulted in again on every call. Qwen3-MoE's combine at
    2048 tokens (16384 x 1024 bfloat16 rows): 67 ms whole, 3.8 ms in chunks of 1024 rows. The bits
    are the same: each row is reduced on its own either way (torch splits a reduction over threads
    only along the rows, or within the row when there is one row in all, so every chunk holds at
    least two). Under grad mode (a double backward), a functorch transform or torch.compile, and
    off the CPU, the rows are taken whole."""
    k, d = rows.shape[0], rows.shape[-1]
    step = max(2, ROW_DOT_CHUNK_ELEMS // max(d, 1))
    if (k < 2 * step or rows.device.type != "cpu" or torch.is_grad_enabled() or _functorch_active()
            or torch.compiler.is_compiling()):
        return _row_dot(_gather(table, index, None, ignore_index), rows, dtype)
    out = torch.empty(k, dtype=dtype, device=rows.device)
    starts = list(range(0, k - step + 1, step))  # the last chunk takes the tail: step to 2 step - 1 rows
    for s, e in zip(starts, starts[1:] + [k]):
        out[s:e] = _row_dot(_gather(table, index[s:e], None, ignore_index), rows[s:e], dtype)
    return out


def _zeros_of_input(ctx, like: torch.Tensor) -> torch.Tensor:
    """Zeros of the shape and dtype of the op's input (kept in ctx: the tensor itself is not
    saved), on like's device."""
    return like.new_zeros(ctx.input_shape, dtype=ctx.input_dtype)


class _IndexAddRule:
    """out = input with weight[i] * src[i] added to row index[i]: forward, backward and jvp."""

    @staticmethod
    def forward(input, index, src, weight, ignore_index):
        return _below_autograd(_index_add, input, index, src, weight, ignore_index)

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, index, src, weight, ignore_index = inputs
        ctx.ignore_index = ignore_index
        ctx.has_weight = weight is not None
        ctx.input_shape, ctx.input_dtype = input.shape, input.dtype
        # src only for the weight's gradient: unweighted, an in-place change of src after the call
        # does not stop the backward (as torch's index_add_), and src is not kept alive for it
        keep = src if weight is not None else None
        ctx.save_for_backward(index, keep, weight)
        ctx.save_for_forward(index, keep, weight)

    @staticmethod
    def backward(ctx, grad):
        index, src, weight = ctx.saved_tensors
        need_input, _, need_src, need_weight, _ = ctx.needs_input_grad
        grad_input = grad if need_input else None
        grad_src = _gather(grad, index, weight, ctx.ignore_index) if need_src else None
        grad_weight = None
        if need_weight and ctx.has_weight:
            grad_weight = _gathered_row_dot(grad, index, ctx.ignore_index, src, weight.dtype)
        return grad_input, None, grad_src, grad_weight, None

    @staticmethod
    def jvp(ctx, t_input, t_index, t_src, t_weight, t_ignore):
        # d(out) = d(input) + index_add(d(src) * weight) + index_add(src * d(weight))
        index, src, weight = ctx.saved_tensors
        t = t_input if t_input is not None else _zeros_of_input(ctx, index)
        if t_src is not None:
            t = _index_add(t, index, t_src, weight, ctx.ignore_index)
        if t_weight is not None and ctx.has_weight:
            t = _index_add(t, index, src, t_weight, ctx.ignore_index)
        return t.clone(memory_format=torch.contiguous_format) if t is t_input else t


class _GatherRule:
    """out[i] = weight[i] * input[index[i]] (zero where index[i] == ignore_index): forward,
    backward and jvp."""

    @staticmethod
    def forward(input, index, weight, ignore_index):
        return _below_autograd(_gather, input, index, weight, ignore_index)

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, index, weight, ignore_index = inputs
        ctx.ignore_index = ignore_index
        ctx.has_weight = weight is not None
        ctx.input_shape, ctx.input_dtype = input.shape, input.dtype
        # input only for the weight's gradient (as index_add's src above)
        keep = input if weight is not None else None
        ctx.save_for_backward(keep, index, weight)
        ctx.save_for_forward(keep, index, weight)

    @staticmethod
    def backward(ctx, grad):
        input, index, weight = ctx.saved_tensors
        need_input, _, need_weight, _ = ctx.needs_input_grad
        grad_input = None
        if need_input:
            grad_input = _index_add(_zeros_of_input(ctx, grad), index, grad.to(ctx.input_dtype), weight,
                                    ctx.ignore_index)
        grad_weight = None
        if need_weight and ctx.has_weight:
            grad_weight = _gathered_row_dot(input, index, ctx.ignore_index, grad, weight.dtype)
        return grad_input, None, grad_weight, None

    @staticmethod
    def jvp(ctx, t_input, t_index, t_weight, t_ignore):
        # d(out) = gather(d(input)) * weight + gather(input) * d(weight)
        input, index, weight = ctx.saved_tensors
        t = None
        if t_input is not None:
            t = _gather(t_input, index, weight, ctx.ignore_index)
        if t_weight is not None and ctx.has_weight:
            tw = _gather(input, index, t_weight, ctx.ignore_index)
            t = tw if t is None else t + tw
        return t if t is not None else index.new_zeros((index.shape[0], ctx.input_shape[1]), dtype=ctx.input_dtype)


class _ScatterAddRule:
    """input[index[i]] += weight[i] * src[i] in place: forward (the in-place kernel, below this
    level's autograd: it checks everything, overlap included, before it writes), backward and jvp.
    The backward needs no value of input, so nothing is copied."""

    @staticmethod
    def forward(input, index, src, weight, ignore_index):
        _below_autograd(_scatter_add_, input, index, src, weight, ignore_index)
        return input

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_dirty(inputs[0])
        ctx.set_materialize_grads(False)  # an input without tangent gets None, not zeros, in jvp
        _IndexAddRule.setup_context(ctx, inputs, output)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None, None, None, None
        return _IndexAddRule.backward(ctx, grad)

    @staticmethod
    def jvp(ctx, t_input, t_index, t_src, t_weight, t_ignore):
        # The same tangent as index_add's, written into input's own tangent when it has one (an
        # in-place update updates its tangent in place).
        index, src, weight = ctx.saved_tensors
        t = t_input
        if t_src is not None:
            t = _index_add(t if t is not None else _zeros_of_input(ctx, index), index, t_src, weight,
                           ctx.ignore_index)
        if t_weight is not None and ctx.has_weight:
            t = _index_add(t if t is not None else _zeros_of_input(ctx, index), index, src, t_weight,
                           ctx.ignore_index)
        if t_input is None:
            return t
        if t is t_input:  # nothing added: the update is the identity on it, still made in place
            _increment_version((t_input,))
            return t_input
        return t_input.copy_(t)


class IndexAdd(_IndexAddRule, torch.autograd.Function):
    pass


class Gather(_GatherRule, torch.autograd.Function):
    pass


class ScatterAddInPlace(_ScatterAddRule, torch.autograd.Function):
    pass


# Under torch.func this runs as the op's Autograd kernel on the transform's wrapped tensors of this
# level, and autograd records on them directly, as it does for torch's own ops. So the rule is
# applied as a single-level function (the kind torch.func builds for each level of an
# autograd.Function it is handed): an autograd.Function's apply would hand itself to torch.func
# again, which can only take it from outside the dispatcher.
class _IndexAddOneLevel(_IndexAddRule, torch.autograd.function._SingleLevelFunction):
    pass


class _GatherOneLevel(_GatherRule, torch.autograd.function._SingleLevelFunction):
    pass


class _ScatterAddInPlaceOneLevel(_ScatterAddRule, torch.autograd.function._SingleLevelFunction):
    pass


_ONE_LEVEL = {IndexAdd: _IndexAddOneLevel, Gather: _GatherOneLevel, ScatterAddInPlace: _ScatterAddInPlaceOneLevel}


def _apply(fn, *args):
    if _functorch_active():
        with _single_level_function():
            return _ONE_LEVEL[fn].apply(*args)
    return fn.apply(*args)


def forward_ad_active() -> bool:
    """Inside a forward-mode dual level (torch.autograd.forward_ad, torch.func.jvp / jacfwd), where
    inputs may carry tangents."""
    return _forward_ad._current_level >= 0


def _differentiable(*tensors) -> bool:
    return (torch.is_grad_enabled() and _any_requires_grad(*tensors)) or forward_ad_active()


def _scatter_add_autograd(keyset, input, index, src, weight=None, ignore_index=None):
    if input is None or index is None or src is None:
        check_tensors("scatter_add", input, index, src, has_src=True)
    if _differentiable(input, src, weight):
        if input.requires_grad and torch.is_grad_enabled():
            check_not_leaf(input)
        _apply(ScatterAddInPlace, input, index, src, weight, ignore_index)
        return
    with _BelowAutograd():
        _scatter_add_.redispatch(keyset & _AFTER_AUTOGRAD, input, index, src, weight, ignore_index)


def _index_add_autograd(keyset, input, index, src, weight=None, ignore_index=None):
    if input is None or index is None or src is None:
        check_tensors("index_add", input, index, src, has_src=True)
    if _differentiable(input, src, weight):
        return _apply(IndexAdd, input, index, src, weight, ignore_index)
    with _BelowAutograd():
        return _index_add.redispatch(keyset & _AFTER_AUTOGRAD, input, index, src, weight, ignore_index)


def _gather_autograd(keyset, input, index, weight=None, ignore_index=None):
    if input is None or index is None:
        check_tensors("gather", input, index)
    if _differentiable(input, weight):
        return _apply(Gather, input, index, weight, ignore_index)
    with _BelowAutograd():
        return _gather.redispatch(keyset & _AFTER_AUTOGRAD, input, index, weight, ignore_index)


_lib.impl("scatter_add_", _scatter_add_autograd, "Autograd", with_keyset=True)
_lib.impl("index_add", _index_add_autograd, "Autograd", with_keyset=True)
_lib.impl("gather", _gather_autograd, "Autograd", with_keyset=True)


# --- vmap ----------------------------------------------------------------------------------


def _rows_by_batch(t, bdim, batch):
    """[N, D] or [N, D] batched at bdim -> [N, batch * D], sample b in columns b*D .. b*D + D - 1."""
    t = t.unsqueeze(1).expand(t.shape[0], batch, t.shape[1]) if bdim is None else t.movedim(bdim, 1)
    return t.reshape(t.shape[0], batch * t.shape[2])


def _cols(t, bdim):
    """D of one sample of t ([N, D], batched at bdim or not)."""
    return t.shape[1] if bdim is None else t.movedim(bdim, 0).shape[2]


def _select(t, bdim, b):
    return t if t is None or bdim is None else t.select(bdim, b)


def _sample_meta(t, bdim):
    """One sample of t as a meta tensor: the shape, dtype and argument checks of an empty batch."""
    if t is None or bdim is None:
        return None if t is None else t.new_empty(t.shape, device="meta")
    return t.new_empty(t.shape[:bdim] + t.shape[bdim + 1:], device="meta")


def _index_add_vmap(info, in_dims, input, index, src, weight=None, ignore_index=None):
    input_bdim, index_bdim, src_bdim, weight_bdim = (tuple(in_dims) + (None,) * 4)[:4]
    batch = info.batch_size
    if index_bdim is None and weight_bdim is None:
        rows = _rows_by_batch(input, input_bdim, batch)
        out = _index_add(rows, index, _rows_by_batch(src, src_bdim, batch), weight, ignore_index)
        return out.view(rows.shape[0], batch, _cols(input, input_bdim)), 1
    if batch == 0:
        one = _index_add(*map(_sample_meta, (input, index, src, weight), (input_bdim, index_bdim, src_bdim, weight_bdim)),
                         ignore_index)
        return input.new_empty((0,) + tuple(one.shape)), 0
    outs = [_index_add(_select(input, input_bdim, b), _select(index, index_bdim, b), _select(src, src_bdim, b),
                       _select(weight, weight_bdim, b), ignore_index) for b in range(batch)]
    return torch.stack(outs), 0


def _gather_vmap(info, in_dims, input, index, weight=None, ignore_index=None):
    input_bdim, index_bdim, weight_bdim = (tuple(in_dims) + (None,) * 3)[:3]
    batch = info.batch_size
    if index_bdim is None and weight_bdim is None:
        rows = _rows_by_batch(input, input_bdim, batch)
        out = _gather(rows, index, weight, ignore_index)
        return out.view(index.shape[0], batch, _cols(input, input_bdim)), 1
    if batch == 0:
        one = _gather(*map(_sample_meta, (input, index, weight), (input_bdim, index_bdim, weight_bdim)), ignore_index)
        return input.new_empty((0,) + tuple(one.shape)), 0
    outs = [_gather(_select(input, input_bdim, b), _select(index, index_bdim, b), _select(weight, weight_bdim, b),
                    ignore_index) for b in range(batch)]
    return torch.stack(outs), 0


def _scatter_add_vmap(info, in_dims, input, index, src, weight=None, ignore_index=None):
    """In place, as torch's in-place ops under vmap: input must be batched when another argument
    is (one input cannot hold a result per sample)."""
    input_bdim, index_bdim, src_bdim, weight_bdim = (tuple(in_dims) + (None,) * 4)[:4]
    batch = info.batch_size
    if input_bdim is None:
        raise RuntimeError("ValueError: scatter_add: under vmap, input must be batched when index, src or weight "
                           "is (an in-place update cannot hold one result per sample; use index_add)")
    if index_bdim is None and weight_bdim is None:
        moved = input.movedim(input_bdim, 1)  # [N, batch, D]
        try:
            rows = moved.view(moved.shape[0], batch * moved.shape[2])
        except RuntimeError:  # the batch cannot be folded into the columns as a view of input
            rows = None
        if rows is not None:
            _scatter_add_(rows, index, _rows_by_batch(src, src_bdim, batch), weight, ignore_index)
            return None, None
    if batch == 0:
        _scatter_add_(*map(_sample_meta, (input, index, src, weight), (input_bdim, index_bdim, src_bdim, weight_bdim)),
                      ignore_index)
    for b in range(batch):
        _scatter_add_(input.select(input_bdim, b), _select(index, index_bdim, b), _select(src, src_bdim, b),
                      _select(weight, weight_bdim, b), ignore_index)
    return None, None


torch.library.register_vmap(_scatter_add_, _scatter_add_vmap, lib=_lib)
torch.library.register_vmap(_index_add, _index_add_vmap, lib=_lib)
torch.library.register_vmap(_gather, _gather_vmap, lib=_lib)
