"""Weight-only quantization of the projections: the kinds (`QUANTIZATIONS`) and the rounding of
a dense weight into one of them (`make_quantized`).

Rounding: int8 symmetric per output channel (`Int8Weight` rounds as it is built), q8_0 to int8
per group of 32 inputs against the group's absolute maximum with an f16 scale (GGUF's Q8_0), int4
to 16 levels per group between the group's min and max, its scale and offset rounded to f16
first (the native layout stores them so, like GGUF).

Invariants: `make_quantized` gives the requested kind or None (the kind cannot apply to the
weight's shape), never another kind; a checkpoint's own values of that kind (`parts`) are used as
they are, not rounded again. The layouts and their kernels live in `quantized_weight.py`; a GGUF's
own blocks read into them, in `gguf_quants.py`.
"""

from __future__ import annotations

import torch

from sglite.runtime.model.quantized_weight import (
    GGUF_BLOCK,
    INT8_ROWS_PER_SLICE,
    Int4Parts,
    Int4Weight,
    Int8Weight,
    Q8Weight,
    QuantizedWeight,
)

# int8, q8_0 and int4 are weight-only (activations stay float); w4a8 is int4 whose GEMVs also
# round activations to int8, as llama.cpp does: faster decode, but answers depend on batch and
# cache. q8_0 is GGUF's 8-bit layout (an f16 scale per 32 inputs), which holds GGUF Q8_0 and Q5_0
# tensors exactly.
QUANTIZATIONS = ("none", "int8", "q8_0", "int4", "w4a8")


def quantize_q8_0(weight: torch.Tensor) -> Q8Weight | None:
    """Round a dense weight to int8 per group of 32 inputs against the group's absolute maximum
    (f16 scale, as GGUF's Q8_0); None when the inputs are not whole groups."""
    n, k = weight.shape
    if k % GGUF_BLOCK:
        return None
    values = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // GGUF_BLOCK, dtype=torch.float16)
    for r in range(0, n, INT8_ROWS_PER_SLICE):  # bounded float temporaries, as Int8Weight
        w = weight[r : r + INT8_ROWS_PER_SLICE].float().reshape(-1, k // GGUF_BLOCK, GGUF_BLOCK)
        scale = (w.abs().amax(dim=-1) / 127.0).to(torch.float16)
        safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
        q = torch.round(w / safe[..., None]).clamp(-127, 127)
        values[r : r + len(w)] = q.reshape(len(w), k).to(torch.int8)
        scales[r : r + len(w)] = scale
    return Q8Weight(values, scales)


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
