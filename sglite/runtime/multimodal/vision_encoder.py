"""Images into the language model's input embeddings, in the scheduler process.

The vision half of a served architecture is transformers' own module (`VisionSpec.
hf_model_class`: the vision tower, the projector or connector, LLaVA-NeXT's newline embedding)
with its weights from the model directory; its language model is built empty and dropped (ours
serves the text). `get_image_features` gives one embedding per image position of the image's
span. A prefill chunk covering some of those positions gets their embeddings; the features of
recent images are kept by content hash (`--vision-cache-images`, 0 for none), so a second
question about the same picture, or a later chunk of it, costs no vision encoding.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable

import torch

from sglite.runtime.model.hf_loader import iter_safetensors_weights, safetensors_files
from sglite.runtime.multimodal.processor import ImageItem
from sglite.runtime.multimodal.spec import VisionSpec
from sglite.runtime.scheduler.prefill import PrefillBatch


class VisionEncoder:
    """The vision half of a model with a bounded cache of image features (see module docstring)."""

    def __init__(self, spec: VisionSpec, device: torch.device, cache_entries: int = 32) -> None:
        import transformers

        self.spec = spec
        self.device = device
        config = transformers.AutoConfig.from_pretrained(spec.model_dir)
        # The language model is built with no layers and a one-token vocabulary, then dropped.
        text = config.text_config
        text.num_hidden_layers, text.vocab_size = 0, 1
        if getattr(text, "layer_types", None) is not None:
            text.layer_types = []
        # float32: the vision half is a small share of a prompt's cost and bf16 is emulated on
        # many CPUs.
        self.model = getattr(transformers, spec.hf_model_class)(config).eval()
        setattr(self.model, spec.text_attr, None)
        self._load(iter_safetensors_weights(safetensors_files(spec.model_dir), progress=False))
        self.model.to(device)
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.cache_entries = cache_entries
        self.encoded_images = 0
        self.encode_seconds = 0.0
        self.cache_hits = 0

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        expected = self.model.state_dict()
        loaded: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            key = _module_key(name, expected)
            if key is not None:
                loaded[key] = tensor
        missing = [k for k in expected if k not in loaded]
        if missing:
            raise ValueError(
                f"{self.spec.model_dir}: the checkpoint lacks vision weights {missing[:3]} "
                f"({len(missing)} missing)"
            )
        self.model.load_state_dict(loaded, strict=False)

    @torch.inference_mode()
    def features(self, image: ImageItem) -> torch.Tensor:
        """The image's `[num_features, hidden]` input embeddings (float32), from the cache when
        the same picture was encoded recently."""
        cached = self.cache.get(image.content_hash)
        if cached is not None:
            self.cache.move_to_end(image.content_hash)
            self.cache_hits += 1
            return cached
        start = time.perf_counter()
        inputs = {k: v.to(self.device) for k, v in image.inputs.items()}
        pooled = self.model.get_image_features(**inputs).pooler_output
        feats = torch.cat([f.reshape(-1, f.shape[-1]) for f in pooled]).float()
        if feats.shape[0] != image.num_features:
            raise ValueError(
                f"the vision half gave {feats.shape[0]} embeddings for an image of "
                f"{image.num_features} positions"
            )
        self.encoded_images += 1
        self.encode_seconds += time.perf_counter() - start
        if self.cache_entries > 0:
            self.cache[image.content_hash] = feats
            if len(self.cache) > self.cache_entries:
                self.cache.popitem(last=False)
        return feats

    def flush(self) -> None:
        """Forget every cached image's features (the server's cache flush)."""
        self.cache.clear()

    def input_embeds(self, plan: PrefillBatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(batch rows, their embeddings) for the image positions each chunk computes."""
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        row = 0
        for item in plan.items:
            start, end = item.start, item.start + item.n
            for image in item.req.images:
                if image.offset >= end or image.offset + image.length <= start:
                    continue
                picked = [
                    (k, image.offset + p)
                    for k, p in enumerate(image.feature_positions)
                    if start <= image.offset + p < end
                ]
                if picked:
                    index = torch.tensor([k for k, _ in picked])
                    rows = torch.tensor([row + pos - start for _, pos in picked])
                    out.append((rows, self.features(image).index_select(0, index)))
            row += item.n
        return out

    def info(self) -> dict[str, float]:
        """Counters for get_server_info."""
        return {
            "vision_encoded_images": self.encoded_images,
            "vision_encode_seconds": self.encode_seconds,
            "vision_cache_hits": self.cache_hits,
            "vision_cached_images": len(self.cache),
        }


def _module_key(name: str, expected: dict[str, torch.Tensor]) -> str | None:
    """The vision module's parameter a checkpoint tensor is, or None (the language model's).
    Checkpoints name the same tensor differently across transformers versions (`model.` in
    front, CLIP's weights under `vision_model.` or not)."""
    key = name.removeprefix("model.")
    for candidate in (key, key.replace("vision_tower.vision_model.", "vision_tower.")):
        if candidate in expected:
            return candidate
    return None
