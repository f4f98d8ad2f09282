"""A tiny random LLaVA-1.5 (CLIP vision tower + projector + small Llama) built with transformers
and saved with its processor: no vision-language weights can be downloaded here, so the tests
(tests/test_multimodal.py) and the image-QA benchmark run on this."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

import numpy as np

WORDS = ["<unk>", "<s>", "</s>", "<image>"] + [
    "what", "is", "in", "the", "picture", "describe", "it", "a", "cat", "dog", "red", "blue",
    "sky", "tree", "and", "of", "on", "color", "main", "object", "there", "are", "two", "one",
    "how", "many", "where", "left", "right", "top", "bottom", "shape", "big", "small",
]  # fmt: skip
IMAGE_TOKEN_ID = 3


@dataclass(frozen=True)
class TinyLlavaShape:
    """Sizes of the tiny model: image side and patch (tokens per image = (side/patch)^2)."""

    image_size: int = 30
    patch_size: int = 6
    vision_hidden: int = 32
    vision_layers: int = 3
    text_hidden: int = 64
    text_layers: int = 2
    weight_scale: float = 4.0  # larger weights: decisive argmaxes, features that matter

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def build_tiny_llava(path: str, shape: TinyLlavaShape = TinyLlavaShape(), seed: int = 0) -> str:
    """Save a random LlavaForConditionalGeneration, its tokenizer (words of `WORDS`, `<image>` a
    special token, a chat template that writes image parts as `<image>`) and its processor."""
    import torch
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    raw = RawTokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
        "{% for part in m['content'] %}{% if part['type'] == 'image' %}<image> {% else %}"
        "{{ part['text'] }} {% endif %}{% endfor %}{% endif %} {% endfor %}"
    )
    text = LlamaConfig(
        vocab_size=len(WORDS), hidden_size=shape.text_hidden,
        intermediate_size=2 * shape.text_hidden, num_hidden_layers=shape.text_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    vision = CLIPVisionConfig(
        hidden_size=shape.vision_hidden, intermediate_size=2 * shape.vision_hidden,
        num_hidden_layers=shape.vision_layers, num_attention_heads=4,
        image_size=shape.image_size, patch_size=shape.patch_size, projection_dim=32,
    )  # fmt: skip
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=IMAGE_TOKEN_ID)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(shape.weight_scale)
    model.save_pretrained(path)
    side = shape.image_size
    images = CLIPImageProcessor(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    )
    processor = LlavaProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=shape.patch_size,
        vision_feature_select_strategy="default", image_token="<image>",
        num_additional_image_tokens=1, chat_template=tokenizer.chat_template,
    )  # fmt: skip
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def random_png(seed: int, size: tuple[int, int] = (40, 52)) -> bytes:
    """A PNG of random pixels (a different picture per seed)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(png: bytes) -> str:
    """`png` as a base64 data: URL."""
    return "data:image/png;base64," + base64.b64encode(png).decode()
