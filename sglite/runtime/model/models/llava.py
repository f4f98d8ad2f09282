"""The language models of vision-language checkpoints: LLaVA-1.5 and LLaVA-NeXT
(`language_model.`) and Idefics3 (SmolVLM-256M/500M/2.2B, `text_model.`), Llama or Mistral
decoders whose prompt embeddings at image positions come from the vision half
(`multimodal/vision_encoder.py`, loaded beside this from the same directory;
`multimodal/spec.py` lists the architectures)."""

from __future__ import annotations

from sglite.runtime.model.config import ModelConfig
from sglite.runtime.model.models import llama
from sglite.runtime.model.models.base import HFConfig, ModelFamily
from sglite.runtime.multimodal.spec import VISION_ARCHITECTURES


def _from_hf(cfg: HFConfig, arch: str) -> ModelConfig:
    if cfg.raw.get("model_type", "llama") not in ("llama", "mistral"):
        raise ValueError(
            f"{cfg.path}: a {arch} with a {cfg.raw.get('model_type')!r} language model is "
            "unsupported (Llama and Mistral are)"
        )
    return llama.FAMILY.config_from_hf(cfg, arch)


FAMILY = ModelFamily(
    name="llava",
    hf_architectures=tuple(VISION_ARCHITECTURES),
    hf_model_types=("llava", "llava_next", "idefics3"),
    config_from_hf=_from_hf,
    hf_prefixes=("model.language_model.", "language_model.", "model.text_model."),
    hf_skipped=(
        "model.vision_tower", "vision_tower", "model.multi_modal_projector",
        "multi_modal_projector", "model.image_newline", "image_newline", "model.vision_model",
        "model.connector",
    ),
)  # fmt: skip
