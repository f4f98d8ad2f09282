"""A projection's weight in the layout its kernel reads, chosen once when the model is loaded.

`select_weight` decides from what the layer holds (a dense weight, a quantized copy and the row
count up to which the copy serves), the dtype, the device and what this CPU's native kernels
offer; after that every call of the layer goes through the one object it returned, whose class
names the path:

- `PlainWeight`: the `[out, in]` weight as it is (CUDA, float16, no extra layouts, or no native
  kernels): the native dense GEMV for a few float32 rows, else `F.linear`.
- `PanelWeight`: float32 with the native kernels: panels of output columns for
  `kernels.panel_gemm`, which serves every row count.
- `BlockedWeight`: no panels (bf16, or float32 without the native kernels): oneDNN's blocked
  layout for 2 to PACKED_MAX_ROWS rows (packed once at load, so no call pays for reordering the
  plain weight into the blocks the GEMM reads), in bf16 also the weight transposed for larger
  batches (oneDNN multiplies `[in, out]` fastest there).
- a `QuantizedWeight` (quantized_weight.py): int8, q8_0, int4 or w4a8 for every row count.
- `RowSplitWeight`: a quantized weight for calls of up to `max_rows` rows (decode, where weight
  bytes set the speed) and a dense layout beyond (bf16, whose GEMM wins for large batches).

Invariant: `apply(x, bias)` computes `x @ W.T + bias` for `x [M, in]` whichever object it is;
layouts of the same dense weight differ only in float rounding, quantized ones by their
rounding of the weights. Each object also describes itself to the C decode step
(`native_linear`) with the row count up to which that step should take it.
"""

from __future__ import annotations

import abc
import ctypes
from collections.abc import Callable

import torch
import torch.nn.functional as F

from sglite.runtime.model import kernels
from sglite.runtime.model.kernels.abi import ABI

# Calls of more rows than this use the transposed weight, where there is one, not oneDNN's.
PACKED_MAX_ROWS = 256
# The batch size oneDNN is told to pack for (a hint; any row count works).
PACK_HINT_ROWS = 32
QGEMV_MAX_ROWS = ABI.constants["QGEMV_MAX_ROWS"]
NATIVE_MAX_ROWS = ABI.constants["NATIVE_MAX_ROWS"]
# The C decode step runs a dense weight beside oneDNN's copy for at most this many rows: the
# native GEMV streams the weight once per few rows, while oneDNN's blocked GEMM reuses each
# loaded block across all rows, which outweighs the Python dispatch it costs at larger batches.
BLOCKED_NATIVE_MAX_ROWS = 4


def c_linear(
    kind: str,
    n_out: int,
    k: int,
    weight: int,
    scale: int | None,
    bias: torch.Tensor | None,
    amx_min_rows: int = 0,
    a8_gemm_min_rows: int = 0,
) -> ctypes.Structure:
    """A `linear_t` (kernels.h) of kind `LINEAR_<kind>` with the given data pointers (and, for
    GGUF kinds, the rows from which the decode step takes AMX tiles, and the VNNI GEMM)."""
    bias_ptr = None if bias is None else bias.data_ptr()
    linear_t = ABI.structs["linear_t"]
    code = ABI.constants[f"LINEAR_{kind}"]
    return linear_t(code, n_out, k, weight, scale, bias_ptr, amx_min_rows, a8_gemm_min_rows)


