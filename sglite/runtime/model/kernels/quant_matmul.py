"""Products with the quantized weights of `quantized_weight.py` (int8 per output channel, int4 in
GGUF's Q4_1 layout, GGUF's Q8_0): GEMVs for decode-size batches (`kernels/quant_gemv.c`), the
float32 GEMM for any batch (`kernels/quant_gemm.c`), and int4's dequantization.

Invariant: a product returns None when the native kernel cannot serve the call (dtype, shape,
layout, or no native library), so the caller falls back to another path; `int4_dequantize`
always answers (with PyTorch ops where the native library cannot).
"""

from __future__ import annotations

import torch

from sglite.runtime.model.kernels import native
from sglite.runtime.model.kernels.matmul import gemv_lib
from sglite.runtime.model.kernels.native import DTYPE_CODES as _DTYPE_CODES


def _call_gemv(
    kernel: str, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *extra: int
) -> torch.Tensor | None:
    """`out = x @ W.T` by quant_gemv.c's `kernel` (W as `weight` and `scale`, N = its rows), or
    None when the native library cannot serve x or the kernel refuses."""
    lib = gemv_lib(x)
    if lib is None:
        return None
    rows, k = x.shape
    n = weight.shape[0]
    out = x.new_empty(rows, n)
    args = (x.data_ptr(), weight.data_ptr(), scale.data_ptr(), out.data_ptr(), rows, n, k)
    status = getattr(lib, kernel)(_DTYPE_CODES[x.dtype], *args, torch.get_num_threads(), *extra)
    return out if status == 0 else None


def int8_gemv(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """`x @ (values * scale[:, None]).T` for a few rows `x [M, K]` (float32/bfloat16); `values`
    int8 `[N, K]`, `scale` float32 `[N]`. None when the native kernel cannot serve it."""
    return _call_gemv("int8_gemv", x, values, scale)


def int4_gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale_offset: torch.Tensor,
    round_activations: bool = False,
) -> torch.Tensor | None:
    """`x @ W.T` for a few rows, `W` int4 in GGUF Q4_1 layout: `packed` uint8 `[N, K / 2]`,
    `scale_offset` float16 `[N, K / 32, 2]`. None when the native kernel cannot serve it.
    `round_activations` (w4a8) rounds x to int8 per group of 32 where the CPU has an integer
    kernel for it (AVX2, AVX-512 VNNI): faster, but no longer the dequantized weights' product."""
    return _call_gemv("int4_gemv", x, packed, scale_offset, int(round_activations))


def q8_gemv(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """`x @ W.T` for a few rows, `W` in GGUF Q8_0 layout: `values` int8 `[N, K]`, `scales`
    float16 `[N, K / 32]` (x stays float). None when the native kernel cannot serve it."""
    n = values.shape[0]
    if values.dtype != torch.int8 or scales.dtype != torch.float16:
        return None
    if values.shape[1] != x.shape[1] or scales.shape != (n, x.shape[1] // 32):
        return None
    return _call_gemv("q8_gemv", x, values, scales)


def _quant_gemm(
    kind: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    row_independent: bool,
) -> torch.Tensor | None:
    lib = native.load()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
        return None
    if x.shape[1] != k or not (weight.is_contiguous() and scale.is_contiguous()):
        return None
    n = weight.shape[0]
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() != n):
        return None
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()  # held until the call returns
    out = x.new_empty(x.shape[0], n)
    status = lib.quant_gemm(
        kind,
        x.data_ptr(),
        weight.data_ptr(),
        scale.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        n,
        k,
        torch.get_num_threads(),
        int(row_independent),
    )
    return out if status == 0 else None


def int4_gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale_offset: torch.Tensor,
    bias: torch.Tensor | None = None,
    row_independent: bool = False,
) -> torch.Tensor | None:
    """`x @ W.T (+ bias)` for float32 `x [M, K]`, any M, `W` int4 as for `int4_gemv`, with x
    kept in float32 (no activation rounding); each weight is dequantized once per call, in
    cache, so no dense copy of W is needed. None when the native kernel cannot serve it
    (K not a multiple of 32 among others). `row_independent`: each row's result the same for
    any M (see kernels.h), a little slower from 128 rows."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if packed.dtype != torch.uint8 or scale_offset.dtype != torch.float16:
        return None
    if scale_offset.shape != (n, k // 32, 2):
        return None
    return _quant_gemm(2, x, packed, scale_offset, bias, k, row_independent)


def int8_gemm(
    x: torch.Tensor,
    values: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    row_independent: bool = False,
) -> torch.Tensor | None:
    """`int4_gemm` for an int8 weight as `int8_gemv` takes it (`values` int8 `[N, K]`,
    `scale` float32 `[N]`)."""
    if values.dtype != torch.int8 or scale.dtype != torch.float32:
        return None
    if values.dim() != 2 or scale.numel() != values.shape[0]:
        return None
    return _quant_gemm(1, x, values, scale, bias, values.shape[1], row_independent)


def q8_gemm(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, row_independent: bool = False
) -> torch.Tensor | None:
    """`int4_gemm` for a GGUF Q8_0 weight as `q8_gemv` takes it."""
    if values.dtype != torch.int8 or scales.dtype != torch.float16 or values.dim() != 2:
        return None
    if scales.shape != (values.shape[0], values.shape[1] // 32):
        return None
    return _quant_gemm(3, x, values, scales, None, values.shape[1], row_independent)


def int4_dequantize(
    packed: torch.Tensor, scale_offset: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The dense `[N, K]` weight of an int4 weight in GGUF Q4_1 layout, in `dtype`."""
    n, k = packed.shape[0], packed.shape[1] * 2
    lib = native.load()
    if lib is None or dtype not in _DTYPE_CODES:
        v = packed.view(n, -1, 16)
        values = torch.stack([v & 0x0F, v >> 4], dim=2).reshape(n, k).float()
        so = scale_offset.float().repeat_interleave(32, dim=1)
        return (values * so[..., 0] + so[..., 1]).to(dtype)
    out = torch.empty(n, k, dtype=dtype)
    lib.int4_dequantize(
        _DTYPE_CODES[dtype],
        packed.data_ptr(),
        scale_offset.data_ptr(),
        out.data_ptr(),
        n,
        k,
        torch.get_num_threads(),
    )
    return out
