"""The quantized layouts of a projection's weight and the kernels that multiply by them: int8 per
output channel (`Int8Weight`), GGUF's Q8_0 (`Q8Weight`) and int4 per group (`Int4Weight`).

Batch-1 decode reads every weight once per token, so its speed is set by weight bytes: int8
halves them and int4 quarters them relative to bfloat16. In float32 the native kernels serve
every batch size, so a quantized `Linear` needs no dense weight (the default, see
`loader.auto_quantized_max_rows`); in bf16 quantized matmuls lose to the bf16 GEMM past a few
rows, so a dense weight is kept for those and `Linear.forward` picks per call.

Kernels: the native GEMVs (`kernels/quant_gemv.c`, up to `qgemv_max_rows` rows, reading each
weight once for all rows) and the native GEMM for float32 rows past them
(`kernels/quant_gemm.c`) when the native library is built; otherwise the GEMV in chunks of rows,
a dequantized dense GEMM (int4), or PyTorch's CPU kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`).

Invariants: `matmul(x)` computes `x @ W.T` for the weight the object holds whichever kernel
serves the call; the layout (and with it the kernels that can read it) is fixed when the object
is built. `Int4Parts` dequantizes as `q * scale + offset` per group of `group_size` input columns
(q in 0..15); with groups of 32 and the native library `Int4Weight` stores it in GGUF's Q4_1
layout (nibbles, f16 scale and offset). Rounding dense weights into these layouts is
`quantization.py`'s job; reading a GGUF's own blocks into them, `gguf_quants.py`'s.
"""

from __future__ import annotations

import abc
import ctypes
from dataclasses import dataclass

import torch

from sglite.runtime.model import kernels
from sglite.runtime.model.kernels.abi import ABI
from sglite.runtime.model.linear_weight import (
    NATIVE_MAX_ROWS,
    QGEMV_MAX_ROWS,
    LinearWeight,
    c_linear,
    in_row_chunks,
)

# Inputs per GGUF block, the group of the q8_0 layout and of the native int4 one (Q4_1's).
GGUF_BLOCK = 32
# int4 (float x) rows its GEMV takes in float32 (the decode step's rule too; see kernels.h).
INT4_FLOAT_GEMV_MAX_ROWS = ABI.constants["INT4_FLOAT_GEMV_MAX_ROWS"]
# Rows rounded to int8 at a time, bounding the float temporaries (see `Int8Weight`).
INT8_ROWS_PER_SLICE = 4096


