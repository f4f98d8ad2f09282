"""Gemma 3 (text): local sliding-window layers interleaved with global ones (five local to one
global), each kind with its own RoPE base, RMSNorm of every query and key head, norms on the
attention and MLP outputs as well as their inputs ("sandwich"), a GELU-tanh gated MLP,
embeddings scaled by sqrt(hidden), and norms that scale by (1 + w). Multimodal Gemma 3
checkpoints (`Gemma3ForConditionalGeneration`) serve their language model; the vision tower is
not loaded."""

from __future__ import annotations

import math

from sglite.runtime.model.config import ModelConfig
from sglite.runtime.model.models.base import (
    GGUFConfig,
    HFConfig,
    ModelFamily,
    gguf_common,
    hf_common,
    rope_from_hf,
)

# Every sixth layer attends globally (Gemma 3's `sliding_window_pattern`, which llama.cpp also
# assumes: its GGUF files do not record it), and local layers rotate with base 10,000.
LOCAL_PATTERN = 6
LOCAL_ROPE_THETA = 10000.0

# Gemma's own turn format, for GGUF files that ship without a template. No BOS: the tokenizer
# adds it when the prompt is encoded.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- set text = message['content'] if message['content'] is string else "
    "message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') "
    "| join('') -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = ns.system + text + '\n\n' -%}"
    "{%- else -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n' }}"
    "{%- if message['role'] == 'user' -%}{{ ns.system }}{%- set ns.system = '' -%}{%- endif -%}"
    "{{ (text | trim) + '<end_of_turn>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def _check_supported(cfg: HFConfig) -> None:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ValueError(f"{cfg.path}: {key} is not supported (Gemma 2 style soft-capping)")


def _local_layers(types: list[str] | None, count: int, pattern: int) -> list[int]:
    if types is not None:
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    return [i for i in range(count) if (i + 1) % pattern != 0]


def _from_hf(cfg: HFConfig, arch: str) -> ModelConfig:
    _check_supported(cfg)
    fields = hf_common(cfg, arch)
    local_theta, local_scaling = rope_from_hf(cfg, "sliding_attention")
    if cfg.get("rope_local_base_freq") is not None:  # transformers < 5
        local_theta, local_scaling = float(cfg.get("rope_local_base_freq")), None
    count = fields["num_layers"]
    pattern = int(cfg.get("sliding_window_pattern", LOCAL_PATTERN))
    act = cfg.get("hidden_activation", cfg.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{cfg.path}: unsupported Gemma activation {act!r}")
    scalar = float(cfg.get("query_pre_attn_scalar", fields["head_dim"]))
    return ModelConfig(
        **{**fields, "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True))},
        sliding_window=int(cfg.need("sliding_window")),
        sliding_window_layers=_local_layers(cfg.get("layer_types"), count, pattern),
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
        qk_norm=True,
        sandwich_norms=True,
        hidden_act="gelu_tanh",
        embedding_multiplier=math.sqrt(fields["hidden_size"]),
        attention_scale=scalar**-0.5,
    )


def _from_gguf(meta: GGUFConfig, arch: str) -> ModelConfig:
    fields = gguf_common(meta, arch)
    count, heads = fields["num_layers"], fields["num_heads"]
    # llama.cpp's rule, as the file records no query_pre_attn_scalar: the 27B model (62 layers)
    # scales by hidden / heads, every other size by the head size.
    scalar = fields["hidden_size"] // heads if count == 62 else fields["head_dim"]
    pattern = meta.get("attention.sliding_window_pattern", LOCAL_PATTERN)
    if isinstance(pattern, list):  # newer converters: one flag per layer
        local = [i for i, is_local in enumerate(pattern) if is_local]
    else:
        local = _local_layers(None, count, int(pattern))
    return ModelConfig(
        **fields,
        sliding_window=int(meta.need("attention.sliding_window")),
        sliding_window_layers=local,
        local_rope_theta=LOCAL_ROPE_THETA,
        qk_norm=True,
        sandwich_norms=True,
        hidden_act="gelu_tanh",
        embedding_multiplier=math.sqrt(fields["hidden_size"]),
        attention_scale=scalar**-0.5,
    )


FAMILY = ModelFamily(
    name="gemma3",
    hf_architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    hf_model_types=("gemma3_text", "gemma3"),
    config_from_hf=_from_hf,
    gguf_architectures=("gemma3",),
    config_from_gguf=_from_gguf,
    hf_renames={
        "post_attention_layernorm": "attn_output_norm",
        "pre_feedforward_layernorm": "post_attention_layernorm",
        "post_feedforward_layernorm": "mlp_output_norm",
    },
    hf_prefixes=("model.language_model.", "language_model."),
    hf_skipped=(
        "model.vision_tower",
        "vision_tower",
        "model.multi_modal_projector",
        "multi_modal_projector",
    ),
    norm_offset=1.0,
    chat_template=CHAT_TEMPLATE,
    stop_tokens=("<end_of_turn>",),
)
