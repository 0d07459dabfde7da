"""Fake (meta) implementations of the three ops (and their plain twins), for FakeTensor, meta tensors, torch.compile and
torch.export: the compiled kernels' argument, shape, dtype and device checks (same messages, same
exception), and the output's shape, dtype and device. Sizes may be symbolic, so one compiled graph
serves every K and N. The checks that need data (index values, memory overlap) run in the real
kernels only. small_matmul's fake declines (see there), as do small_matmul_nn's and
small_matmul_grouped's, and small_matmul_tiles' answers False."""
import torch

from ._checks import check_args, check_tensors
from ._ops import add_op_namespace_prefix


def scatter_add_fake(input, index, src, weight=None, ignore_index=None):
    check_tensors("scatter_add", input, index, src, has_src=True)
    check_args("scatter_add", input, index, src, weight)


def index_add_fake(input, index, src, weight=None, ignore_index=None):
    check_tensors("index_add", input, index, src, has_src=True)
    check_args("index_add", input, index, src, weight)
    return torch.empty_like(input, memory_format=torch.contiguous_format)


def gather_fake(input, index, weight=None, ignore_index=None):
    check_tensors("gather", input, index)
    check_args("gather", input, index, None, weight)
    return input.new_empty((index.shape[0], input.shape[1]))


def small_matmul_fake(y, x, w):
    """Declines under fake tensors (FakeTensorMode, make_fx): False, with no checks, and the caller
    multiplies with torch instead. TorchDynamo does not trace the op (it returns no tensor): the
    library calls it only in eager code, outside compiled graphs."""
    return False


torch.library.register_fake(add_op_namespace_prefix("small_matmul"), small_matmul_fake)
torch.library.register_fake(add_op_namespace_prefix("small_matmul_nn"), small_matmul_fake)
torch.library.register_fake(add_op_namespace_prefix("small_matmul_grouped"),
                            lambda y, x, w, ends: small_matmul_fake(y, x, w))
torch.library.register_fake(add_op_namespace_prefix("small_matmul_tiles"), lambda x, set=-1: False)
for _suffix in ("", "_plain"):  # the ops, and their plain twins (see _api.py)
    torch.library.register_fake(add_op_namespace_prefix("scatter_add" + _suffix + "_"), scatter_add_fake)
    torch.library.register_fake(add_op_namespace_prefix("index_add" + _suffix), index_add_fake)
    torch.library.register_fake(add_op_namespace_prefix("gather" + _suffix), gather_fake)