@dataclass
class Int4Parts:
    """Unpacked int4 weight `[N, K]`: values 0..15 and per-group scale and offset `[N, K / gs]`,
    `W = values * scale + offset`."""

    values: torch.Tensor  # int32 [N, K]
    scale: torch.Tensor  # float32 [N, K // group_size]
    offset: torch.Tensor  # float32 [N, K // group_size]
    group_size: int

    @staticmethod
    def concat(parts: list[Int4Parts]) -> Int4Parts:
        """Stack along the output dimension (for fused QKV / gate-up projections)."""
        sizes = {p.group_size for p in parts}
        if len(sizes) != 1:
            raise ValueError("fused int4 parts must share one group size")
        return Int4Parts(
            torch.cat([p.values for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.offset for p in parts]),
            parts[0].group_size,
        )

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these values represent."""
        gs = self.group_size
        scale = self.scale.repeat_interleave(gs, dim=1)
        offset = self.offset.repeat_interleave(gs, dim=1)
        return self.values.float() * scale + offset


class QuantizedWeight(LinearWeight):
    """A weight `[N, K]` stored quantized; `matmul(x)` computes `x @ W.T` for `x [M, K]`;
    `nbytes()` is all the memory it takes."""

    def native_rows(self, dtype: torch.dtype) -> int:
        """The GEMVs' rows in bf16; any batch in float32, the C step then running the quantized
        GEMM past them, which takes whole vectors of 32 inputs."""
        in_features = self.shape()[1]
        if dtype == torch.float32 and in_features % GGUF_BLOCK == 0:
            return NATIVE_MAX_ROWS
        return QGEMV_MAX_ROWS

    @abc.abstractmethod
    def shape(self) -> tuple[int, int]:
        """`(N, K)`."""


class Int8Weight(QuantizedWeight):
    """Symmetric int8 per output channel: `W ≈ q * scale[:, None]`."""

    kind = "int8"

    def __init__(self, weight: torch.Tensor, act_dtype: torch.dtype) -> None:
        self.values = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
        scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
        # In slices of rows: whole-matrix float temporaries of a vocabulary-sized output
        # projection would add several times its int8 size to the process's peak memory.
        for r in range(0, weight.shape[0], INT8_ROWS_PER_SLICE):
            w = weight[r : r + INT8_ROWS_PER_SLICE].float()
            s = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
            self.values[r : r + len(w)] = torch.round(w / s[:, None]).clamp(-127, 127)
            scale[r : r + len(w)] = s
        self.scale = scale  # float32, for the native kernel
        self.scale_act = scale.to(act_dtype)  # PyTorch's kernel wants the activation dtype

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T`: the native GEMV for a few rows, the native GEMM for more (float32), else
        the GEMV in chunks of rows, else `_weight_int8pack_mm` (the last resort: PyTorch's
        generic kernel is far slower than the chunked native GEMV)."""
        out = kernels.int8_gemv(x, self.values, self.scale)
        if out is None:
            out = kernels.int8_gemm(x, self.values, self.scale)
        if out is not None:
            return out
        chunk = kernels.qgemv_max_rows()
        if chunk and x.shape[0] > chunk and x.is_contiguous():
            gemv = lambda r: kernels.int8_gemv(r, self.values, self.scale)  # noqa: E731
            out = in_row_chunks(x, chunk, gemv)
            if out is not None:
                return out
        return torch.ops.aten._weight_int8pack_mm(x, self.values, self.scale_act)

    def matmul_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """float32: the GEMM for every row count; bf16: the GEMV in chunks of its rows."""
        if x.dtype == torch.float32:
            return kernels.int8_gemm(x, self.values, self.scale, row_independent=True)
        gemv = lambda r: kernels.int8_gemv(r, self.values, self.scale)  # noqa: E731
        return in_row_chunks(x, QGEMV_MAX_ROWS, gemv)

    def nbytes(self) -> int:
        """int8 values plus one scale per row."""
        return self.values.numel() + self.scale.numel() * 4

    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)  # type: ignore[return-value]

    def native_linear(self, bias: torch.Tensor | None) -> ctypes.Structure | None:
        n, k = self.values.shape
        return c_linear("INT8", n, k, self.values.data_ptr(), self.scale.data_ptr(), bias)