class LinearWeight(abc.ABC):
    """A weight `[N, K]` in one layout with its kernel (see the module docstring)."""

    kind: str = ""

    @abc.abstractmethod
    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T` for `x [M, K]`, in x's dtype."""

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x @ W.T + bias`."""
        y = self.matmul(x)
        return y if bias is None else y + bias

    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes this layout holds beyond the layer's dense parameter."""

    def native_linear(self, bias: torch.Tensor | None) -> ctypes.Structure | None:
        """This weight as the C decode step's `linear_t`, or None when it cannot take it."""
        return None

    def native_rows(self, dtype: torch.dtype) -> int:
        """Rows up to which the C decode step should run this weight (0: never)."""
        return 0

    def matmul_gated(self, x: torch.Tensor, act: str) -> torch.Tensor | None:
        """For a fused `[gate; up]` weight: `act(x @ G.T) * (x @ U.T)` by one kernel, equal to
        `kernels.gated_act(self.matmul(x), act)`; None where this layout has no such kernel
        for x (the caller then takes that unfused form)."""
        return None

    def matmul_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """`x @ W.T` where each output row is computed by the same kernel, in the same order,
        whatever the number of rows (deterministic inference); None where this layout has no
        such kernel."""
        return None

    def matmul_decode(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T` for a DECODE batch's rows (one token per sequence): `matmul`, except for
        layouts that round decode activations (GGUF blocks with int8 activations)."""
        return self.matmul(x)


def in_row_chunks(
    x: torch.Tensor, rows: int, kernel: Callable[[torch.Tensor], torch.Tensor | None]
) -> torch.Tensor | None:
    """`kernel` over `x` in chunks of at most `rows` rows, concatenated (None if any refuses)."""
    if x.dim() != 2 or x.shape[0] == 0:
        return None
    parts = [kernel(x[i : i + rows].contiguous()) for i in range(0, x.shape[0], rows)]
    if any(part is None for part in parts):
        return None
    return torch.cat(parts)  # type: ignore[arg-type]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, with a matrix-vector path for one bf16 row on CPU (oneDNN's bf16 GEMM is
    tuned for blocks of rows; `torch.mv` streams the weight once for the single row)."""
    if x.shape[0] == 1 and x.dim() == 2 and x.dtype == torch.bfloat16 and x.device.type == "cpu":
        y = torch.mv(weight, x[0]).unsqueeze(0)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class PlainWeight(LinearWeight):
    """The dense weight as stored, `[N, K]` contiguous."""

    kind = "dense"

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The native GEMV for a few float32 rows (PyTorch's float32 GEMV reaches about half the
        memory bandwidth), else `F.linear`."""
        out = kernels.dense_gemv(x, self.weight)
        return out if out is not None else linear(x, self.weight)

    def nbytes(self) -> int:
        return 0

    def native_linear(self, bias: torch.Tensor | None) -> ctypes.Structure | None:
        n, k = self.weight.shape
        return c_linear("DENSE", n, k, self.weight.data_ptr(), None, bias)

    def native_rows(self, dtype: torch.dtype) -> int:
        return QGEMV_MAX_ROWS

    def matmul_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """The native dense GEMV (rows independent), in chunks of its rows."""
        gemv = lambda rows: kernels.dense_gemv(rows, self.weight, any_dtype=True)  # noqa: E731
        return in_row_chunks(x, QGEMV_MAX_ROWS, gemv)


class PanelWeight(LinearWeight):
    """float32 panels `[ceil(N / P), K, P]` for `kernels.panel_gemm` (any row count)."""

    kind = "panels"

    def __init__(self, panels: torch.Tensor, n_out: int) -> None:
        self.panels = panels
        self.n_out = n_out

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply(x, None)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The native panel GEMM (it adds the bias itself)."""
        out = kernels.panel_gemm(x, self.panels, bias, self.n_out)
        if out is not None:
            return out
        # The native library was switched off after packing: the panels read as W.T.
        w_t = self.panels.permute(1, 0, 2).reshape(self.panels.shape[1], -1)[:, : self.n_out]
        return torch.matmul(x, w_t) if bias is None else torch.addmm(bias, x, w_t)

    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()

    def native_linear(self, bias: torch.Tensor | None) -> ctypes.Structure | None:
        k = self.panels.shape[1]
        return c_linear("PANELS", self.n_out, k, self.panels.data_ptr(), None, bias)

    def native_rows(self, dtype: torch.dtype) -> int:
        return NATIVE_MAX_ROWS if dtype == torch.float32 else 0

    def matmul_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """The panel GEMM: each row's products over K in one fixed order for any row count."""
        return kernels.panel_gemm(x, self.panels, None, self.n_out)


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` (`[out, in]`, bf16 or float32, CPU) in oneDNN's blocked layout, or None where
    unsupported."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_HINT_ROWS)
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return None


class BlockedWeight(LinearWeight):
    """The dense weight plus oneDNN's blocked copy (`packed`, where this torch can make it)
    and, for large batches, the transposed one (`weight_t`, `[K, N]`: in bf16, or where there
    is no blocked copy)."""

    kind = "blocked"

    def __init__(
        self, weight: torch.Tensor, packed: torch.Tensor | None, weight_t: torch.Tensor | None
    ) -> None:
        self.weight = weight
        self.packed = packed
        self.weight_t = weight_t

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply(x, None)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """One row: the plain weight; up to PACKED_MAX_ROWS (or any count without a transposed
        copy): the blocked one; more: the transposed one."""
        rows = x.shape[0]
        if rows > 1 and self.packed is not None:
            if rows <= PACKED_MAX_ROWS or self.weight_t is None:
                op = torch.ops.mkldnn._linear_pointwise
                return op(x.contiguous(), self.packed, bias, "none", [], "")
        if rows > 1 and self.weight_t is not None:
            if bias is None:
                return torch.matmul(x, self.weight_t)
            return torch.addmm(bias, x, self.weight_t)
        return linear(x, self.weight, bias)

    def nbytes(self) -> int:
        held = (t for t in (self.packed, self.weight_t) if t is not None)
        return sum(t.numel() * t.element_size() for t in held)

    def native_linear(self, bias: torch.Tensor | None) -> ctypes.Structure | None:
        n, k = self.weight.shape
        return c_linear("DENSE", n, k, self.weight.data_ptr(), None, bias)

    def native_rows(self, dtype: torch.dtype) -> int:
        return BLOCKED_NATIVE_MAX_ROWS


class RowSplitWeight(LinearWeight):
    """`small` (a quantized weight) for calls of at most `max_rows` rows, `large` (a dense
    layout) for larger ones."""

    def __init__(self, small: LinearWeight, large: LinearWeight, max_rows: int) -> None:
        self.small = small
        self.large = large
        self.max_rows = max_rows
        self.kind = f"{small.kind} up to {max_rows} rows, else {large.kind}"

    def for_rows(self, rows: int) -> LinearWeight:
        """The weight serving calls of `rows` rows."""
        return self.small if rows <= self.max_rows else self.large

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.for_rows(x.shape[0]).matmul(x)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.for_rows(x.shape[0]).apply(x, bias)

    def nbytes(self) -> int:
        return self.small.nbytes() + self.large.nbytes()


def dense_layout(weight: torch.Tensor, extra_layouts: bool) -> LinearWeight:
    """The fastest layout of a dense weight for its device and dtype and this CPU: with
    `extra_layouts` (the loader's `--gemm-packing`, for models that can afford the memory)
    panels or blocked copies; else the plain weight."""
    if not extra_layouts or weight.device.type != "cpu":
        return PlainWeight(weight)
    panels = kernels.pack_panels(weight)
    if panels is not None:
        return PanelWeight(panels, weight.shape[0])
    packed = pack_for_onednn(weight)
    needs_transposed = packed is None or weight.dtype != torch.float32
    weight_t = weight.t().contiguous() if needs_transposed else None
    return BlockedWeight(weight, packed, weight_t)


def select_weight(
    dense: torch.Tensor | None,
    quantized: LinearWeight | None,
    quantized_max_rows: int,
    extra_layouts: bool,
) -> LinearWeight:
    """The one weight object a layer computes with (see the module docstring): the quantized
    copy for every call when `quantized_max_rows` is -1 or there is no dense weight, the dense
    layout when there is no quantized copy, else both split by row count."""
    has_dense = dense is not None and dense.numel() > 0
    if quantized is not None and (quantized_max_rows < 0 or not has_dense):
        return quantized
    if not has_dense:
        raise ValueError("a linear layer needs a dense or a quantized weight")
    large = dense_layout(dense, extra_layouts)  # type: ignore[arg-type]
    if quantized is None:
        return large
    return RowSplitWeight(quantized, large, quantized_max_rows)
