"""transformers reference models for the tests on real GGUF weights (`test_real_qwen.py`,
`test_gemma3.py`): the file's tensors dequantized by the `gguf` package into float32 and named as
transformers names them, read through sglite's cached index (the tensors' raw bytes, no
vocabulary). transformers can load a GGUF itself, but it parses the whole vocabulary with gguf's
reader (70 s for Gemma 3's 262k tokens); the weights and the forward pass are the same."""

from __future__ import annotations

import torch

from sglite.runtime.model.gguf_index import GGUFFile

# llama.cpp's block tensor names -> transformers' module names, where every family agrees (the
# norms differ: a test adds its family's).
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# llama.cpp's top-level tensor names -> transformers' parameter names.
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "model.norm.weight",
}


def hf_state_dict(
    reader: GGUFFile, block_names: dict[str, str], norm_offset: float = 0.0
) -> dict[str, torch.Tensor]:
    """Every tensor of the file, dequantized to float32, under transformers' name: the top-level
    ones by `_TOP_NAMES`, `blk.L.PART.KIND` as `model.layers.L.{block_names[PART]}.KIND`.
    `norm_offset` is subtracted from every norm weight (Gemma's llama.cpp files store 1 + w)."""
    import gguf

    state = {}
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))
        value = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        value = torch.from_numpy(value.astype("float32"))
        if norm_offset and tensor.name.endswith("norm.weight"):
            value = value - norm_offset
        if tensor.name in _TOP_NAMES:
            state[_TOP_NAMES[tensor.name]] = value
        else:
            _, layer, part, kind = tensor.name.split(".")
            state[f"model.layers.{layer}.{block_names[part]}.{kind}"] = value
    return state