class Q8Weight(QuantizedWeight):
    """GGUF Q8_0 as the file stores it: int8 values `[N, K]` and an f16 scale per group of 32
    input columns `[N, K / 32]`. Used for the output projection of GGUFs whose embedding or
    output tensor is Q8_0: the logits then are the file's exactly (to float rounding), where a
    per-channel int8 requantization rounds the weights a second time and moves the logits enough
    to change some greedy choices."""

    kind = "q8_0"

    def __init__(self, values: torch.Tensor, scales: torch.Tensor) -> None:
        self.values = values.contiguous()
        self.scales = scales.to(torch.float16).contiguous()

    @staticmethod
    def concat(parts: list[Q8Weight]) -> Q8Weight:
        """Stack along the output dimension (for fused QKV / gate-up projections)."""
        return Q8Weight(torch.cat([p.values for p in parts]), torch.cat([p.scales for p in parts]))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T`: the GEMV up to its 8 rows (so few rows are bound by reading the weights,
        which the GEMV does in one streaming pass; the GEMM's tiles pay off only when more rows
        reuse each block), the quantized GEMM for larger float32 batches, else the dequantized
        weight."""
        out = kernels.q8_gemv(x, self.values, self.scales)
        if out is None:
            out = kernels.q8_gemm(x, self.values, self.scales)
        if out is None:
            out = torch.nn.functional.linear(x, self.dequantize().to(x.dtype))
        return out

    def matmul_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """float32: the GEMM for every row count; bf16: the GEMV in chunks of its rows."""
        if x.dtype == torch.float32:
            return kernels.q8_gemm(x, self.values, self.scales, row_independent=True)
        gemv = lambda r: kernels.q8_gemv(r, self.values, self.scales)  # noqa: E731
        return in_row_chunks(x, QGEMV_MAX_ROWS, gemv)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight `[N, K]`."""
        n, k = self.values.shape
        groups = self.values.float().view(n, k // GGUF_BLOCK, GGUF_BLOCK)
        return (groups * self.scales.float()[:, :, None]).view(n, k)

    def nbytes(self) -> int:
        """int8 values plus an f16 scale per group of 32."""
        return self.values.numel() + self.scales.numel() * 2

    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)  # type: ignore[return-value]

    def native_linear(self, bias: torch.Tensor | None) -> ctypes.Structure | None:
        n, k = self.values.shape
        return c_linear("Q8_0", n, k, self.values.data_ptr(), self.scales.data_ptr(), bias)


class Int4Weight(QuantizedWeight):
    """Asymmetric int4 per group of input columns.

    With the native library and groups of 32: GGUF Q4_1 layout (nibbles, f16 scale and offset)
    for `kernels.int4_gemv`; otherwise packed for `_weight_int4pack_mm_for_cpu`.
    `round_activations` (kind w4a8) lets the GEMVs round x to int8 (see `kernels.int4_gemv`).
    """

    def __init__(
        self, parts: Int4Parts, act_dtype: torch.dtype, round_activations: bool = False
    ) -> None:
        self.round_activations = round_activations
        self.kind = "w4a8" if round_activations else "int4"
        self.group_size = parts.group_size
        self.out_features, self.in_features = parts.values.shape
        self.native = parts.group_size == GGUF_BLOCK and kernels.native_available()
        if self.native:
            v = parts.values.to(torch.uint8).reshape(self.out_features, -1, 2, GGUF_BLOCK // 2)
            self.packed = (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(self.out_features, -1)
            pairs = torch.stack([parts.scale, parts.offset], dim=-1).to(torch.float16)
            self.scale_offset = pairs.contiguous()
            return
        values = parts.values.to(torch.int32).contiguous()
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
        # PyTorch's kernel computes (q - 8) * scale + zero, with [K / gs, N, 2] in the act dtype.
        zero = parts.offset + 8 * parts.scale
        self.scale_offset = torch.stack([parts.scale.t(), zero.t()], dim=-1)
        self.scale_offset = self.scale_offset.to(act_dtype).contiguous()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T`."""
        if not self.native:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, self.packed, self.group_size, self.scale_offset
            )
        out = None
        # float32 int4 rows past INT4_FLOAT_GEMV_MAX_ROWS go to the GEMM (float32 only).
        gemv_first = self.round_activations or x.dtype != torch.float32
        if gemv_first or x.shape[0] <= INT4_FLOAT_GEMV_MAX_ROWS:
            out = kernels.int4_gemv(x, self.packed, self.scale_offset, self.round_activations)
        if out is None:
            out = kernels.int4_gemm(x, self.packed, self.scale_offset)
        if out is not None:
            return out
        # bf16 rows (or no native library): dequantize for a dense GEMM.
        dense = kernels.int4_dequantize(self.packed, self.scale_offset, x.dtype)
        return torch.nn.functional.linear(x, dense)

    def matmul_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """float32: the GEMM for every row count; bf16: the GEMV in chunks of its rows. Not
        for w4a8, whose GEMVs round each call's activations."""
        if not self.native or self.round_activations:
            return None
        if x.dtype == torch.float32:
            return kernels.int4_gemm(x, self.packed, self.scale_offset, row_independent=True)
        gemv = lambda r: kernels.int4_gemv(r, self.packed, self.scale_offset)  # noqa: E731
        return in_row_chunks(x, QGEMV_MAX_ROWS, gemv)

    def nbytes(self) -> int:
        """Packed nibbles plus a scale and offset per group."""
        so = self.scale_offset
        return self.packed.numel() * self.packed.element_size() + so.numel() * so.element_size()

    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def native_linear(self, bias: torch.Tensor | None) -> ctypes.Structure | None:
        """In the Q4_1 layout only (PyTorch's packing is not one the C step reads)."""
        if not self.native:
            return None
        kind = "INT4_A8" if self.round_activations else "INT4"
        n, k = self.shape()
        return c_linear(kind, n, k, self.packed.data_ptr(), self.scale_offset.data_ptr(), bias)
