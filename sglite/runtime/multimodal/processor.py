"""Images into prompt tokens, on the side that tokenizes (the server or the Engine's process).

Each image token in the prompt becomes the image's span, as the model's own transformers
processor writes it for one image: LLaVA-1.5 a run of image tokens, LLaVA-NeXT a run sized by
the image's tiles, SmolVLM/Idefics3 tiles of image tokens between row and column markers. The
image-token positions of the span get pad ids drawn from the image's content hash: they are what
the radix cache keys on, so a prompt with the same picture (the same preprocessed pixels)
matches the cached prefix through the image, and a different picture diverges at its first
image position. Pad ids are negative, so they never equal a text token (a text prompt can never
match an image's cached KV), and whatever reads prompt ids as tokens (penalties, detokenizer
context, input logprobs) skips them. The model never embeds them: the scheduler puts the
image's features there (`vision_encoder.py`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from sglite.runtime.multimodal.image_input import ImageInputError, ImageLimits, load_image
from sglite.runtime.multimodal.spec import VisionSpec

if TYPE_CHECKING:  # the HTTP process imports torch only when an image arrives
    import torch

# Processor outputs that are text, not the vision tower's input.
TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})


@dataclass
class ImageItem:
    """One image of a prompt: its span of the prompt and what the vision side reads.

    Invariant: the features go to prompt positions `offset + p` for p in `feature_positions`
    (ascending, within `[0, length)`), which hold `pad_ids(content_hash, n)`.
    """

    offset: int
    length: int
    feature_positions: list[int]
    content_hash: str
    inputs: dict[str, torch.Tensor]  # the processor's vision inputs for this one image

    @property
    def num_features(self) -> int:
        return len(self.feature_positions)


@dataclass
class PreparedImage:
    """An image read and preprocessed (`ImagePromptBuilder.prepare`), not yet placed in a
    prompt: its span (pad ids at `feature_positions`) and vision inputs."""

    span: list[int]
    feature_positions: list[int]
    content_hash: str
    inputs: dict[str, torch.Tensor]


def pad_ids(content_hash: str, length: int) -> list[int]:
    """`length` negative ids determined by `content_hash` (two images share a sequence only if
    their hashes do; no text token is negative)."""
    rng = np.random.default_rng(int(content_hash, 16))
    return (-rng.integers(1, 1 << 62, size=length)).tolist()


def is_pad(token_id: int) -> bool:
    """Whether a prompt id is an image position's pad (not a token)."""
    return token_id < 0


class ImagePromptBuilder:
    """Expands a prompt's image tokens into its images' spans (see the module docstring)."""

    def __init__(self, spec: VisionSpec, hf_tokenizer: Any, limits: ImageLimits):
        from transformers import AutoProcessor

        self.spec = spec
        self.limits = limits
        self.image_token = hf_tokenizer.convert_ids_to_tokens(spec.image_token_id)
        try:
            self.processor = AutoProcessor.from_pretrained(spec.model_dir)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{spec.model_dir}: cannot load its processor ({exc})") from None

    def build(
        self, ids: list[int], images: list[Any], where: str
    ) -> tuple[list[int], list[ImageItem]]:
        """(prompt ids with each image's span, the images); ValueError naming `where` when an
        image is bad or the images do not match the prompt's image tokens. A prompt without
        image tokens gets its images at the start."""
        if len(images) > self.limits.max_images:
            raise ImageInputError(
                f"{where}: {len(images)} images, more than the {self.limits.max_images} a "
                "request may have (--max-images-per-request)"
            )
        marks = [i for i, t in enumerate(ids) if t == self.spec.image_token_id]
        if not marks and images:
            ids, marks = [self.spec.image_token_id] * len(images) + ids, list(range(len(images)))
        if len(marks) != len(images):
            raise ImageInputError(
                f"{where}: the prompt has {len(marks)} image tokens ({self.image_token}) for "
                f"{len(images)} images"
            )
        out: list[int] = []
        items: list[ImageItem] = []
        previous = 0
        for k, (mark, source) in enumerate(zip(marks, images, strict=True)):
            out += ids[previous:mark]
            prepared = source
            if not isinstance(source, PreparedImage):
                label = source.get("label") if isinstance(source, dict) else None
                prepared = self.prepare(source, label or f"{where}[{k}]")
            items.append(
                ImageItem(
                    len(out),
                    len(prepared.span),
                    prepared.feature_positions,
                    prepared.content_hash,
                    prepared.inputs,
                )
            )
            out += prepared.span
            previous = mark + 1
        out += ids[previous:]
        return out, items

    def prepare(self, source: Any, where: str) -> PreparedImage:
        """Read, check and preprocess one image (the costly part of `build`, which takes
        prepared images too); ValueError naming `where`. Not thread-safe: one caller at a time
        (the processor's tokenizer)."""
        image = load_image(source, self.limits, where)
        try:
            processed = self.processor(
                text=self.image_token, images=[image], return_tensors="pt", add_special_tokens=False
            )
        except Exception as exc:  # the processor's own checks (sizes, modes)
            message = f"{where}: the model's processor refused the image ({exc})"
            raise ImageInputError(message) from None
        span = processed["input_ids"][0].tolist()
        inputs = {k: v for k, v in processed.items() if k not in TEXT_KEYS}
        import torch

        digest = hashlib.blake2b(digest_size=16)
        for key in sorted(inputs):
            value = torch.as_tensor(inputs[key]).contiguous()
            digest.update(f"{key}{tuple(value.shape)}{value.dtype}".encode())
            digest.update(value.numpy().tobytes())
        content_hash = digest.hexdigest()
        positions = [i for i, t in enumerate(span) if t == self.spec.image_token_id]
        for i, pad in zip(positions, pad_ids(content_hash, len(positions))):
            span[i] = pad
        return PreparedImage(span, positions, content_hash, inputs)
