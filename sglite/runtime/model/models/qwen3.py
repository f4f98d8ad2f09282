"""Qwen3 (dense): Qwen2's layout without q/k/v biases, with an RMSNorm of every query and key head
before RoPE, and `head_dim` independent of the hidden size."""

from __future__ import annotations

from typing import Any

from sglite.runtime.model.config import ModelConfig
from sglite.runtime.model.models.base import (
    GGUFConfig,
    HFConfig,
    ModelFamily,
    gguf_common,
    hf_common,
)
from sglite.runtime.model.models.qwen2 import qwen_window


def qwen3_fields(cfg: HFConfig, arch: str) -> dict[str, Any]:
    """The `ModelConfig` fields of Qwen3's attention (shared with Qwen3-MoE)."""
    window, layers = qwen_window(cfg)
    bias = bool(cfg.get("attention_bias", False))
    return dict(
        **hf_common(cfg, arch),
        attention_bias=bias,
        o_proj_bias=bias,
        qk_norm=True,
        sliding_window=window,
        sliding_window_layers=layers,
    )


def _from_hf(cfg: HFConfig, arch: str) -> ModelConfig:
    return ModelConfig(**qwen3_fields(cfg, arch))


def from_gguf(meta: GGUFConfig, arch: str) -> ModelConfig:
    """Qwen3's GGUF metadata is Llama's, with q/k norms (Qwen3-MoE's too)."""
    return ModelConfig(**gguf_common(meta, arch), qk_norm=True)


FAMILY = ModelFamily(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    hf_model_types=("qwen3",),
    config_from_hf=_from_hf,
    gguf_architectures=("qwen3",),
    config_from_gguf=from_gguf,
)
