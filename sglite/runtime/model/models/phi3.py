"""Phi-3 and Phi-3.5 (mini, medium): Llama's block with q/k/v and gate/up stored fused (split into
the canonical projections on load), a sliding window, and Phi's `longrope` RoPE scaling for the
128k-context models. Partial rotary embeddings (Phi-4-mini) are not supported."""

from __future__ import annotations

from typing import Any

import numpy as np

from sglite.runtime.model.config import ModelConfig
from sglite.runtime.model.models.base import (
    GGUFConfig,
    HFConfig,
    ModelFamily,
    gguf_common,
    hf_common,
)


def _longrope(scaling: dict[str, Any] | None, original: Any, max_len: int) -> dict | None:
    """Longrope's parameters with the context it was trained on and its extension factor (what
    `rope.py` needs), or the scaling unchanged for other kinds."""
    if not scaling or scaling.get("rope_type") not in ("longrope", "su"):
        return scaling
    original = int(scaling.get("original_max_position_embeddings") or original or max_len)
    return {
        **scaling,
        "rope_type": "longrope",
        "original_max_position_embeddings": original,
        "factor": max_len / original,
    }


def _from_hf(cfg: HFConfig, arch: str) -> ModelConfig:
    rope = cfg.get("rope_parameters", {})
    if float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError(
            f"{cfg.path}: partial rotary embeddings (partial_rotary_factor) unsupported"
        )
    fields = hf_common(cfg, arch)
    fields["rope_scaling"] = _longrope(
        fields["rope_scaling"],
        cfg.get("original_max_position_embeddings"),
        fields["max_position_embeddings"],
    )
    window = cfg.get("sliding_window")
    return ModelConfig(
        **fields,
        attention_bias=bool(cfg.get("attention_bias", False)),
        sliding_window=int(window) if window is not None else None,
    )


def _from_gguf(meta: GGUFConfig, arch: str) -> ModelConfig:
    fields = gguf_common(meta, arch)
    tensors = {t.name: t for t in meta.gf.tensors}
    long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    if long is not None and short is not None:
        fields["rope_scaling"] = _longrope(
            {
                "rope_type": "longrope",
                "long_factor": np.asarray(long.data).tolist(),
                "short_factor": np.asarray(short.data).tolist(),
                "attention_factor": meta.get("rope.scaling.attn_factor"),
            },
            meta.get("rope.scaling.original_context_length"),
            fields["max_position_embeddings"],
        )
    window = meta.get("attention.sliding_window")
    return ModelConfig(**fields, sliding_window=int(window) if window else None)


FAMILY = ModelFamily(
    name="phi3",
    hf_architectures=("Phi3ForCausalLM",),
    hf_model_types=("phi3",),
    config_from_hf=_from_hf,
    gguf_architectures=("phi3",),
    config_from_gguf=_from_gguf,
    # llama.cpp stores Phi-3's fused gate/up as ffn_up.
    gguf_renames={"up_proj": "gate_up_proj"},
)
