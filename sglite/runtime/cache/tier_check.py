"""Invariant checks of the tiered cache (see tiered_cache.py), run after every test.

Kept apart from the cache so the checks read as a list of the rules they enforce.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglite.runtime.cache.tiered_cache import TieredRadixCache

# Comparing device and host copies reads both; past this many tokens only a prefix of the
# nodes is compared, so a check (also run by /get_server_info) stays a few milliseconds.
MAX_COMPARED_TOKENS = 1024


def check_tiers(cache: TieredRadixCache, check_data: bool = True) -> None:
    """Raise AssertionError naming the first broken tier invariant."""
    host = cache.host
    host_seen: set[int] = set()
    host_leaves = set()
    both: list = []
    for node in cache._iter_nodes():
        where = f"node {node.key[:8]}"
        assert node.slots or node.host_slots is not None, f"{where} holds its KV in no tier"
        if node.host_slots is not None:
            assert host is not None, f"{where} has host slots but there is no host tier"
            assert len(node.host_slots) == len(node.key), f"{where}: host slots != tokens"
            dup = host_seen.intersection(node.host_slots)
            assert not dup and len(set(node.host_slots)) == len(node.host_slots), (
                f"host slots {sorted(dup)[:8]} appear twice in the tree"
            )
            host_seen.update(node.host_slots)
            if node.slots:
                both.append(node)
        if node.slots:
            parent = node.parent
            assert parent is cache.root or parent.slots, (
                f"{where} is on the device but its parent is not (device residency must be "
                "prefix-closed)"
            )
        if cache._is_host_leaf(node):
            host_leaves.add(node)
    assert host_leaves == cache._host_leaves, "host-leaf set is stale"
    if host is not None:
        assert all(0 <= s < host.capacity for s in host_seen), "host slot outside the tier"
        freed = host_seen & host.free_slot_set()
        assert not freed, f"host slots {sorted(freed)[:8]} are owned and free"
        assert host.num_free == len(host.free_slot_set()), "a host slot is free twice"
        assert len(host_seen) == host.used, (
            f"host tier leak: {host.used} slots used, {len(host_seen)} owned by the tree"
        )
    if check_data and both:
        _check_copies_agree(cache, both)


def _check_copies_agree(cache: TieredRadixCache, nodes: list) -> None:
    """A span kept on the device and in the host tier must hold the same K/V in both."""
    host = cache.host
    assert host is not None
    budget = MAX_COMPARED_TOKENS
    for node in nodes:
        if budget <= 0:
            return
        budget -= len(node.slots)
        idx = torch.tensor(node.slots, dtype=torch.long, device=cache.pool.device)
        k_host, v_host = host.read(node.host_slots)
        for layer in range(cache.pool.num_layers):
            for device, stored in (
                (cache.pool.k[layer].index_select(0, idx).cpu(), k_host[layer]),
                (cache.pool.v[layer].index_select(0, idx).cpu(), v_host[layer]),
            ):
                diff = (device.float() - stored.float()).abs()
                if host.quantize:
                    # Half an int8 step of the (token, head) scale, plus the dtype's rounding.
                    step = device.float().abs().amax(dim=-1, keepdim=True) / 127.0
                    bound = 0.5 * step + 1e-2 * device.float().abs() + 1e-6
                    ok = bool((diff <= bound).all())
                else:
                    ok = bool((diff == 0).all())
                assert ok, f"node {node.key[:8]}: device and host copies differ (layer {layer})"
