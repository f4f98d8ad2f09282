"""Linear layers: the dense weight in the layouts the CPU's GEMMs like, plus an optional quantized
copy, each call taking the fastest for its row count.

Invariant: `Linear.forward(x)` computes `x @ weight.T + bias` whichever path runs; the quantized
path (when `quantized` is set) differs from the dense one only by its rounding of the weights.

Dense layouts: `weight` (`[out, in]`, contiguous) serves one-row products and the native decode
step, which stream it row by row. With `finalize(extra_layouts=True)` more copies are kept: the
weight packed for oneDNN's blocked kernels (`packed`), 1.3-1.5x faster for 2-256 rows (bf16;
float32 1.2-3x at 32 rows), and, in bf16 only, the weight transposed (`weight_t`, `[in, out]`),
which oneDNN multiplies fastest for prefill-sized batches (1.36x at 1000 rows, 2 cores). In
float32 the packed copy serves prefill too (it was 1.0-1.3x faster than the transposed one at
1000 rows on 2 AVX2 cores), which saves a third copy of the weights. The loader keeps the extra
layouts only for models that can afford them (`--gemm-packing`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglite.runtime.model.quantization import QuantizedWeight

# Calls of more rows than this use the transposed weight, where there is one, not the packed one.
PACKED_MAX_ROWS = 256
# The batch size oneDNN is told to pack for (a hint; any row count works).
PACK_HINT_ROWS = 32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, with a matrix-vector path for one bf16 row on CPU.

    oneDNN's bf16 GEMM is poorly tuned for a single row (batch-1 decode); `torch.mv` was measured
    about 2x faster there.
    """
    if x.shape[0] == 1 and x.dim() == 2 and x.dtype == torch.bfloat16 and x.device.type == "cpu":
        y = torch.mv(weight, x[0]).unsqueeze(0)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` (`[out, in]`, bf16 or float32, CPU) in oneDNN's blocked layout, or None where
    unsupported. float32 too: on 2 AVX2 cores, 32-row products ran 1.2-3x faster packed than
    through `matmul` with the transposed weight (3x for the 49152-wide output projection)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_HINT_ROWS)
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W.T + bias` with a weight from `pack_for_onednn`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state dict) with faster layouts and a quantized copy.

    With `quantized` set, calls with at most `quantized_max_rows` rows (decode of small batches,
    where weight bytes set the speed) use it; larger ones use the dense weight (prefill and
    large batches, where the dense GEMM is faster). A layer whose dense weight was dropped to
    save memory (`drop_dense`) always uses the quantized one.
    """

    quantized: QuantizedWeight | None = None
    quantized_max_rows: int = 0
    weight_t: torch.Tensor | None = None  # contiguous [in, out] copy for large batches
    packed: torch.Tensor | None = None  # oneDNN-blocked copy for mid-size batches

    def set_quantized(self, weight: QuantizedWeight, max_rows: int) -> None:
        """Serve calls of up to `max_rows` rows (-1: all calls) from `weight`."""
        self.quantized = weight
        self.quantized_max_rows = max_rows
        if max_rows < 0:
            self.drop_dense()

    def drop_dense(self) -> None:
        """Free the dense weight; every call then uses the quantized copy."""
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
        self.weight_t = self.packed = None

    def finalize(self, extra_layouts: bool) -> None:
        """Add the oneDNN-packed copy of the dense weight and, outside float32, the transposed
        one (when `extra_layouts`); call once the weights are loaded (and quantized)."""
        if not extra_layouts or self.weight.numel() == 0 or self.weight.device.type != "cpu":
            self.weight_t = self.packed = None
            return
        self.packed = pack_for_onednn(self.weight.data)
        needs_transposed = self.packed is None or self.weight.dtype != torch.float32
        self.weight_t = self.weight.data.t().contiguous() if needs_transposed else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, in] -> [T, out]`."""
        rows = x.shape[0]
        q = self.quantized
        if q is not None and (self.quantized_max_rows < 0 or rows <= self.quantized_max_rows):
            y = q.matmul(x)
            return y if self.bias is None else y + self.bias
        # Packed up to PACKED_MAX_ROWS rows, and beyond them where there is no transposed copy.
        packed_fits = rows <= PACKED_MAX_ROWS or self.weight_t is None
        if self.packed is not None and rows > 1 and packed_fits and x.is_contiguous():
            return packed_linear(x, self.packed, self.bias)
        if self.weight_t is not None and rows > 1:
            if self.bias is None:
                return torch.matmul(x, self.weight_t)
            return torch.addmm(self.bias, x, self.weight_t)
        return linear(x, self.weight, self.bias)
