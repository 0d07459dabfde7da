"""nn.Module layers of the scatter-add kernel."""
from typing import Optional

import torch
from torch import nn

from ._api import scatter_add
from ._checks import lnc_arg


class ScatterAdd(nn.Module):
    """forward(input, index, src, weight=None): input[index[i]] += weight[i] * src[i] in place,
    returning input. `lnc` is accepted for compatibility with the Neuron hub kernel."""

    def __init__(self, lnc: Optional[int] = None, ignore_index: Optional[int] = None):
        super().__init__()
        lnc_arg("ScatterAdd", lnc)
        self.lnc = lnc
        self.ignore_index = ignore_index

    def forward(
        self,
        input: torch.Tensor,
        index: torch.Tensor,
        src: torch.Tensor,
        weight: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        return scatter_add(input, index, src, weight=weight, ignore_index=self.ignore_index, lnc=self.lnc)
