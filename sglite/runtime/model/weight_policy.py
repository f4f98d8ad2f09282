"""Which weights a loaded model computes with, decided once at load time.

After the checkpoint is read (loader.py), this module settles for every projection of a
`CausalLM`, the output projection and the embedding:
- what is held: the dense weight, a quantized copy (int8, q8_0, int4, w4a8 from `quantization.py`,
  or the GGUF file's own blocks, `GGUFWeight`), or both;
- up to how many rows of a matmul the quantized copy serves (`max_rows`; -1: all, and the dense
  weight is freed), and for the output projection when its int8 copy serves instead of float32;
- whether the dense weights get their extra GEMM layouts (`should_pack`, `finalize`).
`linear_weight.select_weight` then turns each decision into the one weight object the layer
calls; nothing here runs per forward. Every change of weight pointers tells the model
(`CausalLM.weights_changed`), whose native decode step is rebuilt on its next use.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from sglite.runtime.model import kernels
from sglite.runtime.model.checkpoint import checkpoint_names
from sglite.runtime.model.gguf_weight import A8_ROWS, GGUFWeight
from sglite.runtime.model.linear import Linear
from sglite.runtime.model.linear_weight import LinearWeight, select_weight
from sglite.runtime.model.quantization import make_quantized
from sglite.runtime.model.quantized_weight import Int4Parts, Int8Weight, Q8Weight

if TYPE_CHECKING:
    from sglite.runtime.model.causal_lm import CausalLM
    from sglite.runtime.model.gguf_block_weights import BlockWeights

logger = logging.getLogger(__name__)

# Quantized float32 models without packed weights: output projections of up to this many rows
# use the int8 copy.
LM_HEAD_INT8_FLOAT32_ROWS = 32
# The extra layouts double (float32) or triple (bf16) the dense weights in memory: auto keeps them
# for small models only.
AUTO_PACK_MAX_BYTES = 1 << 30
# A projection's quantization from the canonical names of the checkpoint tensors it is made of
# (int8, q8_0, int4, w4a8 or none: `--quantization auto` decides per projection for a GGUF).
KindFor = Callable[[list[str]], str]
# The checkpoint's own quantized values of those tensors in one kind's layout (GGUF Q4 blocks as
# int4, Q8_0/Q5_0 blocks as q8_0), so they load exactly rather than requantized; None if it has
# none.
QuantizedSource = Callable[[str, list[str]], list[Int4Parts] | list[Q8Weight] | None]


def auto_quantized_max_rows(dtype: torch.dtype, device: torch.device) -> int:
    """-1 (quantized weights only) where the native quantized GEMM serves every batch size
    (float32 on CPU), so a dense float32 copy would only cost memory. Elsewhere 8 (bf16: the
    quantized kernels take the few rows where reading the weight bounds the product, the dense
    copy the larger batches, where the bf16 GEMM's arithmetic wins)."""
    if device.type == "cpu" and dtype == torch.float32 and kernels.native_available():
        return -1
    return 8


def should_pack(setting: str, model: CausalLM) -> bool:
    """Whether the dense weights get their extra GEMM layouts: `setting` on or off, or for
    auto, whether the dense weights take at most `AUTO_PACK_MAX_BYTES`."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"gemm_packing must be auto, on or off, got {setting!r}")
    if setting != "auto":
        return setting == "on"
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    return dense <= AUTO_PACK_MAX_BYTES


def use_gguf_blocks(model: CausalLM, blocks: BlockWeights) -> frozenset[str]:
    """Hold the projections, embedding and output projection `blocks` has as GGUF blocks
    (their dense parameters emptied, never filled); returns the parameter names they
    stand for, which the dense load then skips."""
    model.weights_changed()
    provided = set()
    for path, weight in blocks.projections.items():
        module = model.get_submodule(path)
        assert isinstance(module, Linear)
        module.set_quantized(weight, -1)
        provided.add(f"{path}.weight")
    if blocks.embedding is not None:
        model.embedding_blocks = blocks.embedding
        empty = model.embed_tokens.weight.data.new_empty(0)
        model.embed_tokens.weight = nn.Parameter(empty, requires_grad=False)
        provided.add("embed_tokens.weight")
    if blocks.head is not None:
        model.lm_head_quantized = blocks.head
        model.lm_head_quantized_max_rows = -1
        if model.lm_head is not None:
            empty = model.lm_head.weight.data.new_empty(0)
            model.lm_head.weight = nn.Parameter(empty, requires_grad=False)
            provided.add("lm_head.weight")
    return frozenset(provided)


def quantize(
    model: CausalLM,
    kind_for: KindFor,
    max_rows: int,
    source: QuantizedSource | None = None,
    head: Q8Weight | None = None,
) -> None:
    """Give every projection a quantized copy of the kind `kind_for` names for it (int8,
    int4 or w4a8; none leaves it dense) used for matmuls of at most `max_rows` rows (-1: all,
    and the dense weights are freed), and the output projection an 8-bit copy (4-bit logits
    lose too much): `head` (the checkpoint's own, e.g. GGUF Q8_0) when given and of the
    right shape, else per-channel int8.

    `source(kind, names)` may return the checkpoint's own values in that kind's layout for
    each of the canonical tensors `names` that make up one projection (GGUF Q4_0/Q4_1/Q4_K
    for int4, Q8_0/Q5_0 for q8_0), so they are not requantized (with tensor parallelism,
    this rank's part of int4 values; q8_0 values are then requantized from the shard).
    """
    model.weights_changed()
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name != "lm_head" and module.quantized is None:
            quantize_projection(model, name, kind_for, max_rows, source)
    model.output_weight = None
    if isinstance(model.lm_head_quantized, GGUFWeight):  # held as the file's blocks
        return
    dense_head = model.lm_head_weight().data
    fits = head is not None and head.values.shape == dense_head.shape
    model.lm_head_quantized = head if fits else Int8Weight(dense_head, model.dtype)
    model.lm_head_quantized_max_rows = max_rows
    if max_rows < 0 and model.lm_head is not None:  # an untied projection has no other use
        model.lm_head.weight = nn.Parameter(dense_head.new_empty(0), requires_grad=False)


def quantize_projection(
    model: CausalLM,
    name: str,
    kind_for: KindFor,
    max_rows: int,
    source: QuantizedSource | None = None,
) -> None:
    """`quantize` for the one projection `name` (a Linear other than the output
    projection); with `max_rows` -1 its dense weight is freed at once."""
    module = model.get_submodule(name)
    assert isinstance(module, Linear) and name != "lm_head"
    kind = kind_for(checkpoint_names(model, name))
    if kind == "none":
        return
    parts = _source_parts(model, source, kind, name) if source else None
    weight = make_quantized(kind, module.weight.data, model.dtype, parts)
    if weight is None:
        shape = tuple(module.weight.shape)
        logger.warning("%s: shape %s cannot be %s-quantized", name, shape, kind)
        return
    module.set_quantized(weight, max_rows)
    model.weights_changed()


def _source_parts(
    model: CausalLM, source: QuantizedSource, kind: str, module: str
) -> Int4Parts | Q8Weight | None:
    names = checkpoint_names(model, module)
    parts = source(kind, names)
    if not parts:
        return None
    if kind == "q8_0":
        return None if model.tp_plan is not None else Q8Weight.concat(parts)  # type: ignore
    if model.tp_plan is not None:
        sharded = [model.tp_plan.shard_int4(n, p) for n, p in zip(names, parts, strict=True)]
        if any(p is None for p in sharded):
            return None
        parts = sharded  # type: ignore[assignment]
    return Int4Parts.concat(parts)  # type: ignore[arg-type]


def finalize(model: CausalLM, pack: bool) -> None:
    """Add the dense weights' extra layouts (see `Linear.finalize`) when `pack`, and settle the
    output projection's weight object; call after loading and quantizing. The extra layouts
    make large and mid-size batches faster and cost memory."""
    for module in model.modules():
        if isinstance(module, Linear) and module is not model.lm_head:
            module.finalize(pack)
    model.output_weight = output_weight(model, extra_layouts=pack)
    model.weights_changed()


def output_weight(model: CausalLM, extra_layouts: bool) -> LinearWeight:
    """The weight object the output projection computes with."""
    dense = model.lm_head_weight().data
    rows = model.lm_head_quantized_max_rows
    unpacked_float32 = model.dtype == torch.float32 and not extra_layouts
    if model.lm_head_quantized is not None and unpacked_float32 and rows >= 0:
        if kernels.native_available():
            # A few rows of the output projection are bound by reading its weight, which int8
            # holds in a quarter of float32's bytes; an unpacked float32 GEMM of this wide,
            # short shape gets too little arithmetic rate to make up for reading four times as
            # much. (Packed float32 panels compute fast enough to win from fewer rows on, hence
            # unpacked only.)
            rows = max(rows, LM_HEAD_INT8_FLOAT32_ROWS)
    return select_weight(dense, model.lm_head_quantized, rows, extra_layouts)


def quantized_kinds(model: CausalLM) -> list[str]:
    """The quantized formats the projections use (int4, int8, w4a8), sorted (empty: all
    dense)."""
    kinds = {
        kind
        for m in model.modules()
        if isinstance(m, Linear) and m is not model.lm_head and m.quantized is not None
        for kind in m.quantized.kind.split("+")
    }
    return sorted(kinds)


def verification_row_group(model: CausalLM) -> int:
    """Rows of a DECODE pass that cost about as one group: `A8_ROWS` where the GGUF weights
    holding most of the model's bytes take the int8 GEMV past `A8_ROWS` rows
    (`GGUFWeight.regroups_decode_rows`: a fifth row decodes every block again), else 1 (a GEMM
    takes larger batches and each further row costs about alike). A speculative draft is
    sized by it (`VerifyRows`)."""
    weights = [
        m.quantized
        for m in model.modules()
        if isinstance(m, Linear) and m is not model.lm_head and isinstance(m.quantized, GGUFWeight)
    ]
    if isinstance(model.lm_head_quantized, GGUFWeight):
        weights.append(model.lm_head_quantized)
    regrouped = sum(w.nbytes() for w in weights if w.regroups_decode_rows())
    return A8_ROWS if 2 * regrouped > sum(w.nbytes() for w in weights) else 1


def weight_layouts(model: CausalLM) -> list[str]:
    """The layouts the projections and the output projection compute with (the kinds of
    their weight objects, e.g. "panels", "int4", "int4 up to 8 rows, else blocked"),
    sorted."""
    kinds = {model.output_projection().kind}
    for module in model.modules():
        if isinstance(module, Linear) and module is not model.lm_head:
            kinds.add(module.kernel.kind)
    return sorted(kinds)
