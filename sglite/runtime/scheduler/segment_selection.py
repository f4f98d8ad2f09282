"""Which reused segment tokens a segment assembly recomputes (CacheBlend's selection).

The assembly's pass starts with every token after the exact prefix. Layer 0's K/V depend on
token and position only (repositioning made the copied ones right); layer 1's are the first to
show what a token's new context changes. After layer 1 the pass keeps the rows that are not
in a reused segment (the question, text between segments, the prompt's last token) and the
segment tokens whose K/V moved most from the copied ones (squared distance of keys and
values, over all segments together; ties to the earlier token). The others keep their copied
K/V in every later layer.

- `once`: the choice after layer 1 is final: `ceil(f x S)` of the `S` reused tokens go through
  every layer.
- `layerwise` (CacheBlend's gradual filtering): the choice is narrowed again after each later
  layer among the tokens still computed, by that layer's deviation, from `ceil(1.5f x S)` after
  layer 1 (all at f >= 2/3) down to `0.5f x S` at the last layer, linearly, so that the tokens
  computed per layer average `f x S`: the same cost as `once`.

Invariant: the kept rows are ascending and include every row that is not a candidate (a reused
token other than the last), so the logit row always goes on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.model.forward_batch import ForwardBatch
from sglite.runtime.server_args_checks import SEGMENT_SELECTIONS

SELECT_AFTER_LAYER = 1  # the first layer whose K/V can deviate from the copied ones
# Layerwise selection's first share, as a multiple of the fraction. Starting at 2f (down to no
# reused token in the last layer) matched fewer answers at equal cost (docs/segments.md).
LAYERWISE_START = 1.5


def keep_counts(
    num_layers: int, candidates: int, fraction: float, selection: str
) -> dict[int, int]:
    """How many candidates stay after each narrowing layer (see the module docstring)."""
    if selection not in SEGMENT_SELECTIONS:
        raise ValueError(f"selection must be one of {SEGMENT_SELECTIONS}, got {selection!r}")
    first, last = SELECT_AFTER_LAYER, num_layers - 2  # nothing to narrow after the last layer
    if last < first:
        return {}
    if selection == "once":
        return {first: math.ceil(fraction * candidates)}
    start = min(1.0, LAYERWISE_START * fraction)
    end = 2 * fraction - start  # the linear schedule's mean is `fraction`
    steps = last - first
    counts = {}
    for layer in range(first, last + 1):
        share = start if steps == 0 else start + (end - start) * (layer - first) / steps
        counts[layer] = min(candidates, math.ceil(share * candidates))
    return counts


@dataclass
class DeviationNarrowing:
    """The `RowNarrowing` of a segment assembly. `candidate[p]`: prompt position p is a reused
    token that may be dropped. `computed` records, per layer after the first narrowing, how many
    candidates that layer computed."""

    candidate: torch.Tensor  # [num_prompt] bool
    counts: dict[int, int]
    computed: list[int] = field(default_factory=list)
    _rows: torch.Tensor | None = None  # candidate rows of the batch the next layer runs
    _copied: torch.Tensor | None = None  # their K/V before it ran

    def before_layer(self, layer: int, batch: ForwardBatch, pool: KVPool) -> None:
        counted, chosen_after = layer > SELECT_AFTER_LAYER, layer in self.counts
        if not (counted or chosen_after):
            return
        rows = self.candidate.index_select(0, batch.positions.cpu()).nonzero().squeeze(1)
        if counted:
            self.computed.append(int(rows.numel()))
        if chosen_after:
            self._rows = rows
            self._copied = self._kv(layer, batch, pool)

    def after_layer(self, layer: int, batch: ForwardBatch, pool: KVPool) -> torch.Tensor | None:
        if layer not in self.counts:
            return None
        assert self._rows is not None and self._copied is not None
        deviation = (self._kv(layer, batch, pool) - self._copied).square().sum((1, 2))
        order = torch.argsort(deviation.cpu(), descending=True, stable=True)
        chosen = self._rows.index_select(0, order[: self.counts[layer]])
        keep = ~self.candidate.index_select(0, batch.positions.cpu())
        keep[chosen] = True
        return keep.nonzero().squeeze(1).to(batch.positions.device)

    @property
    def recomputed(self) -> int:
        """Candidates computed per layer past the first narrowing, on average (rounded up); in
        a model too shallow to narrow (under 3 layers), every candidate."""
        if not self.computed:
            return int(self.candidate.sum())
        return math.ceil(sum(self.computed) / len(self.computed))

    def _kv(self, layer: int, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """`[rows, heads, 2 x head_dim]` float: the candidate rows' keys, then values."""
        assert self._rows is not None
        slots = batch.out_slots.index_select(0, self._rows.to(batch.out_slots.device))
        k, v = pool.k[layer].index_select(0, slots), pool.v[layer].index_select(0, slots)
        return torch.cat([k, v], dim=-1).float()
