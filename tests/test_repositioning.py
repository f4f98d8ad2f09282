"""Moving cached KV to another position (`model/repositioning.py`), on tiny random models of
real families: a span's first-layer keys and values depend on its tokens and positions only, so
a span computed alone and moved by the length of a prefix must equal the same span computed
after that prefix; deeper layers differ (they saw another context), which is what a selective
recompute repairs."""

from __future__ import annotations

import pytest
import torch
from test_model_families import make_family_model
from test_model_parity import extend, new_pool

from sglite.runtime.model.loader import load_model
from sglite.runtime.model.repositioning import reposition


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])  # k norms; local and global RoPE tables
def test_a_moved_span_has_the_keys_it_would_have_there(tmp_path, family):
    make_family_model(family, str(tmp_path))
    loaded = load_model(str(tmp_path), "float32", progress=False)
    pool = new_pool(loaded, 256)
    prefix, span = list(range(5, 29)), list(range(40, 56))
    _, (alone,) = extend(loaded, pool, [span])  # positions 0..15
    _, (after,) = extend(loaded, pool, [prefix + span])  # the span at 24..39
    in_place = after[len(prefix) :]
    moved = pool.alloc(len(span))
    reposition(pool, loaded.model.ropes, alone, moved, delta=len(prefix))
    for layer in (0,):
        torch.testing.assert_close(pool.k[layer][moved], pool.k[layer][in_place])
        torch.testing.assert_close(pool.v[layer][moved], pool.v[layer][in_place])
    last = loaded.config.num_layers - 1
    assert not torch.allclose(pool.v[last][moved], pool.v[last][in_place], atol=1e-4)
    # Moving back recovers the span computed alone.
    back = pool.alloc(len(span))
    reposition(pool, loaded.model.ropes, moved, back, delta=-len(prefix))
    for layer in range(loaded.config.num_layers):
        torch.testing.assert_close(pool.k[layer][back], pool.k[layer][alone])
        assert torch.equal(pool.v[layer][back], pool.v[layer][alone])


def test_bad_slot_lists_are_refused(tmp_path):
    make_family_model("qwen3", str(tmp_path))
    loaded = load_model(str(tmp_path), "float32", progress=False)
    pool = new_pool(loaded, 32)
    slots = pool.alloc(4)
    with pytest.raises(ValueError, match="overlap"):
        reposition(pool, loaded.model.ropes, slots, slots, delta=3)
    with pytest.raises(ValueError, match="3 source slots for 4"):
        reposition(pool, loaded.model.ropes, slots[:3], pool.alloc(4), delta=3)
