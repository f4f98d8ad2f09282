"""`PromptBuilder`: a prompt's token ids from its text or ids, its images and its segment spans.

Text is tokenized with the model's BOS. A text prompt with segments is tokenized piece by piece
at the segments' character boundaries, so a segment's tokens are the same wherever it appears
(what lets scheduler/segments.py reuse its KV). Images are read and preprocessed off the event
loop (`prepare_images`), then spliced into the ids as their spans (`expand_images`, see
multimodal/processor.py). Every failure is a ValueError naming the argument at fault.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sglite.runtime.multimodal.processor import ImageItem, ImagePromptBuilder, PreparedImage
from sglite.runtime.scheduler.io import check_segments
from sglite.runtime.tokenizer import Tokenizer


class PromptBuilder:
    """Turns what a request gives as its prompt into token ids; one per TokenizerManager.

    `images` is None for a text-only model: any image is then a ValueError.
    """

    def __init__(self, tokenizer: Tokenizer, images: ImagePromptBuilder | None) -> None:
        self.tokenizer = tokenizer
        self.images = images
        # Images are prepared off the event loop: a big image must not stall the streams served.
        self._image_worker = ThreadPoolExecutor(1, thread_name_prefix="images")

    def token_ids(
        self, prompt: str | list[str] | None, input_ids: list[int] | list[list[int]] | None
    ) -> tuple[list[str] | None, list[Any], bool]:
        """(the texts or None, each prompt's ids, is_batch) from exactly one of `prompt` and
        `input_ids`; the ids are checked later (validation.py), the texts here."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt (text) and input_ids")
        if prompt is not None:
            is_batch = isinstance(prompt, list)
            texts = prompt if is_batch else [prompt]
            if is_batch and not texts:
                raise ValueError("the prompt list is empty")
            for text in texts:
                if not isinstance(text, str):
                    raise ValueError(f"text must be a string or a list of strings, got {text!r}")
            return texts, [self.tokenizer.encode(t) for t in texts], is_batch
        is_batch = bool(input_ids) and isinstance(input_ids[0], list)
        return None, input_ids if is_batch else [input_ids], is_batch

    def encode_with_segments(
        self, text: str, spans: list[Any]
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """A text prompt tokenized piece by piece at its segments' character boundaries (so a
        segment's tokens are the same wherever it appears), and the segments' token spans."""
        problem = check_segments(spans, len(text))
        if problem:
            raise ValueError(problem.replace("token", "character"))
        ids: list[int] = []
        token_spans = []
        cut = 0
        for start, end in spans:
            ids += self._encode_piece(text[cut:start], first=not ids and cut == 0)
            piece = self._encode_piece(text[start:end], first=not ids)
            token_spans.append((len(ids), len(ids) + len(piece)))
            ids += piece
            cut = end
        ids += self._encode_piece(text[cut:], first=not ids)
        return ids, token_spans

    def _encode_piece(self, text: str, first: bool) -> list[int]:
        if first:
            return self.tokenizer.encode(text)  # with the model's BOS
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def require_vision(self, where: str) -> None:
        """ValueError naming `where` if this model takes text only."""
        if self.images is None:
            raise ValueError(f"{where}: this model takes text only (it has no vision tower)")

    def expand_images(
        self, ids: list[int], images: list[Any], where: str
    ) -> tuple[list[int], list[ImageItem]]:
        """A prompt's ids with its images' spans, and the images (`ImagePromptBuilder.build`);
        ValueError naming `where` for bad images or a text-only model."""
        self.require_vision(where)
        assert self.images is not None
        return self.images.build(ids, images, where)

    async def prepare_images(self, image_data: Any, where: str) -> Any:
        """`image_data` (one image, a list, or a list of lists) with each image read and
        preprocessed, off the event loop on the one image worker. ValueError naming the image's
        place for a bad one."""
        if image_data is None or self.images is None:
            return image_data
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._image_worker, self._prepare_tree, image_data, where)

    def _prepare_tree(self, data: Any, where: str) -> Any:
        assert self.images is not None
        if isinstance(data, list):
            return [self._prepare_tree(d, f"{where}[{i}]") for i, d in enumerate(data)]
        if data is None or isinstance(data, PreparedImage):
            return data
        label = data.get("label") if isinstance(data, dict) else None
        return self.images.prepare(data, label or where)
