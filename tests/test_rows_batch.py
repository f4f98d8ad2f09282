"""A scattered EXTEND batch (`forward_batch.build_rows`): tokens at chosen positions of a
sequence computed in one pass as a prefill computes them, every other slot's K/V read as it is.
Reusable segments recompute their chosen tokens this way (scheduler/segments.py)."""

from __future__ import annotations

import pytest
import torch

from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.model.forward_batch import ForwardBatch, ForwardMode, build_rows, narrow_rows
from sglite.runtime.model.loader import load_model

TEXT = (
    "The lighthouse keeper counted the ships each evening, writing their names in a book "
    "that nobody read. One winter a ship came that had no name, and he waited for it to pass."
)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_computed_over_exact_kv_give_the_prefills_logits(dtype):
    loaded = load_model(None, dtype, progress=False)
    cfg, model = loaded.config, loaded.model
    ids = loaded.tokenizer.encode(TEXT)
    n = len(ids)
    pool = KVPool(n + 1, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, loaded.dtype, "cpu")
    slots = pool.alloc(n)
    full = ForwardBatch.build(ForwardMode.EXTEND, [ids], [0], [slots], list(range(n)))
    reference = model.forward(full, pool)
    kv_before = pool.k[cfg.num_layers - 1].clone()
    rows = [3, 4, 17, n // 2, n // 2 + 1, n - 5, n - 1]
    batch = build_rows([ids[p] for p in rows], rows, torch.tensor(slots), list(range(len(rows))))
    logits = model.forward(batch, pool)
    # Each row saw exactly the slots up to its position (a causal mask over the rows alone, or
    # one aligned to the end, would give other logits).
    assert torch.equal(logits.argmax(-1), reference[rows].argmax(-1))
    tolerance = 1e-4 if dtype == "float32" else 0.15
    assert (logits - reference[rows]).abs().max().item() < tolerance * reference.abs().max().item()
    # The rows rewrote their own slots with the same K/V; no other slot changed.
    changed = (pool.k[cfg.num_layers - 1] - kv_before).abs().amax(dim=(1, 2))
    others = [s for i, s in enumerate(slots) if i not in rows]
    assert changed[others].max().item() == 0
    if dtype == "float32":
        assert changed[[slots[p] for p in rows]].max().item() < 1e-4


def test_a_rows_batch_ends_at_the_sequences_last_position():
    with pytest.raises(ValueError, match="last position"):
        build_rows([1, 2], [0, 3], torch.arange(6), [1])


class _DropRandomRows:
    """Keeps a random half of the rows (and the last) after every layer."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(0)

    def before_layer(self, layer: int, batch: ForwardBatch, pool: KVPool) -> None:
        pass

    def after_layer(self, layer: int, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        n = batch.extend_lens[0]
        keep = torch.rand(n, generator=self.generator) < 0.5
        keep[-1] = True
        return keep.nonzero().squeeze(1)


def test_a_narrowing_pass_over_exact_kv_gives_the_prefills_logits():
    """Rows dropped between layers keep the K/V the pool holds: over a pool holding a full
    prefill's K/V, any narrowing gives the prefill's last logits, and a dropped token's slots
    are left as they were in every later layer."""
    loaded = load_model(None, "float32", progress=False)
    cfg, model = loaded.config, loaded.model
    ids = loaded.tokenizer.encode(TEXT)
    n = len(ids)
    pool = KVPool(n + 1, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, loaded.dtype, "cpu")
    slots = pool.alloc(n)
    full = ForwardBatch.build(ForwardMode.EXTEND, [ids[5:]], [5], [slots], [n - 6])
    model.forward(ForwardBatch.build(ForwardMode.EXTEND, [ids[:5]], [0], [slots[:5]], []), pool)
    reference = model.forward(full, pool)
    before = [pool.k[layer].clone() for layer in range(cfg.num_layers)]
    logits = model.forward_narrowing(full, pool, _DropRandomRows())
    assert (logits - reference).abs().max().item() < 1e-4 * reference.abs().max().item()
    last = cfg.num_layers - 1
    # Only the sequence's slots: a slot never allocated holds whatever torch.empty left there.
    changed = (pool.k[last] - before[last]).abs().amax(dim=(1, 2))[slots]
    assert changed.max().item() < 1e-4
    with pytest.raises(ValueError, match="keeps every logit row"):
        narrow_rows(full, torch.tensor([0, 1]))
