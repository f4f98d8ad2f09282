"""Images into the language model's input embeddings, in the scheduler process.

LLaVA-1.5's vision side is transformers' CLIP vision model (the same module the reference runs)
and a two-layer projector, with their weights from the model directory. A prefill chunk that
covers part of an image gets that part of its features; the features of recent images are kept
(by content hash, at most `cache_entries` images), so a second question about the same picture,
or a later chunk of it, costs no vision encoding (`--vision-cache-images`, 0 for none).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable

import torch
from torch import nn

from sglite.runtime.model.hf_loader import iter_safetensors_weights, safetensors_files
from sglite.runtime.multimodal.processor import ImageItem
from sglite.runtime.multimodal.spec import VisionSpec
from sglite.runtime.scheduler.prefill import PrefillBatch

# Checkpoint prefixes of the vision side (saved by different transformers versions).
TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


class VisionEncoder:
    """CLIP tower + projector with a bounded cache of image features (see module docstring)."""

    def __init__(
        self, spec: VisionSpec, text_hidden: int, device: torch.device, cache_entries: int = 32
    ) -> None:
        from transformers import CLIPVisionConfig, CLIPVisionModel
        from transformers.activations import ACT2FN

        self.spec = spec
        self.device = device
        skip = ("model_type", "transformers_version", "architectures")
        config = CLIPVisionConfig(**{k: v for k, v in spec.vision_config.items() if k not in skip})
        # float32: the tower is a small share of a prompt's cost and bf16 is emulated on many CPUs.
        self.tower = CLIPVisionModel(config).eval()
        bias = spec.projector_bias
        self.projector = nn.Sequential(
            nn.Linear(config.hidden_size, text_hidden, bias=bias),
            ACT2FN[spec.projector_act],
            nn.Linear(text_hidden, text_hidden, bias=bias),
        ).eval()
        self._load(iter_safetensors_weights(safetensors_files(spec.model_dir), progress=False))
        self.tower.to(device)
        self.projector.to(device)
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.cache_entries = cache_entries
        self.encoded_images = 0
        self.encode_seconds = 0.0
        self.cache_hits = 0

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tower: dict[str, torch.Tensor] = {}
        projector: dict[str, torch.Tensor] = {}
        # transformers versions differ on whether CLIP's weights sit under `vision_model.`.
        expected = set(self.tower.state_dict())
        for name, tensor in weights:
            if name.startswith(TOWER_PREFIXES):
                key = name.split("vision_tower.", 1)[1].removeprefix("vision_model.")
                tower[key if key in expected else "vision_model." + key] = tensor
            elif name.startswith(PROJECTOR_PREFIXES):
                key = name.split("multi_modal_projector.", 1)[1]
                projector[key.replace("linear_1", "0").replace("linear_2", "2")] = tensor
        missing, unexpected = self.tower.load_state_dict(tower, strict=False)
        missing = [k for k in missing if not k.endswith("position_ids")]
        if missing or unexpected:
            raise ValueError(
                f"{self.spec.model_dir}: vision tower weights do not fit its config "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        self.projector.load_state_dict(projector)

    @torch.inference_mode()
    def features(self, image: ImageItem) -> torch.Tensor:
        """The image's `[length, text_hidden]` input embeddings (float32), from the cache when
        the same picture was encoded recently."""
        cached = self.cache.get(image.content_hash)
        if cached is not None:
            self.cache.move_to_end(image.content_hash)
            self.cache_hits += 1
            return cached
        start = time.perf_counter()
        pixels = image.pixel_values.to(self.device).unsqueeze(0)
        hidden = self.tower(pixels, output_hidden_states=True).hidden_states
        selected = hidden[self.spec.feature_layer]
        if self.spec.select_strategy == "default":
            selected = selected[:, 1:]  # without the class token
        feats = self.projector(selected)[0].float()
        if feats.shape[0] != image.length:
            raise ValueError(
                f"the vision tower gave {feats.shape[0]} positions for an image of {image.length}"
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

    def input_embeds(self, plan: PrefillBatch) -> list[tuple[int, torch.Tensor]]:
        """(first row, embeddings) for every image position the prefill computes: each chunk
        gets the part of its images it covers."""
        out: list[tuple[int, torch.Tensor]] = []
        row = 0
        for item in plan.items:
            start, end = item.start, item.start + item.n
            for image in item.req.images:
                lo, hi = max(start, image.offset), min(end, image.offset + image.length)
                if lo < hi:
                    feats = self.features(image)[lo - image.offset : hi - image.offset]
                    out.append((row + lo - start, feats))
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
