"""Which vision-language architectures are served, and what the tokenizing side and the model
side agree on about one. (Imports nothing of the model package: its families import this.)"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

# architecture -> (the transformers class holding its vision half, its language model attribute)
VISION_ARCHITECTURES = {
    "LlavaForConditionalGeneration": ("LlavaModel", "language_model"),
    "LlavaNextForConditionalGeneration": ("LlavaNextModel", "language_model"),
    "Idefics3ForConditionalGeneration": ("Idefics3Model", "text_model"),
}


@dataclass(frozen=True)
class VisionSpec:
    """A vision-language model's image interface: its processor turns one image token into the
    image's span of tokens, and `hf_model_class`'s `get_image_features` gives one embedding per
    `image_token_id` position of the span (the language model, `text_attr`, is ours)."""

    model_dir: str
    architecture: str
    image_token_id: int
    hf_model_class: str
    text_attr: str


def vision_spec(model_path: str | None) -> VisionSpec | None:
    """The image interface of the model at `model_path`; None for text-only models (GGUF files
    and directories of other architectures)."""
    if model_path is None or not os.path.isdir(model_path):
        return None
    config_path = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_path):
        return None
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None  # the model loader reports a broken config.json
    arch = (raw.get("architectures") or [None])[0] if isinstance(raw, dict) else None
    if arch not in VISION_ARCHITECTURES:
        return None
    token = raw.get("image_token_index", raw.get("image_token_id"))
    if token is None:
        raise ValueError(f"{config_path}: no image_token_index / image_token_id")
    model_class, text_attr = VISION_ARCHITECTURES[arch]
    return VisionSpec(model_path, arch, int(token), model_class, text_attr)
