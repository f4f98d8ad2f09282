"""Rotary position embeddings: inverse frequencies (with the scaling schemes models use) and the
float32 cos/sin tables the attention layers index by position.

A model has one table per distinct RoPE (`RopeSet`): Gemma 3's sliding-window layers rotate with
another base than its global ones, so each layer reads the table of its kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from sglite.runtime.model.config import ModelConfig

# The table grows on demand past this length, so a 128k-context model does not pay for the
# full table up front.
INITIAL_ROPE_LEN = 16384
ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "longrope")


@dataclass(frozen=True)
class RopeSpec:
    """One rotary embedding: head size, base and scaling (Hugging Face dict shape or None)."""

    head_dim: int
    theta: float
    scaling: dict[str, Any] | None
    max_position_embeddings: int

    def kind(self) -> str:
        if not self.scaling:
            return "default"
        return str(self.scaling.get("rope_type", self.scaling.get("type", "default")))


def rope_inv_freq(spec: RopeSpec, factors: list[float] | None = None) -> torch.Tensor:
    """Per-frequency inverse wavelengths `[head_dim // 2]` (float32), with scaling applied.
    `factors`: longrope's per-frequency divisors for the table being built."""
    dim = spec.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (spec.theta**exponents)
    kind, scaling = spec.kind(), spec.scaling or {}
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "longrope":
        assert factors is not None
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * spec.theta**exponents)
    raise ValueError(f"unsupported rope scaling type {kind!r}; supported: {', '.join(ROPE_TYPES)}")


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


def _longrope_parts(spec: RopeSpec) -> tuple[int, float]:
    """Phi-3's longrope: the position from which the long factors apply, and the factor scaling
    cos and sin (sqrt(1 + ln(s) / ln(original length)) for a context extended s times)."""
    scaling = spec.scaling or {}
    original = int(scaling.get("original_max_position_embeddings") or spec.max_position_embeddings)
    attention = scaling.get("attention_factor")
    if attention is None:
        extension = float(scaling.get("factor") or spec.max_position_embeddings / original)
        attention = math.sqrt(1 + math.log(extension) / math.log(original)) if extension > 1 else 1
    return original, float(attention)


class RopeTables:
    """cos/sin `[length, head_dim // 2]` in float32 (rotation math runs in float32 whatever the
    activation dtype), grown by doubling when a position beyond them is needed.

    longrope (Phi-3) rotates positions below its original context with the short factors and
    later ones with the long factors; transformers instead re-rotates the whole sequence with
    the long factors once it passes that length, which a KV cache cannot do. Both agree on
    sequences within the original context.
    """

    def __init__(self, spec: RopeSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        self.max_len = max(1, spec.max_position_embeddings)
        self.cos = self.sin = torch.empty(0, device=device)
        self._build(min(self.max_len, INITIAL_ROPE_LEN))

    def _build(self, length: int) -> None:
        positions = torch.arange(length, dtype=torch.int64, device=self.device).to(torch.float32)
        if self.spec.kind() != "longrope":
            freqs = torch.outer(positions, rope_inv_freq(self.spec).to(self.device))
            self.cos, self.sin = freqs.cos().contiguous(), freqs.sin().contiguous()
            return
        scaling = self.spec.scaling or {}
        original, attention = _longrope_parts(self.spec)
        short = rope_inv_freq(self.spec, scaling["short_factor"]).to(self.device)
        long = rope_inv_freq(self.spec, scaling["long_factor"]).to(self.device)
        inv = torch.where((positions < original)[:, None], short[None, :], long[None, :])
        freqs = positions[:, None] * inv
        self.cos = (freqs.cos() * attention).contiguous()
        self.sin = (freqs.sin() * attention).contiguous()

    def ensure(self, length: int) -> None:
        """Make the tables cover positions `[0, length)`."""
        if length > self.cos.shape[0]:
            self._build(max(length, 2 * self.cos.shape[0]))


class RopeSet:
    """The RoPE tables of a model: the global one, and the local one where sliding-window
    layers rotate differently (`ModelConfig.local_rope_theta`)."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        spec = RopeSpec(
            config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
        )
        self.tables = [RopeTables(spec, device)]
        if config.local_rope_theta is not None:
            local = RopeSpec(
                config.head_dim,
                config.local_rope_theta,
                config.local_rope_scaling,
                config.max_position_embeddings,
            )
            self.tables.append(RopeTables(local, device))
        self.layer_table = [
            self.tables[1 if config.layer_uses_local_rope(i) else 0]
            for i in range(config.num_layers)
        ]

    def for_layer(self, layer: int) -> RopeTables:
        """The table layer `layer` rotates with."""
        return self.layer_table[layer]

    def ensure(self, length: int) -> None:
        """Make every table cover positions `[0, length)`."""
        for table in self.tables:
            table.ensure(length)
