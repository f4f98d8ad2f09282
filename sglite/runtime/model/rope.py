"""Rotary position embeddings: inverse frequencies (with the scaling schemes models use) and the
float32 cos/sin tables the attention layers index by position."""

from __future__ import annotations

import math

import torch

from sglite.runtime.model.config import ModelConfig

# The table grows on demand past this length, so a 128k-context model does not pay for the
# full table up front.
INITIAL_ROPE_LEN = 16384


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Per-frequency inverse wavelengths `[head_dim // 2]` (float32), with scaling applied."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    raise ValueError(
        f"unsupported rope scaling type {kind!r}; supported: default, linear, llama3, freq_factors"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and the band between
    # is interpolated smoothly in wavelength.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RopeTables:
    """cos/sin `[length, head_dim // 2]` in float32 (rotation math runs in float32 whatever the
    activation dtype), grown by doubling when a position beyond them is needed."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.inv_freq = rope_inv_freq(config).to(device)
        self.max_len = max(1, config.max_position_embeddings)
        self.cos = self.sin = torch.empty(0, device=device)
        self._build(min(self.max_len, INITIAL_ROPE_LEN))

    def _build(self, length: int) -> None:
        device = self.inv_freq.device
        positions = torch.arange(length, dtype=torch.int64, device=device).to(torch.float32)
        freqs = torch.outer(positions, self.inv_freq)
        self.cos = freqs.cos().contiguous()
        self.sin = freqs.sin().contiguous()

    def ensure(self, length: int) -> None:
        """Make the tables cover positions `[0, length)`."""
        if length > self.cos.shape[0]:
            self._build(max(length, 2 * self.cos.shape[0]))
