"""Tiny random vision-language models built with transformers and saved with their processors:
LLaVA-1.5 (CLIP tower + projector + small Llama), LLaVA-NeXT (the same with any-resolution
tiles) and Idefics3 (SmolVLM's architecture: a SigLIP-style tower, pixel-shuffle connector,
image splitting). Tests and benchmarks run on these without downloading any weights."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from torch import nn
    from transformers import LlamaConfig, PreTrainedTokenizerFast

WORDS = ["<unk>", "<s>", "</s>", "<image>"] + [
    "what", "is", "in", "the", "picture", "describe", "it", "a", "cat", "dog", "red", "blue",
    "sky", "tree", "and", "of", "on", "color", "main", "object", "there", "are", "two", "one",
    "how", "many", "where", "left", "right", "top", "bottom", "shape", "big", "small",
]  # fmt: skip
IMAGE_TOKEN_ID = 3
# Idefics3's structure tokens around an image's tiles.
IDEFICS3_WORDS = ["<fake_token_around_image>", "<global-img>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 4) for c in range(1, 4)
]
# The messages' texts one after another, an image part written as `<image> `.
PLAIN_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}<image> {% else %}"
    "{{ part['text'] }} {% endif %}{% endfor %}{% endif %} {% endfor %}"
)
# A ChatML-style conversation's tokens ("\n" is a token there, as in real vocabularies).
CHATML_SPECIAL = ["<|im_start|>", "<|im_end|>"]
CHATML_WORDS = [*CHATML_SPECIAL, "\n", "user", "assistant", "system"]
# A ChatML-style chat template that writes an image part as `<image>\n`, as LLaVA-1.5
# checkpoints converted with such a template do.
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for part in m['content'] %}{% if part['type'] == 'image' %}"
    "<image>\n{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


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
        """Positions one image takes in the prompt."""
        return (self.image_size // self.patch_size) ** 2


def build_tiny_llava(
    path: str, shape: TinyLlavaShape = TinyLlavaShape(), seed: int = 0, chatml: bool = False
) -> str:
    """Save a random LlavaForConditionalGeneration with its tokenizer (`_tokenizer`) and
    processor (`num_additional_image_tokens=1`, `vision_feature_select_strategy="default"`: the
    CLS position is dropped). `chatml`: a vocabulary with ChatML's tokens and "\n", and
    `CHATML_TEMPLATE` as the chat template (the processor's and the tokenizer's)."""
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    words = WORDS + CHATML_WORDS if chatml else WORDS
    tokenizer = _tokenizer(words, CHATML_SPECIAL if chatml else (), chatml)
    text = _text_config(len(words), shape.text_hidden, shape.text_layers)
    vision = CLIPVisionConfig(
        hidden_size=shape.vision_hidden, intermediate_size=2 * shape.vision_hidden,
        num_hidden_layers=shape.vision_layers, num_attention_heads=4,
        image_size=shape.image_size, patch_size=shape.patch_size, projection_dim=32,
    )  # fmt: skip
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=IMAGE_TOKEN_ID)
    torch.manual_seed(seed)
    _save_scaled(LlavaForConditionalGeneration(config), path, shape.weight_scale)
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


def build_tiny_llava_next(path: str, seed: int = 0) -> str:
    """A random LlavaNextForConditionalGeneration: 30-pixel tiles of a 6-pixel patch grid, an
    image split by the best of three tile grids (any resolution)."""
    import torch
    from transformers import (
        CLIPVisionConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
    )

    grids = [[30, 60], [60, 30], [60, 60]]
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        image_size=30, patch_size=6, projection_dim=32,
    )  # fmt: skip
    config = LlavaNextConfig(
        text_config=_text_config(len(WORDS)), vision_config=vision,
        image_token_index=IMAGE_TOKEN_ID, image_grid_pinpoints=grids,
    )  # fmt: skip
    torch.manual_seed(seed)
    _save_scaled(LlavaNextForConditionalGeneration(config), path, 4.0)
    tokenizer = _tokenizer(WORDS)
    images = LlavaNextImageProcessor(
        size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30},
        image_grid_pinpoints=grids,
    )  # fmt: skip
    processor = LlavaNextProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=6,
        vision_feature_select_strategy="default", image_token="<image>",
        num_additional_image_tokens=1,
    )  # fmt: skip
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_idefics3(path: str, seed: int = 0) -> str:
    """A random Idefics3ForConditionalGeneration (SmolVLM-256M/500M's architecture): an image
    split into 32-pixel tiles plus a global view, 4 positions per tile after the connector."""
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
        Idefics3VisionConfig,
    )

    words = WORDS + IDEFICS3_WORDS
    vision = Idefics3VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=32, patch_size=8,
    )  # fmt: skip
    config = Idefics3Config(
        text_config=_text_config(len(words)).to_dict(), vision_config=vision.to_dict(),
        image_token_id=IMAGE_TOKEN_ID, scale_factor=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    _save_scaled(Idefics3ForConditionalGeneration(config), path, 4.0)
    tokenizer = _tokenizer(words, IDEFICS3_WORDS)
    images = Idefics3ImageProcessor(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True
    )
    Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4).save_pretrained(
        path
    )
    tokenizer.save_pretrained(path)
    return path


def _text_config(vocab_size: int, hidden: int = 64, layers: int = 2) -> LlamaConfig:
    """A small Llama text model's config."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


def _tokenizer(
    words: list[str], extra_special: tuple[str, ...] | list[str] = (), chatml: bool = False
) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `words` (`<image>` and `extra_special` special tokens) with
    `PLAIN_TEMPLATE` as its chat template (`chatml`: `CHATML_TEMPLATE`, and "\n" is a token)."""
    from tokenizers import Regex
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Split, Whitespace
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    # Whitespace's words and punctuation; with `chatml`, each "\n" a word too.
    raw.pre_tokenizer = (
        Split(Regex(r"\n|\w+|[^\w\s]+"), behavior="removed", invert=True)
        if chatml
        else Whitespace()
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>", *extra_special]})
    tokenizer.chat_template = CHATML_TEMPLATE if chatml else PLAIN_TEMPLATE
    return tokenizer


def _save_scaled(model: nn.Module, path: str, scale: float) -> None:
    """Scale every weight (decisive argmaxes, image features that matter) and save."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    model.eval().save_pretrained(path)


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
