"""What the tokenizing side and the model side agree on about a vision-language model."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from sglite.runtime.model.hf_loader import read_json

# Architectures whose images are CLIP features through LLaVA's two-layer projector.
LLAVA_ARCHITECTURES = ("LlavaForConditionalGeneration",)


@dataclass(frozen=True)
class VisionSpec:
    """A LLaVA-1.5 model's image interface.

    A prompt holds `image_token_id` once per image where the image goes; it becomes
    `tokens_per_image` positions whose input embeddings are the projected features of the
    vision tower's layer `feature_layer` (without its class token under the "default" strategy).
    """

    model_dir: str
    image_token_id: int
    tokens_per_image: int
    feature_layer: int
    select_strategy: str
    projector_act: str
    projector_bias: bool
    vision_config: dict[str, Any]


def vision_spec(model_path: str | None) -> VisionSpec | None:
    """The image interface of the model at `model_path`; None for text-only models (GGUF files
    and directories without a vision tower)."""
    if model_path is None or not os.path.isdir(model_path):
        return None
    config_path = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_path):
        return None
    raw = read_json(config_path)
    if (raw.get("architectures") or [None])[0] not in LLAVA_ARCHITECTURES:
        return None
    vision = raw.get("vision_config") or {}
    if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ValueError(f"{config_path}: only CLIP vision towers are supported")
    strategy = raw.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"{config_path}: unknown vision_feature_select_strategy {strategy!r}")
    layer = raw.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ValueError(f"{config_path}: several vision feature layers are unsupported")
    patches = (int(vision.get("image_size", 224)) // int(vision.get("patch_size", 32))) ** 2
    token_id = int(raw.get("image_token_index", raw.get("image_token_id", 32000)))
    return VisionSpec(
        model_dir=model_path,
        image_token_id=token_id,
        tokens_per_image=patches + (1 if strategy == "full" else 0),
        feature_layer=layer,
        select_strategy=strategy,
        projector_act=str(raw.get("projector_hidden_act", "gelu")),
        projector_bias=bool(raw.get("multimodal_projector_bias", True)),
        vision_config=dict(vision),
    )
