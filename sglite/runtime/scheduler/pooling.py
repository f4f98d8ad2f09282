"""Embeddings: a prompt's final hidden states pooled while it is prefilled.

"last" takes the last prompt token's state (what decoder embedding models such as
Qwen3-Embedding are trained for; a cached prefix is reused, since only the last token's state is
needed); "mean" averages every prompt token's state, so its prompt is computed whole (the radix
cache keeps K/V, not hidden states). Pooling spans chunked-prefill passes. The result is
L2-normalized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

POOLING_MODES = ("last", "mean")


@dataclass
class Pooling:
    """A request's pooling mode and what it has gathered so far."""

    mode: str
    total: torch.Tensor | None = None
    count: int = 0

    def offsets(self, start: int, n: int, prompt_len: int) -> list[int]:
        """Offsets within a prefill chunk `[start, start + n)` whose states are needed."""
        if self.mode == "mean":
            return list(range(n))
        return [n - 1] if start + n == prompt_len else []

    def add(self, hidden: torch.Tensor) -> None:
        """Gather the states `[rows, hidden]` of one chunk."""
        if hidden.numel() == 0:
            return
        part = hidden.sum(dim=0)
        self.total = part if self.total is None else self.total + part
        self.count += hidden.shape[0]

    def embedding(self) -> list[float]:
        """The pooled, L2-normalized vector."""
        assert self.total is not None and self.count
        vector = self.total / self.count
        return torch.nn.functional.normalize(vector, dim=0).tolist()
