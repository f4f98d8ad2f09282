"""Linear layers: the dense weight in the layouts the CPU's GEMMs like, plus an optional quantized
copy, each call taking the fastest for its row count.

Invariant: `Linear.forward(x)` computes `x @ weight.T + bias` whichever path runs; the quantized
path (when `quantized` is set) differs from the dense one only by its rounding of the weights.

Dense layouts: `weight` (`[out, in]`, contiguous) is the parameter; without a packed copy it
also serves one-row products and the native decode step's GEMV. With
`finalize(extra_layouts=True)` one more copy is kept (`packed`, a `PackedWeight`):
- float32 with the native kernels: panels of 16 output columns for `kernels.panel_gemm`, which
  serves every row count. Streaming the 30 layers' weights from memory it ran 1.35-1.8x faster
  than oneDNN's packed float32 GEMM from 2 to 64 rows, and 1.0-1.3x at 1000 rows (2 AVX2 cores).
- otherwise oneDNN's blocked layout (`packed`), 1.3-1.5x faster than plain `F.linear` for 2-256
  rows in bf16; in bf16 also the weight transposed (`weight_t`, `[in, out]`), which oneDNN
  multiplies fastest for prefill-sized batches (1.36x at 1000 rows, 2 cores).
The loader keeps the extra layouts only for models that can afford them (`--gemm-packing`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sglite.runtime.model import kernels
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
    unsupported."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_HINT_ROWS)
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W.T + bias` with a weight from `pack_for_onednn`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@dataclass(frozen=True)
class PackedWeight:
    """A dense weight `[n_out, in]` in a GEMM's layout: `kind` "panels" (`kernels.panel_gemm`,
    float32, any row count) or "onednn" (`packed_linear`, 2 to PACKED_MAX_ROWS rows)."""

    kind: str
    data: torch.Tensor
    n_out: int

    def serves(self, rows: int) -> bool:
        """Whether this layout is the one to use for `rows` rows (see the module docstring)."""
        return self.kind == "panels" or 1 < rows <= PACKED_MAX_ROWS

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x @ W.T + bias` for `x [M, in]`."""
        if self.kind == "panels":
            out = kernels.panel_gemm(x, self.data, bias, self.n_out)
            if out is not None:
                return out
            # The native library was switched off after packing: the panels read as W.T.
            w_t = self.data.permute(1, 0, 2).reshape(self.data.shape[1], -1)[:, : self.n_out]
            return torch.matmul(x, w_t) if bias is None else torch.addmm(bias, x, w_t)
        return packed_linear(x.contiguous(), self.data, bias)


def pack_dense(weight: torch.Tensor) -> PackedWeight | None:
    """The fastest extra layout of `weight` for this CPU and dtype, or None (no layout beats the
    plain weight: CUDA, float16, a torch without oneDNN)."""
    panels = kernels.pack_panels(weight)
    if panels is not None:
        return PackedWeight("panels", panels, weight.shape[0])
    onednn = pack_for_onednn(weight)
    return None if onednn is None else PackedWeight("onednn", onednn, weight.shape[0])


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state dict) with faster layouts and a quantized copy.

    With `quantized` set, calls with at most `quantized_max_rows` rows (decode of small batches,
    where weight bytes set the speed) use it; larger ones use the dense weight where one is
    kept (bf16, where the dense GEMM is faster for them). A layer whose dense weight was
    dropped (`drop_dense`: float32's default, whose quantized GEMM serves every batch) always
    uses the quantized one.
    """

    quantized: QuantizedWeight | None = None
    quantized_max_rows: int = 0
    weight_t: torch.Tensor | None = None  # contiguous [in, out] copy for large batches
    packed: PackedWeight | None = None  # the GEMM-friendly copy (see the module docstring)
    # The checkpoint projections stacked into this weight, in row order (q/k/v, gate/up): their
    # names beside this module's and their output widths. Empty for an unfused projection.
    part_names: tuple[str, ...] = ()
    part_sizes: tuple[int, ...] = ()

    @classmethod
    def fused(cls, in_features: int, parts: dict[str, int], bias: bool) -> Linear:
        """One projection computing the checkpoint's `parts` (name -> output width) at once."""
        layer = cls(in_features, sum(parts.values()), bias=bias)
        layer.part_names = tuple(parts)
        layer.part_sizes = tuple(parts.values())
        return layer

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
        """Add the packed copy of the dense weight and, where it does not serve every row count
        outside float32, the transposed one (when `extra_layouts`); call once the weights are
        loaded (and quantized)."""
        if not extra_layouts or self.weight.numel() == 0 or self.weight.device.type != "cpu":
            self.weight_t = self.packed = None
            return
        self.packed = pack_dense(self.weight.data)
        needs_transposed = self.packed is None or (
            self.packed.kind == "onednn" and self.weight.dtype != torch.float32
        )
        self.weight_t = self.weight.data.t().contiguous() if needs_transposed else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, in] -> [T, out]`."""
        rows = x.shape[0]
        q = self.quantized
        if q is not None and (self.quantized_max_rows < 0 or rows <= self.quantized_max_rows):
            y = q.matmul(x)
            return y if self.bias is None else y + self.bias
        packed = self.packed
        # oneDNN's copy also takes large batches where there is no transposed one (float32).
        if packed is not None and (packed.serves(rows) or (rows > 1 and self.weight_t is None)):
            return packed.matmul(x, self.bias)
        if self.weight_t is not None and rows > 1:
            if self.bias is None:
                return torch.matmul(x, self.weight_t)
            return torch.addmm(self.bias, x, self.weight_t)
        return linear(x, self.weight, self.bias)
