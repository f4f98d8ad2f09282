"""Self-speculation's layer cut: a model's first layers as a cheaper draft of itself.

A self-speculative draft is the target's own file loaded again as the draft model (possibly
more cheaply quantized) and cut after its first `count` decoder layers: the kept layers, then
the same final norm and output projection (an early exit). `--speculative-draft-num-layers`
cuts any draft model so; scheduler/draft_model.py runs it as any draft, with its own KV pool.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglite.runtime.model.causal_lm import CausalLM


def keep_first_layers(model: CausalLM, count: int) -> None:
    """Drop every decoder layer of `model` after the first `count`. Call after loading, before
    the first forward; `model.config` then says `count` layers (its KV pool is sized from it).
    ValueError unless 1 <= count <= the model's layers."""
    if not 1 <= count <= len(model.layers):
        raise ValueError(f"can keep 1..{len(model.layers)} layers, not {count}")
    model.layers = model.layers[:count]
    model.config = dataclasses.replace(model.config, num_layers=count)
    model.weights_changed()  # the native decode step was built for the layers in place
