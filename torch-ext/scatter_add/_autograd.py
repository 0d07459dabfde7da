"""Dispatcher registrations beyond the compiled kernels.

scatter_add_ (in place) gets an ADInplaceOrView kernel, as torch gives its own in-place ops and
torch.library.custom_op gives mutating ops. It refuses an inference tensor outside
torch.inference_mode() and bumps input's version counter, so autograd catches a tensor saved for
backward and modified afterwards.
"""
import torch

from ._ops import ops

_scatter_add_ = ops.scatter_add_.default

_AFTER_ADINPLACEORVIEW = torch._C._after_ADInplaceOrView_keyset
_increment_version = torch._C._increment_version

_lib = torch.library.Library(_scatter_add_.namespace, "FRAGMENT")


# --- in place ------------------------------------------------------------------------------


def check_not_inference(op: str, input: torch.Tensor) -> None:
    if input.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{op}: Inplace update to inference tensor outside InferenceMode is not allowed: input was created "
            "under torch.inference_mode(); clone it to get a normal tensor, or call this inside inference_mode")


def _scatter_add_inplace_or_view(keyset, input, index, src, weight=None, ignore_index=None):
    if input.is_inference():
        check_not_inference("scatter_add", input)
    _scatter_add_.redispatch(keyset & _AFTER_ADINPLACEORVIEW, input, index, src, weight, ignore_index)
    _increment_version((input,))


_lib.impl("scatter_add_", _scatter_add_inplace_or_view, "ADInplaceOrView", with_keyset=True)
