"""GGUF files (llama.cpp format): config from metadata, dequantized weights, tokenizer.

Weights are yielded under Hugging Face names so `CausalLM.load_weights` serves both formats.
llama.cpp stores the Q and K rows of llama-architecture models permuted for its interleaved RoPE;
they are permuted back here so the model can use the rotate-half layout.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from sglite.runtime.distributed.sharding import TensorParallelPlan
from sglite.runtime.model.checkpoint import checkpoint_names
from sglite.runtime.model.config import ModelConfig
from sglite.runtime.model.gguf_index import GGUFFile
from sglite.runtime.model.gguf_weight import BLOCK_TYPES, DecodeScratch, GGUFPart, GGUFWeight
from sglite.runtime.model.models.base import GGUFConfig, ModelFamily, rename_parts
from sglite.runtime.model.quantization import (
    GGUF_INT4_TYPES,
    GGUF_Q8_EXACT_TYPES,
    Int4Parts,
    Q8Weight,
    dequantize_gguf_fast,
    int4_parts_from_gguf,
    q8_weight_from_gguf,
    q8_weight_from_gguf_type,
)
from sglite.runtime.model.weight_arena import WeightArena
from sglite.runtime.model.weight_policy import QuantizedSource

logger = logging.getLogger(__name__)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# llama.cpp's block tensor names -> canonical ones (checkpoint.py); families rename what they
# store differently (`ModelFamily.gguf_renames`).
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "attn_output_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "mlp_output_norm",
    "ffn_gate_inp": "mlp.gate",
    # Every expert's weights in one 3D tensor; `split_fused` cuts them per expert.
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Tensors that carry no weights of their own (their content goes into the config).
_SKIPPED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def gguf_family(gf: GGUFFile, path: str = "<gguf>") -> ModelFamily:
    """The family serving a GGUF file's `general.architecture`."""
    from sglite.runtime.model import models

    arch = gf.field("general.architecture")
    family = models.family_for_gguf(arch)
    if family is None or family.config_from_gguf is None:
        supported = ", ".join(models.supported_gguf_architectures())
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {supported}")
    return family


