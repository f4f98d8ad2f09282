"""GGUF's quantized blocks read as the file stores them: Q4_0, Q4_1 and Q4_K into the int4 layout
(`int4_parts_from_gguf`), Q8_0 and Q5_0 into the q8_0 layout (`q8_weight_from_gguf_type`), and
those types dequantized to float32 without gguf's slower numpy code (`dequantize_gguf_fast`).

int4 dequantizes as `q * scale + offset` per group of `group_size` input columns (q in 0..15),
exactly GGUF's Q4_1 (`offset = min`) and Q4_0 (`offset = -8 * scale`) blocks of 32: such tensors
are loaded from the file's own 4-bit values (`int4_parts_from_gguf`), not requantized, and the
native kernel reads them in the file's own nibble order with f16 scale and offset. A Q4_K
super-block is eight such groups whose scales and offsets are products of the block's (6-bit
times f16): its values load as they are too, the products rounded to f16.

Invariants: `data` is a tensor's raw blocks (a view of the read-only file map, never written);
values come out exact (Q4_K's scale and offset products are the one rounding, to f16, by the int4
layout); `dequantize_gguf_fast` is bitwise equal to gguf's own dequantization, or None.
"""

from __future__ import annotations

import numpy as np
import torch

from sglite.runtime.model import kernels
from sglite.runtime.model.quantized_weight import GGUF_BLOCK, Int4Parts, Q8Weight

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
