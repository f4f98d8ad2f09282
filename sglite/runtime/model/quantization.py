"""Weight-only quantization (int8 per output channel, int4 per group) of the projections.

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

int4 dequantizes as `q * scale + offset` per group of `group_size` input columns (q in 0..15),
exactly GGUF's Q4_1 (`offset = min`) and Q4_0 (`offset = -8 * scale`) blocks of 32: such tensors
are loaded from the file's own 4-bit values (`int4_parts_from_gguf`), not requantized, and the
native kernel reads them in the file's own nibble order with f16 scale and offset. A Q4_K
super-block is eight such groups whose scales and offsets are products of the block's (6-bit
times f16): its values load as they are too, the products rounded to f16.
"""

from __future__ import annotations

import abc
import ctypes
from dataclasses import dataclass

import numpy as np
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

# int8, q8_0 and int4 are weight-only (activations stay float); w4a8 is int4 whose GEMVs also
# round activations to int8, as llama.cpp does: faster decode, but answers depend on batch and
# cache. q8_0 is GGUF's 8-bit layout (an f16 scale per 32 inputs), which holds GGUF Q8_0 and Q5_0
# tensors exactly.
QUANTIZATIONS = ("none", "int8", "q8_0", "int4", "w4a8")
GGUF_BLOCK = 32
# int4 (float x) rows its GEMV takes in float32 (the decode step's rule too; see kernels.h).
INT4_FLOAT_GEMV_MAX_ROWS = ABI.constants["INT4_FLOAT_GEMV_MAX_ROWS"]
_INT8_ROWS_PER_SLICE = 4096


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
        for r in range(0, weight.shape[0], _INT8_ROWS_PER_SLICE):
            w = weight[r : r + _INT8_ROWS_PER_SLICE].float()
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