def gguf_config(gf: GGUFFile, path: str = "<gguf>") -> ModelConfig:
    """Build the ModelConfig from GGUF metadata (`{arch}.*` and `tokenizer.ggml.*` keys)."""
    family = gguf_family(gf, path)
    assert family.config_from_gguf is not None
    arch = family.hf_architectures[0]
    if gf.field(f"{gf.field('general.architecture')}.expert_count"):
        arch = "MixtralForCausalLM" if family.name == "llama" else arch
    return family.config_from_gguf(GGUFConfig(gf, path), arch)


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_TENSOR.match(name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        return None
    layer, part, kind = m.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp interleaves each head's two rotary halves row by row; de-interleave them.
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def iter_gguf_weights(
    gf: GGUFFile, config: ModelConfig, progress: bool = True, skip: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, float32 tensor)` for every weight but the GGUF tensors named in `skip`
    (held as blocks: `gguf_block_weights`), dequantizing one tensor at a time."""

    family = gguf_family(gf, gf.path)
    yield from family.gguf_weights(_dequantized(gf, config, family, progress, skip), config)


def _dequantized(
    gf: GGUFFile,
    config: ModelConfig,
    family: ModelFamily,
    progress: bool,
    skip: frozenset[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf
    from tqdm.auto import tqdm

    unpermute = family.gguf_permuted_qk
    tensors = [t for t in gf.tensors if t.name not in skip]
    for tensor in tqdm(tensors, desc="loading GGUF", unit="tensor", disable=not progress):
        if tensor.name in _SKIPPED:
            continue
        name = _hf_name(tensor.name)
        if name is None:
            logger.warning("ignoring unknown GGUF tensor %s", tensor.name)
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists the fastest dim first
        weight = None
        if len(shape) == 2:
            weight = dequantize_gguf_fast(tensor.data, tensor.tensor_type.name, shape)
        if weight is None:
            try:
                array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            except NotImplementedError as exc:
                raise ValueError(f"cannot dequantize {tensor.name}: {exc}") from exc
            array = np.ascontiguousarray(array, dtype=np.float32).reshape(shape)
            if not array.flags.writeable:
                array = array.copy()  # F32 tensors are views of the read-only file map
            weight = torch.from_numpy(array)
        if unpermute and ".self_attn.q_proj." in name:
            weight = _unpermute_rows(weight, config.num_heads)
        elif unpermute and ".self_attn.k_proj." in name:
            weight = _unpermute_rows(weight, config.num_kv_heads)
        yield name, weight


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
) -> BlockWeights:
    """Every projection, the embedding and the output projection of `model` whose GGUF tensors
    are all of a block type the kernels read, as `GGUFWeight`s over the file's blocks: read into
    `arena` (`weight_arena.py`), or without one, views of the mapped file (`config`: the whole
    model's). Rows the file stores permuted (llama's q/k) are reordered into a copy; with a
    tensor-parallel `plan`, each tensor is cut to this rank's rows (a view) or input columns (a
    copy of whole blocks; a projection whose cut falls inside a block is left to the dense
    path). Projections made of other tensors (float, other types, 3D experts) are not included.
    `round_activations`: the weights' products round x to int8 (`GGUFWeight`)."""
    from sglite.runtime.model.linear import Linear

    family = gguf_family(gf, gf.path)
    by_name: dict[str, Any] = {}
    for tensor in gf.tensors:
        name = _hf_name(tensor.name)
        if name is not None:
            by_name[rename_parts(name, family.gguf_renames)] = tensor
    scratch = DecodeScratch()
    out = BlockWeights()

    def weight(
        names: list[str], heads: list[int | None], shape: tuple[int, int] | None = None
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
        if arena is not None:
            blocks = [arena.place(b) for b in blocks]
        out.consumed.update(t.name for t in tensors)
        parts = [GGUFPart(kind, b) for kind, b in zip(kinds, blocks, strict=True)]
        return GGUFWeight(parts, k, scratch, round_activations)

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
        found = weight(names, [permuted_heads(n) for n in names], shape)
        if found is None and len(names) > 1:  # stored fused in the file (Phi-3)
            found = weight([f"model.{path}.weight"], [None], shape)
        if found is not None:
            out.projections[path] = found
    out.embedding = weight(["model.embed_tokens.weight"], [None])
    out.head = out.embedding if config.tie_word_embeddings else weight(["lm_head.weight"], [None])
    return out


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
    order = _unpermute_rows(torch.arange(rows), heads).numpy()
    return np.ascontiguousarray(data[order])


def gguf_quantized_source(gf: GGUFFile, config: ModelConfig) -> QuantizedSource:
    """A lookup for `CausalLM.quantize`: the file's own values of each canonical tensor in
    `names` (one fused projection) in the layout of `kind` (int4/w4a8: Q4_0 / Q4_1 / Q4_K;
    q8_0: Q8_0 / Q5_0), or None unless every one of them is stored so."""
    unpermute = gguf_family(gf, gf.path).gguf_permuted_qk
    by_name = {}
    for tensor in gf.tensors:
        name = _hf_name(tensor.name)
        if name is not None:
            by_name[name] = tensor

    def rows_of(name: str) -> int | None:
        if unpermute and ".self_attn.q_proj." in name:
            return config.num_heads
        if unpermute and ".self_attn.k_proj." in name:
            return config.num_kv_heads
        return None

    def lookup(kind: str, names: list[str]) -> list[Int4Parts] | list[Q8Weight] | None:
        types = {"int4": GGUF_INT4_TYPES, "w4a8": GGUF_INT4_TYPES, "q8_0": GGUF_Q8_EXACT_TYPES}
        tensors = [by_name.get(n) for n in names]
        if kind not in types or any(
            t is None or t.tensor_type.name not in types[kind] for t in tensors
        ):
            return None
        parts: list = []
        for name, tensor in zip(names, tensors, strict=True):
            shape = tuple(int(d) for d in reversed(tensor.shape))
            heads = rows_of(name)
            if kind == "q8_0":
                q8 = q8_weight_from_gguf_type(tensor.data, tensor.tensor_type.name, shape)
                if heads is not None:
                    q8 = Q8Weight(
                        _unpermute_rows(q8.values, heads), _unpermute_rows(q8.scales, heads)
                    )
                parts.append(q8)
                continue
            part = int4_parts_from_gguf(tensor.data, tensor.tensor_type.name, shape)
            if heads is not None:
                part = Int4Parts(
                    _unpermute_rows(part.values, heads),
                    _unpermute_rows(part.scale, heads),
                    _unpermute_rows(part.offset, heads),
                    part.group_size,
                )
            parts.append(part)
        return parts

    return lookup


_UNQUANTIZED_TYPES = ("F32", "F16", "BF16", "F64")


def gguf_q8_head(gf: GGUFFile, rows: tuple[int, int] | None = None) -> Q8Weight | None:
    """The output projection as the file stores it when that is Q8_0 (the `output` tensor, or
    the tied embedding), for `CausalLM.quantize`; None otherwise. `rows`: only this range of
    vocabulary rows (a tensor-parallel rank's)."""
    tensors = {t.name: t for t in gf.tensors}
    tensor = tensors.get("output.weight") or tensors.get("token_embd.weight")
    if tensor is None or tensor.tensor_type.name != "Q8_0":
        return None
    n, k = (int(d) for d in reversed(tensor.shape))
    start, end = rows or (0, n)
    data = np.asarray(tensor.data).reshape(n, -1)[start:end]
    return q8_weight_from_gguf(data, (end - start, k))


_FUSED_PART = re.compile(r"\.(?:(q|k|v)|(gate|up))_proj\.")
_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


def _projection_tensors(gf: GGUFFile) -> dict[str, Any]:
    """Canonical name -> GGUF tensor, for the layers' projections (attention q/k/v/o, MLP and
    expert gate/up/down)."""
    out = {}
    for tensor in gf.tensors:
        name = _hf_name(tensor.name)
        if name is not None and name.endswith("_proj.weight"):
            out[name] = tensor
    return out


def _kind_of_types(types: set[str]) -> str:
    """int4 when every part is 4-bit (their values load exactly), q8_0 when some are quantized
    with more bits (Q8_0 and Q5_0 load exactly, Q5_1/Q6_K/Q5_K are rounded to 8 bits per group
    of 32), none when all are float."""
    if types and types <= set(GGUF_INT4_TYPES):
        return "int4"
    if types - set(_UNQUANTIZED_TYPES):
        return "q8_0"
    return "none"


def _source(tensors: dict[str, Any], name: str) -> Any:
    """The GGUF tensor holding the canonical projection `name`: itself, or the fused tensor it
    is cut from (all experts in one, Phi-3's q/k/v and gate/up)."""
    candidates = (
        name,
        _EXPERT_INDEX.sub(".experts.", name),
        re.sub(r"\.(q|k|v)_proj\.", ".qkv_proj.", name),
        name.replace(".gate_proj.", ".up_proj."),
    )
    return next((tensors[c] for c in candidates if c in tensors), None)


def auto_quantization(gf: GGUFFile) -> str:
    """What `quantization="auto"` gives a GGUF file, as vLLM and SGLang serve a GGUF with its
    own quantization: the block types of its quantized projection tensors, lowercased and
    joined by "+" (e.g. q4_k+q6_k), which the model holds as they are (`gguf_block_weights`);
    q8_0 also stands for quantized types the kernels do not read (rounded to 8 bits per 32 on
    load); none when every projection is float."""
    kinds = set()
    for tensor in _projection_tensors(gf).values():
        name = tensor.tensor_type.name
        if name in BLOCK_TYPES:
            kinds.add(name.lower())
        elif name not in _UNQUANTIZED_TYPES:
            kinds.add("q8_0")
    return "+".join(sorted(kinds)) or "none"


def gguf_kind_for(gf: GGUFFile) -> Callable[[list[str]], str]:
    """`--quantization auto` per projection (`CausalLM.quantize`'s `kind_for`): the kind of the
    file's tensors for the canonical names making up one projection."""
    tensors = _projection_tensors(gf)

    def kind_for(names: list[str]) -> str:
        found = [_source(tensors, n) for n in names]
        return _kind_of_types({t.tensor_type.name for t in found if t is not None})

    return kind_for
