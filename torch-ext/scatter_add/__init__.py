"""scatter-add: exact, deterministic row-wise scatter-add and gather for PyTorch.

    scatter_add(input, index, src, *, weight=None, ignore_index=None, lnc=None)  # in place
    index_add(input, index, src, *, weight=None, ignore_index=None)             # out of place
    gather(input, index, *, weight=None, ignore_index=None)                     # [K, D]
    ScatterAdd(lnc=None, ignore_index=None)                                     # nn.Module
    distributed.ExpertParallel                                                  # EP dispatch/combine

All imports are relative: the kernels loader imports this package under its per-build name.
"""
from . import distributed, layers, moe
from ._api import gather, index_add, scatter_add
from ._ops import ops
from .layers import ScatterAdd

__all__ = ["scatter_add", "index_add", "gather", "ScatterAdd", "layers", "distributed", "moe", "ops"]