def quantize_q8_0(weight: torch.Tensor) -> Q8Weight | None:
    """Round a dense weight to int8 per group of 32 inputs against the group's absolute maximum
    (f16 scale, as GGUF's Q8_0); None when the inputs are not whole groups."""
    n, k = weight.shape
    if k % GGUF_BLOCK:
        return None
    values = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // GGUF_BLOCK, dtype=torch.float16)
    for r in range(0, n, _INT8_ROWS_PER_SLICE):  # bounded float temporaries, as Int8Weight
        w = weight[r : r + _INT8_ROWS_PER_SLICE].float().reshape(-1, k // GGUF_BLOCK, GGUF_BLOCK)
        scale = (w.abs().amax(dim=-1) / 127.0).to(torch.float16)
        safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
        q = torch.round(w / safe[..., None]).clamp(-127, 127)
        values[r : r + len(w)] = q.reshape(len(w), k).to(torch.int8)
        scales[r : r + len(w)] = scale
    return Q8Weight(values, scales)


# GGUF types whose blocks are 32 integers times one leading f16 scale: a Q8Weight holds them
# exactly (`q8_weight_from_gguf_type`).
GGUF_Q8_EXACT_TYPES = ("Q8_0", "Q5_0")


def q8_weight_from_gguf_type(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> Q8Weight:
    """A GGUF Q8_0 or Q5_0 tensor's values as a `Q8Weight`, exactly: Q5_0's 5-bit values minus
    16 fit int8 under the block's own scale."""
    if type_name == "Q8_0":
        return q8_weight_from_gguf(data, shape)
    if type_name != "Q5_0":
        raise ValueError(f"{type_name} blocks are not int8 values times one scale")
    n, k = shape
    values, scale = _q5_0_blocks(data, shape)
    return Q8Weight(values.to(torch.int8).reshape(n, k), scale.reshape(n, k // GGUF_BLOCK))


def q8_weight_from_gguf(data: np.ndarray, shape: tuple[int, int]) -> Q8Weight:
    """A GGUF Q8_0 tensor's raw blocks (34 bytes per 32 values: an f16 scale, then 32 int8) as
    a `Q8Weight` of `shape` `[N, K]`."""
    n, k = shape
    blocks = np.ascontiguousarray(data).reshape(n, k // GGUF_BLOCK, 2 + GGUF_BLOCK)
    scales = torch.from_numpy(blocks[:, :, :2].copy().view(np.float16).reshape(n, -1))
    values = torch.from_numpy(blocks[:, :, 2:].copy().view(np.int8).reshape(n, k))
    return Q8Weight(values, scales)


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


def int4_group_size(in_features: int) -> int | None:
    """The largest supported group size dividing `in_features` (None if none does)."""
    for gs in (32, 64, 128, 256):
        if in_features % gs == 0:
            return gs
    return None


def quantize_int4(weight: torch.Tensor, group_size: int = GGUF_BLOCK) -> Int4Parts:
    """Round a dense weight to 16 levels per group between the group's min and max.

    Scale and offset are rounded to float16 first (the native layout stores them so, like
    GGUF), and the levels are chosen against those rounded values.
    """
    n, k = weight.shape
    w = weight.float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp_min(1e-6).to(torch.float16).float()
    offset = lo.to(torch.float16).float()
    values = torch.round((w - offset[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return Int4Parts(values.reshape(n, k), scale, offset, group_size)


# GGUF 4-bit types whose values load as they are (`int4_parts_from_gguf`).
GGUF_INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
_Q4_K_BLOCK = 256  # weights per Q4_K super-block: 8 groups of 32


def int4_parts_from_gguf(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> Int4Parts:
    """The 4-bit values of a GGUF Q4_0 / Q4_1 / Q4_K tensor (`data`: its raw blocks as uint8).

    Q4_0 block: f16 scale, 16 bytes of nibbles, `w = scale * (q - 8)`; Q4_1 block: f16 scale,
    f16 min, 16 bytes, `w = scale * q + min`. Byte j holds values j (low nibble) and j + 16.
    Scales and offsets come out exactly (f16 values, and -8 * scale is exact). Q4_K: see
    `_q4_k_parts`; its values are exact too, its per-group scales and offsets products.
    """
    if type_name == "Q4_K":
        return _q4_k_parts(data, shape)
    n, k = shape
    scale16, offset16, nibbles = _gguf_q4_blocks(data, type_name, shape)
    scale = scale16[..., 0].astype(np.float32)
    offset = -8 * scale if offset16 is None else offset16[..., 0].astype(np.float32)
    values = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(n, k)
    return Int4Parts(
        torch.from_numpy(values.astype(np.int32)),
        torch.from_numpy(scale),
        torch.from_numpy(offset),
        GGUF_BLOCK,
    )


def _q4_k_parts(data: np.ndarray, shape: tuple[int, int]) -> Int4Parts:
    """A Q4_K tensor's values and per-32 group scales and offsets.

    A super-block of 256 weights: f16 d and dmin, 12 bytes packing eight 6-bit scales and eight
    6-bit mins (unpacked by gguf's own `Q4_K.get_scale_min`), then 128 bytes of nibbles: bytes
    32c..32c+31 hold group 2c in their low nibbles and group 2c + 1 in their high ones. Group g
    is `w = (d * scale_g) * q - dmin * min_g`, i.e. a Q4_1 group with scale `d * scale_g` and
    offset `-dmin * min_g` (products held in float32; the int4 layout stores them as f16).
    """
    from gguf.quants import Q4_K

    n, k = shape
    if k % _Q4_K_BLOCK:
        raise ValueError(f"Q4_K tensor with {k} columns (not whole blocks of {_Q4_K_BLOCK})")
    blocks = np.ascontiguousarray(data).reshape(n * (k // _Q4_K_BLOCK), -1)
    if blocks.shape[-1] != 4 + Q4_K.K_SCALE_SIZE + _Q4_K_BLOCK // 2:
        raise ValueError(f"not a Q4_K tensor: {blocks.shape[-1]}-byte blocks")
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mins = Q4_K.get_scale_min(blocks[:, 4 : 4 + Q4_K.K_SCALE_SIZE].copy())
    qs = blocks[:, 4 + Q4_K.K_SCALE_SIZE :].reshape(-1, 4, 1, 32)
    values = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, k)
    groups = k // GGUF_BLOCK
    scale = (d * sc.astype(np.float32)).reshape(n, groups)
    offset = -(dmin * mins.astype(np.float32)).reshape(n, groups)
    return Int4Parts(
        torch.from_numpy(values.astype(np.int32)),
        torch.from_numpy(scale),
        torch.from_numpy(offset),
        GGUF_BLOCK,
    )


def _gguf_q4_blocks(
    data: np.ndarray, type_name: str, shape: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """The fields of a GGUF Q4_0 / Q4_1 tensor's blocks: f16 scales and (Q4_1) offsets
    `[N, K / 32, 1]`, and the nibble bytes `[N, K / 32, 16]`. Raises ValueError otherwise."""
    n, k = shape
    blocks = np.ascontiguousarray(data).reshape(n, k // GGUF_BLOCK, -1)
    header = 4 if type_name == "Q4_1" else 2
    if type_name not in ("Q4_0", "Q4_1") or blocks.shape[-1] != header + 16:
        raise ValueError(f"not a Q4_0/Q4_1 tensor: {type_name} with {blocks.shape[-1]}-byte blocks")
    scale = blocks[..., 0:2].copy().view(np.float16)
    offset = blocks[..., 2:4].copy().view(np.float16) if type_name == "Q4_1" else None
    return scale, offset, blocks[..., header:]


def dequantize_gguf_fast(
    data: np.ndarray, type_name: str, shape: tuple[int, int]
) -> torch.Tensor | None:
    """A GGUF Q4_0 / Q4_1 (native kernel), Q8_0, Q5_0 or Q4_K (torch) matrix as float32,
    bitwise equal to gguf's numpy code (the same float32 products and sums in the same order)
    but computed by a native kernel or a few whole-tensor torch ops; None where that does not
    apply (other types; Q4_0/Q4_1 without the native library)."""
    if type_name == "Q8_0":
        return _dequantize_q8_0(data, shape)
    if type_name == "Q5_0":
        return _dequantize_q5_0(data, shape)
    if type_name == "Q4_K":
        return _dequantize_q4_k(data, shape)
    if type_name not in ("Q4_0", "Q4_1") or not kernels.native_available():
        return None
    n, k = shape
    scale, offset, nibbles = _gguf_q4_blocks(data, type_name, shape)
    if offset is None:  # Q4_0: offset -8 * scale, exact in float16 unless it overflows
        offset = scale * np.float16(-8)
        if not np.isfinite(offset).all():
            return None
    scale_offset = torch.from_numpy(np.concatenate([scale, offset], axis=-1))
    packed = torch.from_numpy(nibbles.reshape(n, k // 2).copy())
    return kernels.int4_dequantize(packed, scale_offset, torch.float32)


def _dequantize_q8_0(data: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    """Q8_0 blocks (a float16 scale, then 32 int8 values) as a float32 `shape` matrix."""
    n, k = shape
    blocks = np.asarray(data).reshape(n * k // 32, 34)  # a view of the read-only file map
    scale = torch.from_numpy(np.ascontiguousarray(blocks[:, :2]).view(np.float16)).float()
    values = torch.from_numpy(np.ascontiguousarray(blocks[:, 2:]).view(np.int8)).float()
    return values.mul_(scale).reshape(n, k)


def _q5_0_blocks(data: np.ndarray, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_0 blocks (a float16 scale, 32 high bits, 16 bytes of low nibbles: values 0-15 in the
    low nibbles, 16-31 in the high ones) as int32 values `q - 16` `[blocks, 32]` and their
    float16 scales `[blocks, 1]`."""
    n, k = shape
    blocks = np.asarray(data).reshape(n * k // GGUF_BLOCK, 22)
    scale = torch.from_numpy(np.ascontiguousarray(blocks[:, :2]).view(np.float16))
    high = torch.from_numpy(np.ascontiguousarray(blocks[:, 2:6]).view(np.int32))
    low = torch.from_numpy(np.ascontiguousarray(blocks[:, 6:])).to(torch.int32)
    bits = (high >> torch.arange(GGUF_BLOCK, dtype=torch.int32)) & 1
    values = torch.cat([low & 0x0F, low >> 4], dim=1) | (bits << 4)
    return values.sub_(16), scale


def _dequantize_q5_0(data: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    """Q5_0 as a float32 `shape` matrix: `scale * (q - 16)`."""
    values, scale = _q5_0_blocks(data, shape)
    return values.float().mul_(scale.float()).reshape(shape)


def _dequantize_q4_k(data: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    """Q4_K as a float32 `shape` matrix: per group of 32, `(d * scale) * q - dmin * min`."""
    parts = _q4_k_parts(data, shape)
    groups = parts.values.view(shape[0], -1, GGUF_BLOCK).float()
    return groups.mul_(parts.scale.unsqueeze(-1)).add_(parts.offset.unsqueeze(-1)).reshape(shape)


def make_quantized(
    kind: str,
    dense: torch.Tensor,
    act_dtype: torch.dtype,
    parts: Int4Parts | Q8Weight | None = None,
) -> QuantizedWeight | None:
    """The quantized form of one weight (from the checkpoint's own `parts` of that kind when
    given), or None when `kind` cannot apply to its shape."""
    if kind == "int8":
        return Int8Weight(dense, act_dtype)
    if kind == "q8_0":
        return parts if isinstance(parts, Q8Weight) else quantize_q8_0(dense)
    if kind in ("int4", "w4a8"):
        if not isinstance(parts, Int4Parts):
            gs = int4_group_size(dense.shape[1])
            if gs is None:
                return None
            parts = quantize_int4(dense, gs)
        return Int4Weight(parts, act_dtype, round_activations=kind == "w4a8")
    raise ValueError(f"unknown quantization {kind!r}; use one of {', '.join(QUANTIZATIONS)}")
