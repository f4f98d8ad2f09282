"""RMSNorm with a learned scale."""

from __future__ import annotations

import torch
from torch import nn

from sglite.runtime.model import kernels


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale (applied through `kernels`).

    The scale multiplies the normalized value as stored: families whose checkpoints hold
    `scale - 1` (Gemma: `x * (1 + w)`) add the 1 when their weights are loaded.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the last dimension; statistics are accumulated in float32."""
        return kernels.add_rms_norm(None, x.contiguous(), self.weight, self.eps)
