"""RMSNorm over the last dim, by `tonp_kernels.rms_norm` (fp32 statistics, HF rounding)."""
from __future__ import annotations

import torch
from torch import nn

import tonp_kernels as tk


class RMSNorm(nn.Module):
    """y = weight * (x * rsqrt(mean(x^2) + eps)); x [..., dim] -> [..., dim] in x.dtype.

    The weight is replicated under TP. tp_group: the ranks of that group normalise different
    rows (the hidden norms under sequence parallelism) or different heads (q_norm / k_norm
    under TP), so each rank's weight gradient is a part: `copy_to_region` on the weight sums
    them over the group. None: every rank sees the same rows."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32, tp_group=None):
        super().__init__()
        self.eps, self.tp_group = eps, tp_group
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.tp_group is not None:
            from tonp_parallel import copy_to_region
            w = copy_to_region(w, self.tp_group)
        return tk.rms_norm(x, w, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
