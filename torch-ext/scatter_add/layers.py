"""nn.Module layers of the scatter-add kernel."""
from typing import Optional

import torch
from torch import nn

from ._api import scatter_add
from ._checks import ignore_index_arg, lnc_arg


class ScatterAdd(nn.Module):
    """forward(input, index, src, weight=None): input[index[i]] += weight[i] * src[i] in place,
    returning input (see `scatter_add` for the dtypes and shapes).

    Args:
        lnc: accepted for compatibility with the Neuron hub kernel (a positive int or None); no
            effect here.
        ignore_index: rows of src whose index equals this value are skipped (an int in the int64
            range, or None to use every row). Indices equal to it need not be valid rows, so a
            padding value such as -1 can mark dropped tokens.

    `repr(ScatterAdd(lnc=2))` is `ScatterAdd(lnc=2, ignore_index=None)`.
    """

    def __init__(self, lnc: Optional[int] = None, ignore_index: Optional[int] = None):
        super().__init__()
        lnc_arg("ScatterAdd", lnc)
        self.lnc = None if lnc is None else int(lnc)
        self.ignore_index = None if ignore_index is None else ignore_index_arg("ScatterAdd", ignore_index)

    def extra_repr(self) -> str:
        return f"lnc={self.lnc}, ignore_index={self.ignore_index}"

    def forward(
        self,
        input: torch.Tensor,
        index: torch.Tensor,
        src: torch.Tensor,
        weight: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        return scatter_add(input, index, src, weight=weight, ignore_index=self.ignore_index, lnc=self.lnc)
