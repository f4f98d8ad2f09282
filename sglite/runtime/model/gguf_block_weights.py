"""The GGUF tensors a model holds as the file's blocks (`GGUFWeight`), found per projection.

`gguf_block_weights` walks the model's `Linear`s and takes every one whose GGUF tensors are all
of a block type the kernels read (`gguf_part.BLOCK_TYPES`), plus the embedding and the output
projection; the dense load then skips the tensors it took (`BlockWeights.consumed`).

Invariants: a `GGUFWeight` built here has exactly the shape of the projection it replaces, its
rows in rotate-half order (llama's permuted q/k reordered into a copy) and, with a
tensor-parallel plan, only this rank's rows or input columns; a projection that cannot be held
so is left whole to the dense path, never half taken. The file map is only read: blocks are
views of it unless reordered or cut by columns (copies), or read into a `WeightArena`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from sglite.runtime.distributed.sharding import TensorParallelPlan
from sglite.runtime.model import kernels
from sglite.runtime.model.checkpoint import checkpoint_names
from sglite.runtime.model.config import ModelConfig
from sglite.runtime.model.gguf_index import GGUFFile
from sglite.runtime.model.gguf_layouts import QUAD_VALUES, TILE_ROWS
from sglite.runtime.model.gguf_loader import gguf_family, hf_name, unpermute_rows
from sglite.runtime.model.gguf_part import BLOCK_TYPES, GGUFPart
from sglite.runtime.model.gguf_weight import KERNEL_OFF_ROWS, DecodeScratch, GGUFWeight
from sglite.runtime.model.models.base import rename_parts
from sglite.runtime.model.weight_arena import WeightArena


@dataclass
class BlockWeights:
    """The GGUF tensors a model holds as blocks (`GGUFWeight`): projections by module path, the
    embedding, the output projection (the embedding's weight when tied), and the GGUF tensor
    names they took (the dense load skips them)."""

    projections: dict[str, GGUFWeight] = field(default_factory=dict)
    embedding: GGUFWeight | None = None
    head: GGUFWeight | None = None
    consumed: set[str] = field(default_factory=set)


def gguf_block_weights(
    gf: GGUFFile,
    model: nn.Module,
    config: ModelConfig,
    plan: TensorParallelPlan | None = None,
    round_activations: bool = False,
    arena: WeightArena | None = None,
    tiled_types: frozenset[str] = frozenset(),
    tile_head: bool = False,
    round_float32_extend: bool = False,
    quads: bool = False,
) -> BlockWeights:
    """Every projection, the embedding and the output projection of `model` whose GGUF tensors
    are all of a block type the kernels read, as `GGUFWeight`s over the file's blocks: read into
    `arena` (`weight_arena.py`), or without one, views of the mapped file (`config`: the whole
    model's). Rows the file stores permuted (llama's q/k) are reordered into a copy; with a
    tensor-parallel `plan`, each tensor is cut to this rank's rows (a view) or input columns (a
    copy of whole blocks; a projection whose cut falls inside a block is left to the dense
    path). Projections made of other tensors (float, other types, 3D experts) are not included.
    `round_activations`: the weights' products round x to int8 (`GGUFWeight`). With it, the
    projections' parts of `tiled_types` (of `TILED_TYPES`) are tiled for the VNNI GEMM
    (`GGUFPart.tiled`), in each projection the GEMM serves as a whole; the embedding and the
    output projection too with `tile_head` (else they keep the file's rows: a draft
    vocabulary cuts a head by rows).
    `round_float32_extend`: float32 EXTEND passes round x too (`GGUFWeight`).
    `quads` (with `round_activations` and an `arena`): the projections' Q5_0 parts that are not
    tiled, of rows of a multiple of 128 values, are held in quads for the int8 GEMV
    (`GGUFPart.quads`; where `kernels.gguf_quads_pay`), laid out as the arena reads them;
    without an arena the blocks stay views of the file's mapping, shared with other processes
    that map it."""
    from sglite.runtime.model.linear import Linear

    family = gguf_family(gf, gf.path)
    by_name: dict[str, Any] = {}
    for tensor in gf.tensors:
        name = hf_name(tensor.name)
        if name is not None:
            by_name[rename_parts(name, family.gguf_renames)] = tensor
    scratch = DecodeScratch()
    out = BlockWeights()

    def weight(
        names: list[str],
        heads: list[int | None],
        shape: tuple[int, int] | None = None,
        tile: frozenset[str] = frozenset(),
        quad: bool = False,
    ) -> GGUFWeight | None:
        """The tensors `names` as one weight, or None where they cannot be one (of `shape`,
        when given)."""
        tensors = [by_name.get(n) for n in names]
        if any(t is None or t.tensor_type.name not in BLOCK_TYPES for t in tensors):
            return None
        if any(len(t.shape) != 2 for t in tensors):
            return None
        k = int(tensors[0].shape[0])
        kinds, blocks = [], []
        for name, tensor, h in zip(names, tensors, heads, strict=True):
            kinds.append(tensor.tensor_type.name)
            rows: np.ndarray | None = _block_rows(tensor, h)
            if plan is not None:
                rows, k = _rank_blocks(plan, name, kinds[-1], rows, int(tensor.shape[0]))
            if rows is None:
                return None
            blocks.append(rows)
        if shape is not None and (sum(b.shape[0] for b in blocks), k) != shape:
            return None
        out.consumed.update(t.name for t in tensors)
        parts = [GGUFPart(kind, b) for kind, b in zip(kinds, blocks, strict=True)]
        if tile and round_activations:
            parts = tiled_parts(parts, k, tile, arena) or parts
        if quad and round_activations and arena is not None and k % QUAD_VALUES == 0:
            parts = [_quads(p, k, arena) if _quadded(p) else p for p in parts]
        if arena is not None:
            parts = [p if p.tiled or p.quads else _placed(p, arena) for p in parts]
        return GGUFWeight(parts, k, scratch, round_activations, round_float32_extend)

    def permuted_heads(name: str) -> int | None:
        if family.gguf_permuted_qk and ".self_attn.q_proj." in name:
            return config.num_heads
        if family.gguf_permuted_qk and ".self_attn.k_proj." in name:
            return config.num_kv_heads
        return None

    for path, module in model.named_modules():
        if not isinstance(module, Linear) or path == "lm_head":
            continue
        names = checkpoint_names(model, path)
        shape = (module.out_features, module.in_features)
        found = weight(names, [permuted_heads(n) for n in names], shape, tiled_types, quads)
        if found is None and len(names) > 1:  # stored fused in the file (Phi-3)
            found = weight([f"model.{path}.weight"], [None], shape)
        if found is not None:
            out.projections[path] = found
    head_tiles = tiled_types if tile_head else frozenset()
    out.embedding = weight(["model.embed_tokens.weight"], [None], tile=head_tiles)
    tied = config.tie_word_embeddings
    out.head = out.embedding if tied else weight(["lm_head.weight"], [None], tile=head_tiles)
    return out


def tiled_parts(
    parts: list[GGUFPart], k: int, types: frozenset[str], arena: WeightArena | None = None
) -> list[GGUFPart] | None:
    """The parts with those of `types` tiled (into `arena` when given), or None where a weight
    of them has no such part or the VNNI GEMM would not serve it whole (every part of whole
    16-row tiles, k whole decoding units, a VNNI-512 build)."""
    if not any(p.type_name in types for p in parts):
        return None
    probe = GGUFWeight(parts, k, round_activations=True)
    if probe.a8_gemm_min_rows >= KERNEL_OFF_ROWS or any(p.rows % TILE_ROWS for p in parts):
        return None
    return [_tiled(p, k, arena) if p.type_name in types else p for p in parts]


def _tiled(part: GGUFPart, k: int, arena: WeightArena | None) -> GGUFPart:
    """A part tiled: into `arena` when given, on its reading threads as each piece of whole
    tiles is read (the file's pages are then read once, by `preadv`, not faulted in through
    its mapping on the loading thread); else now."""
    type_id = BLOCK_TYPES[part.type_name]

    def tile(rows: np.ndarray, out: np.ndarray) -> None:
        if not kernels.gguf_tile(type_id, rows, out, k):
            raise RuntimeError(f"the native library could not tile a {part.type_name} part")

    if arena is None:
        out = np.empty_like(part.data)
        tile(part.data, out)
        return GGUFPart(part.type_name, out, tiled=True)
    placed = arena.place(part.data, lambda rows: tile(rows.copy(), rows), TILE_ROWS)
    return GGUFPart(part.type_name, placed, tiled=True)


def _quadded(part: GGUFPart) -> bool:
    """Whether a part is one that quads hold: Q5_0, not tiled."""
    return part.type_name == "Q5_0" and not part.tiled


def _quads(part: GGUFPart, k: int, arena: WeightArena) -> GGUFPart:
    """A Q5_0 part in quads in `arena`, rearranged on its reading threads as each piece is
    read."""

    def in_place(rows: np.ndarray) -> None:
        if not kernels.gguf_quad_q5_0(rows, rows, k):
            raise RuntimeError("the native library could not hold a Q5_0 part in quads")

    return GGUFPart(part.type_name, arena.place(part.data, in_place), quads=True)


def _placed(part: GGUFPart, arena: WeightArena) -> GGUFPart:
    """A part's rows read into `arena`."""
    return GGUFPart(part.type_name, arena.place(part.data))


def _rank_blocks(
    plan: TensorParallelPlan, name: str, type_name: str, rows: np.ndarray, k: int
) -> tuple[np.ndarray | None, int]:
    """A tensor's blocks cut to this rank's part and its input width: rows as a view, input
    columns as a copy of whole blocks (None where the cut falls inside a block)."""
    import gguf

    row_range, col_range = plan.weight_ranges(name)
    if row_range is not None:
        return rows[row_range[0] : row_range[1]], k
    if col_range is None:
        return rows, k
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    start, end = col_range
    if start % block or end % block:
        return None, k
    cut = rows[:, start // block * size : end // block * size]
    return np.ascontiguousarray(cut), end - start


def _block_rows(tensor: Any, heads: int | None) -> np.ndarray:
    """A 2D GGUF tensor's blocks as uint8 `[rows, row_bytes]`: a view of the mapped file, or,
    for llama's permuted q/k rows (`heads`), a copy in rotate-half order."""
    rows = int(tensor.shape[1])
    data = np.asarray(tensor.data).view(np.uint8).reshape(rows, -1)
    if heads is None:
        return data
    order = unpermute_rows(torch.arange(rows), heads).numpy()
    return np.ascontiguousarray(data[order])
