"""What `--quantization auto` gives a GGUF file: its projections kept in the file's own
quantization, as vLLM and SGLang serve a GGUF.

For the whole file (`auto_quantization`: the block types of its quantized projection tensors,
e.g. q4_k+q6_k) and per projection (`gguf_kind_for`: int4 where every part is 4-bit, q8_0 where
some are quantized with more bits, none where all are float).

Invariant: only the tensors' types are read (the file's metadata), never their data; a fused
projection's parts are judged by the GGUF tensors they are cut from.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from sglite.runtime.model.gguf_index import GGUFFile
from sglite.runtime.model.gguf_loader import hf_name
from sglite.runtime.model.gguf_part import BLOCK_TYPES
from sglite.runtime.model.gguf_quants import GGUF_INT4_TYPES

_UNQUANTIZED_TYPES = ("F32", "F16", "BF16", "F64")
_FUSED_PART = re.compile(r"\.(?:(q|k|v)|(gate|up))_proj\.")
_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


def _projection_tensors(gf: GGUFFile) -> dict[str, Any]:
    """Canonical name -> GGUF tensor, for the layers' projections (attention q/k/v/o, MLP and
    expert gate/up/down)."""
    out = {}
    for tensor in gf.tensors:
        name = hf_name(tensor.name)
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
