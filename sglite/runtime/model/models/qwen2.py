"""Qwen2 and Qwen2.5: Llama's block with biases on q, k and v (not o), and a sliding window only
when `use_sliding_window` is set, on the layers from `max_window_layers` up."""

from __future__ import annotations

from sglite.runtime.model.config import ModelConfig
from sglite.runtime.model.models.base import (
    GGUFConfig,
    HFConfig,
    ModelFamily,
    gguf_common,
    hf_common,
)


def qwen_window(cfg: HFConfig) -> tuple[int | None, list[int] | None]:
    """Qwen's window: only with `use_sliding_window`, then on the layers `layer_types` names
    (transformers >= 5) or from `max_window_layers` up."""
    window = cfg.get("sliding_window")
    if window is None or not cfg.get("use_sliding_window", False):
        return None, None
    types = cfg.get("layer_types")
    if types is None:
        start = int(cfg.get("max_window_layers", 0))
        return int(window), list(range(start, int(cfg.need("num_hidden_layers"))))
    return int(window), [i for i, t in enumerate(types) if t == "sliding_attention"]


def _from_hf(cfg: HFConfig, arch: str) -> ModelConfig:
    window, layers = qwen_window(cfg)
    return ModelConfig(
        **hf_common(cfg, arch),
        attention_bias=True,
        sliding_window=window,
        sliding_window_layers=layers,
    )


def _from_gguf(meta: GGUFConfig, arch: str) -> ModelConfig:
    return ModelConfig(**gguf_common(meta, arch))


FAMILY = ModelFamily(
    name="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    hf_model_types=("qwen2",),
    config_from_hf=_from_hf,
    gguf_architectures=("qwen2",),
    config_from_gguf=_from_gguf,
)
