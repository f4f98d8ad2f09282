"""The kernels' own layouts of a GGUF weight's rows, read back to the file's in numpy: the
layouts' definitions, written out independently of the C that builds them (tests compare the
two byte for byte).

- tiled (`kernels/gguf_tiles.h`): 16 rows of a Q5_0, Q8_0, Q4_K or Q6_K part interleaved in the
  VNNI GEMM's lane order (`untile`);
- quads (`kernels/gguf_quads.h`): each row of a Q5_0 part four blocks at a time, for the int8
  GEMV on AVX2 builds without VNNI (`unquad_q5_0`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sglite.runtime.model.kernels.abi import ABI

TILE_ROWS = ABI.constants["GGUF_TILE_ROWS"]  # rows per tile of a tiled part
QUAD_VALUES = 128  # values per quad (four Q5_0 blocks of 32)
QUAD_BYTES = 88  # its bytes: the four blocks' 22 each


def untile(type_name: str, tiled: np.ndarray) -> np.ndarray:
    """Tiled rows of `type_name` (uint8 `[n, row_bytes]`, n a multiple of 16) back in the file's
    layout (`untile_q5_0`, `untile_words`)."""
    return untile_q5_0(tiled) if type_name == "Q5_0" else untile_words(type_name, tiled)


@dataclass(frozen=True)
class _WordTiling:
    """How a block type is tiled as word vectors (kernels/gguf_tiles.c's word_tiling): a block's
    bytes, where its f16 d lies (-1: none apart; the 16 rows' d first in a tiled block), and its
    segments (byte in a row's block, byte of the first vector in the tiled block, words)."""

    block_bytes: int
    d_at: int
    segments: tuple[tuple[int, int, int], ...]


_WORD_TILINGS = {
    "Q4_K": _WordTiling(144, -1, ((0, 0, 4), (16, 256, 32))),
    "Q6_K": _WordTiling(210, 208, ((192, 32, 4), (0, 288, 32), (128, 2336, 16))),
    "Q8_0": _WordTiling(34, 0, ((2, 32, 8),)),
}


def untile_words(type_name: str, tiled: np.ndarray) -> np.ndarray:
    """Tiled Q8_0, Q4_K or Q6_K rows (`kernels/gguf_tiles.h`, uint8 `[n, row_bytes]`, n a
    multiple of 16) back in the file's layout: the layout's definition, written out in numpy."""
    n, row_bytes = tiled.shape
    tiling = _WORD_TILINGS[type_name]
    size = tiling.block_bytes
    blocks = row_bytes // size
    t = tiled.reshape(n // TILE_ROWS, blocks, TILE_ROWS * size)
    out = np.empty((n // TILE_ROWS, TILE_ROWS, blocks, size), dtype=np.uint8)
    for start, at, words in tiling.segments:
        vectors = t[:, :, at : at + 64 * words].reshape(-1, blocks, words, TILE_ROWS, 4)
        own = vectors.transpose(0, 3, 1, 2, 4).reshape(-1, TILE_ROWS, blocks, 4 * words)
        out[..., start : start + 4 * words] = own
    if tiling.d_at >= 0:
        d = t[:, :, : 2 * TILE_ROWS].reshape(-1, blocks, TILE_ROWS, 2)
        out[..., tiling.d_at : tiling.d_at + 2] = d.transpose(0, 2, 1, 3)
    return out.reshape(n, row_bytes)


def untile_q5_0(tiled: np.ndarray) -> np.ndarray:
    """Tiled Q5_0 rows (`kernels/gguf_tiles.h`, uint8 `[n, row_bytes]`, n a multiple of 16)
    back in the file's layout: the layout's definition, written out in numpy."""
    n, row_bytes = tiled.shape
    blocks = row_bytes // 22
    # [tile, block, 352 bytes] -> per row r of the tile: d, qh, qs of each block
    t = tiled.reshape(n // TILE_ROWS, blocks, 352)
    d = t[:, :, :32].reshape(-1, blocks, TILE_ROWS, 2)
    masks = t[:, :, 32:96].copy().view(np.uint64).reshape(-1, blocks, 8)
    qs = t[:, :, 96:].reshape(-1, blocks, 4, TILE_ROWS, 4)
    r = np.arange(TILE_ROWS, dtype=np.uint64)
    # qh's nibble g of row r is bits 4r..4r+3 of mask g
    nibbles = (masks[:, :, :, None] >> (np.uint64(4) * r)) & np.uint64(0xF)  # [t, j, g, r]
    qh = (nibbles << (np.uint64(4) * np.arange(8, dtype=np.uint64))[:, None]).sum(axis=2)
    out = np.empty((n // TILE_ROWS, TILE_ROWS, blocks, 22), dtype=np.uint8)
    out[..., 0:2] = d.transpose(0, 2, 1, 3)
    qh_rows = np.ascontiguousarray(qh.astype("<u4").transpose(0, 2, 1))  # [t, r, j]
    out[..., 2:6] = qh_rows.view(np.uint8).reshape(n // TILE_ROWS, TILE_ROWS, blocks, 4)
    out[..., 6:22] = qs.transpose(0, 3, 1, 2, 4).reshape(n // TILE_ROWS, TILE_ROWS, blocks, 16)
    return out.reshape(n, row_bytes)


def unquad_q5_0(quads: np.ndarray) -> np.ndarray:
    """Q5_0 rows in quads (`kernels/gguf_quads.h`, uint8 `[n, row_bytes]`) back in the file's
    layout: the layout's definition, written out in numpy."""
    n, row_bytes = quads.shape
    q = quads.reshape(n, row_bytes // QUAD_BYTES, QUAD_BYTES)
    out = np.empty((n, row_bytes // QUAD_BYTES, 4, 22), dtype=np.uint8)
    out[..., 0:2] = q[..., :8].reshape(n, -1, 4, 2)
    i = np.arange(32)
    first_bits = 8 * (i % 8) + 4 + i // 8  # value i's fifth bit in a pair's word: first block
    second_bits = 8 * (i % 8) + 3 - i // 8  # and second block
    for p in range(2):
        word = q[..., 8 + 8 * p : 16 + 8 * p].copy().view("<u8")[..., 0]
        nibbles = q[..., 24 + 32 * p : 56 + 32 * p]
        for j, bits in ((2 * p, first_bits), (2 * p + 1, second_bits)):
            fifth = (word[..., None] >> bits.astype(np.uint64)) & np.uint64(1)
            high = (fifth << i.astype(np.uint64)).sum(axis=-1).astype("<u4")
            out[..., j, 2:6] = high[..., None].view(np.uint8)
            values = nibbles & 0x0F if j % 2 == 0 else nibbles >> 4
            out[..., j, 6:22] = values[..., :16] | (values[..., 16:] << 4)
    return out.reshape(n, row_bytes)
