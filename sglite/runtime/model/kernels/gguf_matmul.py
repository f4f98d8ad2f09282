"""Products with a GGUF file's weights held as its own blocks (`gguf_weight.GGUFWeight`, passed
as the address of its `gguf_part_t` array), and what this CPU offers them.

Products: the GEMV (`kernels/gguf_blocks.c`), the GEMV and GEMM rounding activations to int8 as
llama.cpp does (`gguf_a8.c`, `gguf_a8_gemm.c`), the bfloat16 tile GEMM (`gguf_amx.c`), the
float32 quantized GEMM (`quant_gemm.c`) and the blocks' dequantization; the gated forms compute
`act(x G^T) * (x U^T)` in one call. The CPU's offer: AMX, AVX512-BF16 dot products and their
measured speed, 512-bit vectors split in halves, and the rows from which each GEMM pays.

Invariant: a product returns None when its kernel cannot serve the call or refuses it (the
caller then takes another path); the CPU's answers are asked of the native library once per
process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from sglite.runtime.model.kernels import native
from sglite.runtime.model.kernels.abi import ABI
from sglite.runtime.model.kernels.matmul import gemv_lib
from sglite.runtime.model.kernels.native import DTYPE_CODES as _DTYPE_CODES
from sglite.runtime.model.kernels.native import lib_for as _lib_for


def gguf_gemv(x: torch.Tensor, parts: int, n_out: int) -> torch.Tensor | None:
    """`x @ W.T` for a few rows `x [M, K]` (float32/bfloat16), `W [n_out, K]` a GGUF weight
    given as the address of its `gguf_part_t` array (see `GGUFWeight`); None when the native
    kernel cannot serve it."""
    lib = gemv_lib(x)
    return None if lib is None else _call_gguf(lib.gguf_gemv, x, parts, n_out)


def gguf_gemv_a8(
    x: torch.Tensor, parts: int, n_out: int, row_independent: bool = False
) -> torch.Tensor | None:
    """`x @ W.T` for any rows `x [M, K]` (float32/bfloat16) with x rounded to int8 as llama.cpp
    rounds it (per 256 values, or 32 where K is not whole super-blocks: see gguf_a8.c), `W` a
    GGUF weight as for `gguf_gemv`. Each row's result depends on that row alone; with
    `row_independent`, bit for bit whatever the row count (else several rows may take a faster
    path, equal to float rounding). None when the native kernel cannot serve it."""
    lib = _lib_for(x)
    if lib is None or x.dim() != 2 or not x.is_contiguous():
        return None
    if x.shape[0] == 0:
        return x.new_empty(0, n_out)
    return _call_gguf(lib.gguf_gemv_a8, x, parts, n_out, int(row_independent))


def gguf_gemm_a8(x: torch.Tensor, parts: int, n_out: int) -> torch.Tensor | None:
    """`gguf_gemv_a8`'s product for many rows with 512-bit VNNI (gguf_a8_gemm.c: weights of
    every block type but Q5_K in whole blocks of 16 rows, k whole decoding units): equal to
    it to float rounding,
    each row's result depending on that row alone. None where it cannot serve x."""
    lib = _lib_for(x)
    if lib is None or x.dim() != 2 or not x.is_contiguous():
        return None
    if x.shape[0] == 0:
        return x.new_empty(0, n_out)
    return _call_gguf(lib.gguf_gemm_a8, x, parts, n_out)


def gguf_gemm_a8_glu(x: torch.Tensor, parts: int, n_out: int, act: int) -> torch.Tensor | None:
    """`act(x G^T) * (x U^T)` (`[M, n_out / 2]`) through `gguf_gemm_a8` for a GGUF weight
    `[G; U]` of `n_out` rows, equal bit for bit to `gguf_gemm_a8` followed by `gated_act`
    (kernels.h `gguf_gemm_a8_glu`; `act` an ACT_* code). None where it cannot serve x."""
    lib = _lib_for(x)
    if lib is None or x.dim() != 2 or not x.is_contiguous():
        return None
    return _call_gated(lib.gguf_gemm_a8_glu, x, parts, n_out, act)


def gguf_gemm_amx(x: torch.Tensor, parts: int, n_out: int) -> torch.Tensor | None:
    """`x @ W.T` for bfloat16 `x [M, K]` on AMX tiles, or with AVX512-BF16 dot products where
    the CPU has no AMX (gguf_amx.c: the weight decoded to bfloat16 a block of rows at a time,
    sums in float32; each row's result depends on that row alone), `W` a GGUF weight as for
    `gguf_gemv`. None where neither can serve it."""
    lib = _lib_for(x)
    if lib is None or x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous():
        return None
    if x.shape[0] == 0:
        return x.new_empty(0, n_out)
    return _call_gguf(lib.gguf_gemm_amx, x, parts, n_out)


