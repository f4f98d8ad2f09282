"""One GGUF tensor's rows as a weight holds them (`GGUFPart`): its block type, its bytes as the
file stores them or in a layout of the kernels' (16 rows tiled for the VNNI GEMM, Q5_0 in
quads for the AVX2 int8 GEMV), and the ids, names and sizes the kernels know it by.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sglite.runtime.model.gguf_layouts import TILE_ROWS, unquad_q5_0, untile
from sglite.runtime.model.kernels.abi import ABI

# ggml type names -> ids of the block types the kernels read (kernels.h GGML_TYPE_*).
BLOCK_TYPES = {
    name.removeprefix("GGML_TYPE_"): value
    for name, value in ABI.constants.items()
    if name.startswith("GGML_TYPE_")
}
GGUF_TILED_BASE = ABI.constants["GGUF_TILED_BASE"]  # a tiled part's type: this + ggml's
GGUF_QUADS_Q5_0 = ABI.constants["GGUF_QUADS_Q5_0"]  # a Q5_0 part in quads: its type
TILED_TYPES = ("Q5_0", "Q8_0", "Q4_K", "Q6_K")  # the block types a part may be tiled in


@dataclass(frozen=True)
class GGUFPart:
    """`rows` rows of one GGUF tensor of block type `type_name`: `data` is uint8
    `[rows, row_bytes]` (a view of the mapped file, or a reordered copy); `tiled`: rows (of a
    `TILED_TYPES` type) tiled 16 at a time for the VNNI GEMM (`kernels/gguf_tiles.h`, the same
    bytes), which is then the weight's only product kernel; `quads`: Q5_0 rows four blocks at a
    time for the int8 GEMV on AVX2 builds without VNNI (`kernels/gguf_quads.h`, the same bytes;
    the other kernels read each row back in the file's layout, the VNNI and tile GEMMs refuse
    it)."""

    type_name: str
    data: np.ndarray
    tiled: bool = False
    quads: bool = False

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    def as_stored(self) -> GGUFPart:
        """The part with its rows as the file stores them (a tiled or quads one a copy)."""
        if self.tiled:
            return GGUFPart(self.type_name, untile(self.type_name, self.data))
        return GGUFPart(self.type_name, unquad_q5_0(self.data)) if self.quads else self


def kind_name(part: GGUFPart) -> str:
    """The part's format as the model describes it: q4_k, q4_k x16 tiled (q4_kx16), or q5_0 in
    quads (q5_0x4)."""
    return part.type_name.lower() + ("x16" if part.tiled else "x4" if part.quads else "")


def type_id(part: GGUFPart) -> int:
    """The part's type as the kernels name it (kernels.h): ggml's id, plus GGUF_TILED_BASE
    tiled, or GGUF_QUADS_Q5_0."""
    if part.quads:
        return GGUF_QUADS_Q5_0
    if not part.tiled:
        return BLOCK_TYPES[part.type_name]
    if part.type_name not in TILED_TYPES or part.rows % TILE_ROWS:
        raise ValueError(
            f"only {', '.join(TILED_TYPES)} parts of whole {TILE_ROWS}-row tiles are tiled"
        )
    return GGUF_TILED_BASE + BLOCK_TYPES[part.type_name]


def row_bytes(type_name: str, k: int) -> int:
    """Bytes of one row of `k` values of a block type (ValueError when k is not whole blocks)."""
    import gguf

    kind = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    if k % block:
        raise ValueError(f"{k} values are not whole {type_name} blocks of {block}")
    return k // block * size
