"""Images into prompt tokens, on the side that tokenizes (the server or the Engine's process).

Each image token in the prompt (the model's `<image>`) becomes `tokens_per_image` positions.
Their ids are pad values drawn from the image's content hash: they are what the radix cache keys
on, so a prompt with the same picture (the same pixels after preprocessing) matches the cached
prefix through the image, and a different picture diverges at its first position. The model
never embeds those ids: the scheduler puts the image's projected features there
(`vision_encoder.py`). Preprocessing is transformers' image processor for the model.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sglite.runtime.multimodal.image_input import ImageLimits, load_image
from sglite.runtime.multimodal.spec import VisionSpec


@dataclass
class ImageItem:
    """One image of a prompt: where its positions are and what the vision tower reads.

    Invariant: `prompt_ids[offset : offset + length]` are `pad_ids(content_hash, length, V)`.
    """

    offset: int
    length: int
    content_hash: str
    pixel_values: torch.Tensor  # [3, H, W], the image processor's output


def pad_ids(content_hash: str, length: int, vocab_size: int) -> list[int]:
    """`length` token ids in [0, vocab_size) determined by `content_hash` (two images share a
    sequence only if their hashes do)."""
    rng = np.random.default_rng(int(content_hash, 16))
    return rng.integers(0, vocab_size, size=length).tolist()


class ImagePromptBuilder:
    """Expands a prompt's image tokens into its images' positions (see the module docstring)."""

    def __init__(self, spec: VisionSpec, hf_tokenizer: Any, vocab_size: int, limits: ImageLimits):
        from transformers import AutoImageProcessor

        self.spec = spec
        self.vocab_size = vocab_size
        self.limits = limits
        self.image_token = hf_tokenizer.convert_ids_to_tokens(spec.image_token_id)
        try:
            self.image_processor = AutoImageProcessor.from_pretrained(spec.model_dir)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{spec.model_dir}: no image processor config ({exc})") from None

    def extra_tokens(self, num_images: int) -> int:
        """How many tokens `num_images` image tokens add to a prompt when expanded."""
        return num_images * (self.spec.tokens_per_image - 1)

    def build(
        self, ids: list[int], images: list[Any], where: str
    ) -> tuple[list[int], list[ImageItem]]:
        """(prompt ids with each image's positions, the images); ValueError naming `where`
        when an image is bad or the images do not match the prompt's image tokens. A prompt
        without image tokens gets its images at the start."""
        if len(images) > self.limits.max_images:
            raise ValueError(
                f"{where}: {len(images)} images, more than the {self.limits.max_images} a "
                "request may have (--max-images-per-request)"
            )
        marks = [i for i, t in enumerate(ids) if t == self.spec.image_token_id]
        if not marks and images:
            ids, marks = [self.spec.image_token_id] * len(images) + ids, list(range(len(images)))
        if len(marks) != len(images):
            raise ValueError(
                f"{where}: the prompt has {len(marks)} image tokens ({self.image_token}) for "
                f"{len(images)} images"
            )
        out: list[int] = []
        items: list[ImageItem] = []
        previous = 0
        for k, (mark, source) in enumerate(zip(marks, images, strict=True)):
            out += ids[previous:mark]
            label = source.get("label") if isinstance(source, dict) else None
            item = self._item(source, len(out), label or f"{where}[{k}]")
            items.append(item)
            out += pad_ids(item.content_hash, item.length, self.vocab_size)
            previous = mark + 1
        out += ids[previous:]
        return out, items

    def _item(self, source: Any, offset: int, where: str) -> ImageItem:
        image = load_image(source, self.limits, where)
        pixels = self.image_processor(images=[image], return_tensors="pt")["pixel_values"][0]
        pixels = pixels.float().contiguous()
        digest = hashlib.blake2b(digest_size=16)
        digest.update(str(tuple(pixels.shape)).encode())
        digest.update(pixels.numpy().tobytes())
        return ImageItem(offset, self.spec.tokens_per_image, digest.hexdigest(), pixels)
