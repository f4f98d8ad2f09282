"""The model families sglite serves, one module each, and the lookups the loader uses.

Adding a family: write `models/<family>.py` exporting `FAMILY` (a `base.ModelFamily`: how its
config and checkpoint names map onto `ModelConfig` and the canonical names), list it in
`FAMILIES`, and add its tiny-model test to tests/test_model_families.py. New behaviour in the
forward pass is a `ModelConfig` field read by the shared layers (`layers/`).
"""

from __future__ import annotations

from sglite.runtime.model.models import (
    gemma3,
    llama,
    llava,
    mixtral,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
)
from sglite.runtime.model.models.base import ModelFamily

FAMILIES: tuple[ModelFamily, ...] = (
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    qwen3_moe.FAMILY,
    mixtral.FAMILY,
    gemma3.FAMILY,
    phi3.FAMILY,
    llava.FAMILY,
)


def supported_hf_architectures() -> list[str]:
    """Every Hugging Face architecture name a family serves."""
    return [arch for family in FAMILIES for arch in family.hf_architectures]


def supported_gguf_architectures() -> list[str]:
    """Every GGUF `general.architecture` a family serves."""
    return [arch for family in FAMILIES for arch in family.gguf_architectures]


def family_for_hf(arch: str | None, model_type: str | None) -> ModelFamily | None:
    """The family of a `config.json`'s first `architectures` entry (else its `model_type`)."""
    for family in FAMILIES:
        if arch in family.hf_architectures:
            return family
    if arch is None:
        for family in FAMILIES:
            if model_type in family.hf_model_types:
                return family
    return None


def family_for_gguf(arch: str | None) -> ModelFamily | None:
    """The family of a GGUF file's `general.architecture`."""
    return next((f for f in FAMILIES if arch in f.gguf_architectures), None)
