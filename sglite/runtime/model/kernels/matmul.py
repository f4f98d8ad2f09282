"""Matrix products with native kernels: quantized and dense GEMVs for decode-size batches, the
float32 panel GEMM and the int4 GEMM for any batch, each returning None when the native kernel
cannot serve the call (the caller then uses PyTorch)."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from sglite.runtime.model.kernels import native
from sglite.runtime.model.kernels.abi import ABI
from sglite.runtime.model.kernels.native import DTYPE_CODES as _DTYPE_CODES
from sglite.runtime.model.kernels.native import lib_for as _lib_for


def qgemv_max_rows() -> int:
    """Most rows one native GEMV call takes (0 without the native library)."""
    return ABI.constants["QGEMV_MAX_ROWS"] if native.load() is not None else 0


def _gemv_lib(x: torch.Tensor) -> ctypes.CDLL | None:
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
    lib = _gemv_lib(x)
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


def _call_gemv(
    kernel: str, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *extra: int
) -> torch.Tensor | None:
    """`out = x @ W.T` by quant_gemv.c's `kernel` (W as `weight` and `scale`, N = its rows), or
    None when the native library cannot serve x or the kernel refuses."""
    lib = _gemv_lib(x)
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


def gguf_gemv(x: torch.Tensor, parts: int, n_out: int) -> torch.Tensor | None:
    """`x @ W.T` for a few rows `x [M, K]` (float32/bfloat16), `W [n_out, K]` a GGUF weight
    given as the address of its `gguf_part_t` array (see `GGUFWeight`); None when the native
    kernel cannot serve it."""
    lib = _gemv_lib(x)
    return None if lib is None else _call_gguf(lib.gguf_gemv, x, parts, n_out)


def gguf_gemv_a8(x: torch.Tensor, parts: int, n_out: int) -> torch.Tensor | None:
    """`x @ W.T` for any rows `x [M, K]` (float32/bfloat16) with x rounded to int8 as llama.cpp
    rounds it (per 256 values, or 32 where K is not whole super-blocks: see gguf_a8.c), `W` a
    GGUF weight as for `gguf_gemv`. Each row's result depends on that row alone. None when the
    native kernel cannot serve it."""
    lib = _lib_for(x)
    if lib is None or x.dim() != 2 or not x.is_contiguous():
        return None
    if x.shape[0] == 0:
        return x.new_empty(0, n_out)
    return _call_gguf(lib.gguf_gemv_a8, x, parts, n_out)


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


def _call_gguf(kernel: Any, x: torch.Tensor, parts: int, n_out: int) -> torch.Tensor | None:
    """`out = x @ W.T` by a GGUF block kernel (gguf_gemv, gguf_gemv_a8, gguf_gemm_amx), None on
    refusal."""
    rows, k = x.shape
    out = x.new_empty(rows, n_out)
    threads = torch.get_num_threads()
    status = kernel(
        _DTYPE_CODES[x.dtype], x.data_ptr(), parts, out.data_ptr(), rows, n_out, k, threads
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
