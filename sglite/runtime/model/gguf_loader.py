"""GGUF files (llama.cpp format): the config from metadata, the weights dequantized to float32,
and the file's own quantized values for the projections that keep them.

Weights are yielded under Hugging Face names (`hf_name`) so `CausalLM.load_weights` serves both
formats. llama.cpp stores the Q and K rows of llama-architecture models permuted for its
interleaved RoPE; they are permuted back here (`unpermute_rows`) so the model can use the
rotate-half layout.

Invariants: every tensor reaches the model under its canonical name and in rotate-half row order,
whichever path reads it (dense here, as blocks in `gguf_block_weights.py`); the file map is only
read. What `--quantization auto` picks for a file is `gguf_auto_quantization.py`'s.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import numpy as np
import torch

from sglite.runtime.model.config import ModelConfig
from sglite.runtime.model.gguf_index import GGUFFile
from sglite.runtime.model.gguf_quants import (
    GGUF_INT4_TYPES,
    GGUF_Q8_EXACT_TYPES,
    dequantize_gguf_fast,
    int4_parts_from_gguf,
    q8_weight_from_gguf,
    q8_weight_from_gguf_type,
)
from sglite.runtime.model.models.base import GGUFConfig, ModelFamily
from sglite.runtime.model.quantized_weight import Int4Parts, Q8Weight
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


def hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_TENSOR.match(name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        return None
    layer, part, kind = m.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
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
        name = hf_name(tensor.name)
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
            weight = unpermute_rows(weight, config.num_heads)
        elif unpermute and ".self_attn.k_proj." in name:
            weight = unpermute_rows(weight, config.num_kv_heads)
        yield name, weight


def gguf_quantized_source(gf: GGUFFile, config: ModelConfig) -> QuantizedSource:
    """A lookup for `CausalLM.quantize`: the file's own values of each canonical tensor in
    `names` (one fused projection) in the layout of `kind` (int4/w4a8: Q4_0 / Q4_1 / Q4_K;
    q8_0: Q8_0 / Q5_0), or None unless every one of them is stored so."""
    unpermute = gguf_family(gf, gf.path).gguf_permuted_qk
    by_name = {}
    for tensor in gf.tensors:
        name = hf_name(tensor.name)
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
                        unpermute_rows(q8.values, heads), unpermute_rows(q8.scales, heads)
                    )
                parts.append(q8)
                continue
            part = int4_parts_from_gguf(tensor.data, tensor.tensor_type.name, shape)
            if heads is not None:
                part = Int4Parts(
                    unpermute_rows(part.values, heads),
                    unpermute_rows(part.scale, heads),
                    unpermute_rows(part.offset, heads),
                    part.group_size,
                )
            parts.append(part)
        return parts

    return lookup


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
