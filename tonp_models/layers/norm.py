"""RMSNorm over the last dim, by `tonp_kernels.rms_norm` (fp32 statistics, HF rounding)."""
from __future__ import annotations

import torch
from torch import nn

import tonp_kernels as tk


class RMSNorm(nn.Module):
    """y = weight * (x * rsqrt(mean(x^2) + eps)); x [..., dim] -> [..., dim] in x.dtype.

    Replicated under TP (q_norm/k_norm act per head, the hidden norms on full rows)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tk.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
