"""Dense products with native kernels: the float GEMV for decode-size batches (`dense_gemv`) and
the float32 panel GEMM for any batch (`pack_panels`, `panel_gemm`); and the row limit every
native GEMV shares (`qgemv_max_rows`, `gemv_lib`).

Invariant: a product returns None when the native kernel cannot serve the call, having computed
nothing (the caller then uses PyTorch). Products with quantized weights are in
`quant_matmul.py`, those with a GGUF file's blocks in `gguf_matmul.py`.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from sglite.runtime.model.kernels import native
from sglite.runtime.model.kernels.abi import ABI
from sglite.runtime.model.kernels.native import DTYPE_CODES as _DTYPE_CODES
from sglite.runtime.model.kernels.native import lib_for as _lib_for


def qgemv_max_rows() -> int:
    """Most rows one native GEMV call takes (0 without the native library)."""
    return ABI.constants["QGEMV_MAX_ROWS"] if native.load() is not None else 0


def gemv_lib(x: torch.Tensor) -> ctypes.CDLL | None:
    lib = _lib_for(x)
    if lib is None or x.dim() != 2 or not x.is_contiguous():
        return None
    if x.shape[0] > ABI.constants["QGEMV_MAX_ROWS"]:
        return None
    return lib


def dense_gemv(
    x: torch.Tensor, weight: torch.Tensor, any_dtype: bool = False
) -> torch.Tensor | None:
    """`x @ weight.T` for a few float32 rows `x [M, K]` (as many as the quantized GEMVs take),
    reading `weight [N, K]` once with all cores; None when the native kernel cannot serve it.
    For the output projection of decode, where PyTorch's float32 GEMV reaches about half the
    machine's memory bandwidth. `any_dtype`: bfloat16 too (deterministic inference's rows; for
    speed PyTorch's bf16 GEMV is used elsewhere)."""
    lib = gemv_lib(x)
    dtypes = (torch.float32, torch.bfloat16) if any_dtype else (torch.float32,)
    if lib is None or x.dtype != weight.dtype or x.dtype not in dtypes:
        return None
    if not weight.is_contiguous():
        return None
    rows, k = x.shape
    out = x.new_empty(rows, weight.shape[0])
    status = lib.dense_gemv_rows(
        _DTYPE_CODES[x.dtype],
        x.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        weight.shape[0],
        k,
        torch.get_num_threads(),
    )
    return out if status == 0 else None


@functools.cache
def _panel_width() -> int:
    """Output columns per panel of the built kernel (asked once, not on every product)."""
    lib = native.load()
    return int(lib.panel_width()) if lib is not None else 0


def pack_panels(weight: torch.Tensor) -> torch.Tensor | None:
    """A float32 CPU weight `[N, K]` as `panel_gemm` reads it, `[ceil(N / P), K, P]` for the
    kernel's panel width P (zero rows pad the last panel); None without the native library."""
    lib = native.load()
    if lib is None or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    width = _panel_width()
    n_out, k = weight.shape
    padded = weight.new_zeros((n_out + width - 1) // width * width, k)
    padded[:n_out] = weight
    return padded.view(-1, width, k).transpose(1, 2).contiguous()


def panel_gemm(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n_out: int
) -> torch.Tensor | None:
    """`x @ W.T + bias` for float32 `x [M, K]` and `panels` from `pack_panels(W)`, any M; None
    when the native kernel cannot serve it (then nothing was computed)."""
    lib = native.load()
    tensors = (x, panels) if bias is None else (x, panels, bias)
    if lib is None or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return None
    if x.dim() != 2 or panels.dim() != 3 or x.shape[1] != panels.shape[1]:
        return None
    if panels.shape[2] != _panel_width() or not panels.is_contiguous():
        return None  # the kernel reads ceil(n_out / width) panels of k * width floats
    if panels.shape[0] * panels.shape[2] < n_out or (bias is not None and bias.numel() != n_out):
        return None
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()  # held until the call returns
    out = x.new_empty(x.shape[0], n_out)
    lib.panel_gemm(
        x.data_ptr(),
        panels.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        n_out,
        x.shape[1],
        torch.get_num_threads(),
    )
    return out
