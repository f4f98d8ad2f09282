"""Linear layers: dense matmul with a fast one-row path, plus an optional quantized copy.

Invariant: `Linear.forward(x)` computes `x @ weight.T + bias` whichever path runs; the quantized
path (when `quantized` is set) differs from the dense one only by its rounding of the weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglite.runtime.model.quantization import QuantizedWeight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, with a matrix-vector path for one bf16 row on CPU.

    oneDNN's bf16 GEMM is poorly tuned for a single row (batch-1 decode); `torch.mv` was measured
    about 2x faster there.
    """
    if x.shape[0] == 1 and x.dim() == 2 and x.dtype == torch.bfloat16 and x.device.type == "cpu":
        y = torch.mv(weight, x[0]).unsqueeze(0)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state dict) that can also hold a quantized weight.

    With `quantized` set, calls with at most `quantized_max_rows` rows (decode of small batches,
    where weight bytes set the speed) use it; larger ones use the dense weight (prefill and large
    batches, where the dense GEMM is faster). A layer whose dense weight was dropped to save
    memory (`drop_dense`) always uses the quantized one.
    """

    quantized: QuantizedWeight | None = None
    quantized_max_rows: int = 0

    def set_quantized(self, weight: QuantizedWeight, max_rows: int) -> None:
        """Serve calls of up to `max_rows` rows (-1: all calls) from `weight`."""
        self.quantized = weight
        self.quantized_max_rows = max_rows
        if max_rows < 0:
            self.drop_dense()

    def drop_dense(self) -> None:
        """Free the dense weight; every call then uses the quantized copy."""
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, in] -> [T, out]`."""
        q = self.quantized
        if q is not None and (self.quantized_max_rows < 0 or x.shape[0] <= self.quantized_max_rows):
            y = q.matmul(x)
            return y if self.bias is None else y + self.bias
        return linear(x, self.weight, self.bias)
