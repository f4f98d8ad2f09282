"""Llama 1-3.x (SmolLM, TinyLlama, ...) and Mistral: the plain pre-norm SwiGLU decoder. Llama 3.1's
`llama3` RoPE scaling and Mistral's sliding window are config fields."""

from __future__ import annotations

from sglite.runtime.model.config import ModelConfig
from sglite.runtime.model.models.base import (
    GGUFConfig,
    HFConfig,
    ModelFamily,
    gguf_common,
    hf_common,
)


def _from_hf(cfg: HFConfig, arch: str) -> ModelConfig:
    fields = hf_common(cfg, arch)
    bias = bool(cfg.get("attention_bias", False))
    window = cfg.get("sliding_window")
    return ModelConfig(
        **fields,
        attention_bias=bias,
        o_proj_bias=bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        sliding_window=int(window) if window is not None else None,
    )


def _from_gguf(meta: GGUFConfig, arch: str) -> ModelConfig:
    window = meta.get("attention.sliding_window")
    return ModelConfig(**gguf_common(meta, arch), sliding_window=window and int(window))


FAMILY = ModelFamily(
    name="llama",
    hf_architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    hf_model_types=("llama", "mistral"),
    config_from_hf=_from_hf,
    gguf_architectures=("llama",),
    config_from_gguf=_from_gguf,
    # llama.cpp's converter interleaves each head's two rotary halves in the Q and K rows.
    gguf_permuted_qk=True,
)
