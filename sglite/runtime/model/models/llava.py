"""LLaVA-1.5 (`LlavaForConditionalGeneration`): a Llama language model whose prompt embeddings
at image positions are a vision tower's projected features. This family is the language model;
the vision tower and projector are `multimodal/vision_encoder.py`, loaded beside it from the
same directory (`multimodal/spec.py` reads what the two halves share)."""

from __future__ import annotations

from sglite.runtime.model.config import ModelConfig
from sglite.runtime.model.models import llama
from sglite.runtime.model.models.base import HFConfig, ModelFamily


def _from_hf(cfg: HFConfig, arch: str) -> ModelConfig:
    if cfg.raw.get("model_type", "llama") not in ("llama", "mistral"):
        raise ValueError(
            f"{cfg.path}: LLaVA with a {cfg.raw.get('model_type')!r} language model is "
            "unsupported (Llama and Mistral are)"
        )
    return llama.FAMILY.config_from_hf(cfg, arch)


FAMILY = ModelFamily(
    name="llava",
    hf_architectures=("LlavaForConditionalGeneration",),
    hf_model_types=("llava",),
    config_from_hf=_from_hf,
    hf_prefixes=("model.language_model.", "language_model."),
    hf_skipped=(
        "model.vision_tower",
        "vision_tower",
        "model.multi_modal_projector",
        "multi_modal_projector",
    ),
)