def gguf_gemm_amx_glu(x: torch.Tensor, parts: int, n_out: int, act: int) -> torch.Tensor | None:
    """`act(x G^T) * (x U^T)` (`[M, n_out / 2]`) for bfloat16 x and a GGUF weight `[G; U]` of
    `n_out` rows, on AMX tiles, equal bit for bit to `gguf_gemm_amx` followed by `gated_act`
    (kernels.h `gguf_gemm_amx_glu`; `act` an ACT_* code). None where it cannot serve x."""
    lib = _lib_for(x)
    if lib is None or x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous():
        return None
    return _call_gated(lib.gguf_gemm_amx_glu, x, parts, n_out, act)


def _call_gated(
    kernel: Any, x: torch.Tensor, parts: int, n_out: int, act: int
) -> torch.Tensor | None:
    """`[M, n_out / 2]` = a gated GGUF kernel's product (gguf_gemm_a8_glu, gguf_gemm_amx_glu),
    None on refusal."""
    rows, k = x.shape
    out = x.new_empty(rows, n_out // 2)
    if rows == 0:
        return out
    threads = torch.get_num_threads()
    status = kernel(
        _DTYPE_CODES[x.dtype], act, x.data_ptr(), parts, out.data_ptr(), rows, n_out, k, threads
    )
    return out if status == 0 else None


@functools.cache
def amx_available() -> bool:
    """Whether `gguf_gemm_amx` runs on AMX tiles here (an AMX build, CPU and OS permission)."""
    lib = native.load()
    return lib is not None and bool(lib.amx_gemm_available())


@functools.cache
def tile_gemm_available() -> bool:
    """Whether `gguf_gemm_amx` runs here at all: on AMX tiles, or with AVX512-BF16 dot
    products where the CPU has no AMX."""
    lib = native.load()
    return lib is not None and bool(lib.tile_gemm_available())


@functools.cache
def vectors_512_split() -> bool:
    """Whether this CPU runs 512-bit vector operations as two 256-bit halves (AMD Zen 4;
    kernels.h `vectors_512_split`), where the int8 GEMV keeps more rows before the VNNI GEMM."""
    lib = native.load()
    return lib is not None and bool(lib.vectors_512_split())


@functools.cache
def bf16_dot_speed_percent() -> int:
    """A `vdpbf16ps`'s measured rate in percent of a `vfmadd231ps`'s here (kernels.h
    `bf16_dot_speed_percent`; 0 without the native library or AVX512-BF16)."""
    lib = native.load()
    return int(lib.bf16_dot_speed_percent()) if lib else 0


@functools.cache
def bf16_matmul_pays() -> bool:
    """Whether bf16 products are at least as fast as float32 ones here: AMX tiles, or AVX512-BF16
    dot products at `BF16_DOT_PAYS_PERCENT` of an FMA's rate or more (kernels.h
    `bf16_dot_pays`, which `SGLITE_BF16_DOT=0/1` overrides). Where they are not, no weight takes
    `gguf_gemm_amx` and large bf16 batches multiply a float32 decoding of the weight."""
    lib = native.load()
    return lib is not None and bool(lib.amx_gemm_available() or lib.bf16_dot_pays())


def gguf_tile(type_id: int, rows: np.ndarray, out: np.ndarray, k: int) -> bool:
    """Rows of ggml block type `type_id` (Q5_0, Q4_K or Q6_K; uint8 `[n, row_bytes]`, n a
    multiple of 16, k values a row) tiled into `out` (the same shape) for `gguf_gemm_a8`
    (kernels/gguf_tiles.h), on torch's threads; False where the native library is missing or
    refuses the type or shape."""
    threads = torch.get_num_threads()
    return _relaid(
        rows, out, lambda lib, src, dst: lib.gguf_tile(type_id, src, dst, len(rows), k, threads)
    )


def gguf_quad_q5_0(rows: np.ndarray, out: np.ndarray, k: int) -> bool:
    """Q5_0 rows (uint8 `[n, row_bytes]`, k values a row, k a multiple of 128) in quads into
    `out` (the same shape; `rows` itself for in place) for the int8 GEMV
    (kernels/gguf_quads.h); False where the native library is missing or refuses the shape."""
    return _relaid(rows, out, lambda lib, src, dst: lib.gguf_quad_q5_0(src, dst, len(rows), k))


def _relaid(rows: np.ndarray, out: np.ndarray, call: Callable[[Any, int, int], int]) -> bool:
    """`call(lib, src, dst)` (a layout's C function: 0 when it wrote `out`) on uint8 `rows` and
    a C-contiguous `out` of their shape; False where the library is missing or either is not
    so, or the function refuses."""
    lib = native.load()
    if lib is None or rows.shape != out.shape or rows.dtype != np.uint8:
        return False
    if not out.flags.c_contiguous:
        return False
    src = np.ascontiguousarray(rows)  # held while C reads it
    return call(lib, src.ctypes.data, out.ctypes.data) == 0


def gguf_quads_pay() -> bool:
    """Whether this build's int8 GEMV reads Q5_0 parts in quads faster than in the file's rows
    (kernels.h `gguf_quads_pay`: AVX2 builds without AVX-512 VNNI)."""
    lib = native.load()
    return lib is not None and bool(lib.gguf_quads_pay())


def gguf_a8_gemm_min_rows(parts: int, n_out: int, k: int) -> int:
    """The rows from which a batch rounding activations takes `gguf_gemm_a8` (kernels.h
    `gguf_a8_gemm_min_rows`: later for weights mostly of Q6_K blocks); `KERNEL_OFF_ROWS` where
    the GEMM cannot serve the weight (no VNNI-512 build, blocks it does not read)."""
    lib = native.load()
    if lib is None:
        return ABI.constants["KERNEL_OFF_ROWS"]
    return int(lib.gguf_a8_gemm_min_rows(parts, n_out, k))


def gguf_amx_min_rows(parts: int, n_out: int, k: int) -> int:
    """The bf16 rows from which a GGUF weight (a `gguf_part_t` array at `parts`, rows of `k`
    values) goes to `gguf_gemm_amx` (kernels.h `gguf_amx_min_rows`: later for weights mostly
    of Q6_K blocks unless their rows are short, and later with AVX512-BF16 dot products than on
    AMX tiles; `KERNEL_OFF_ROWS` where bf16 products do not pay, `bf16_matmul_pays`)."""
    lib = native.load()
    return int(lib.gguf_amx_min_rows(parts, n_out, k)) if lib else ABI.constants["AMX_MIN_ROWS"]


def _call_gguf(
    kernel: Any, x: torch.Tensor, parts: int, n_out: int, *options: int
) -> torch.Tensor | None:
    """`out = x @ W.T` by a GGUF block kernel (gguf_gemv, gguf_gemv_a8, gguf_gemm_a8,
    gguf_gemm_amx; `options`: the kernel's arguments after the thread count), None on
    refusal."""
    rows, k = x.shape
    out = x.new_empty(rows, n_out)
    threads = torch.get_num_threads()
    status = kernel(
        _DTYPE_CODES[x.dtype],
        x.data_ptr(),
        parts,
        out.data_ptr(),
        rows,
        n_out,
        k,
        threads,
        *options,
    )
    return out if status == 0 else None


def gguf_gemm(
    x: torch.Tensor,
    parts: int,
    n_out: int,
    bias: torch.Tensor | None = None,
    row_independent: bool = False,
) -> torch.Tensor | None:
    """`x @ W.T (+ bias)` for float32 `x [M, K]`, any M, `W` a GGUF weight as for `gguf_gemv`,
    through the quantized GEMM (each weight row decoded once per call, in cache)."""
    lib = native.load()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
        return None
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() != n_out):
        return None
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()  # held until the call returns
    out = x.new_empty(x.shape[0], n_out)
    status = lib.quant_gemm(
        ABI.constants["QUANT_GEMM_GGUF"],
        x.data_ptr(),
        parts,
        None,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        n_out,
        x.shape[1],
        torch.get_num_threads(),
        int(row_independent),
    )
    return out if status == 0 else None


def gguf_dequantize(
    parts: int,
    n_out: int,
    k: int,
    dtype: torch.dtype,
    ids: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Rows `ids` (int64; None: all `n_out`) of a GGUF weight as dense `[len, k]` in `dtype`
    (into `out` when given); None without the native library or for ids out of range."""
    lib = native.load()
    if lib is None or dtype not in _DTYPE_CODES:
        return None
    count = n_out if ids is None else ids.numel()
    if ids is not None:
        ids = ids.to(torch.int64).contiguous()
    if out is None:
        out = torch.empty(count, k, dtype=dtype)
    status = lib.gguf_dequantize(
        _DTYPE_CODES[dtype],
        parts,
        None if ids is None else ids.data_ptr(),
        count,
        n_out,
        k,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out if status == 0 else None
