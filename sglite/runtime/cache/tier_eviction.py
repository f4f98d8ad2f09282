"""Eviction in the tiered cache: which spans leave the device pool and the host tier, and where
they go.

Device eviction takes unlocked device leaves (nodes with no child on the device), lowest
priority first: a span with a host copy just drops its device copy; otherwise it is copied to
the host tier (write-back); when the host tier cannot take it, it leaves the tree with its
subtree, its pages written to disk. Making room in the host tier drops host-only leaves first
(their pages go to disk), then host copies of spans that are also on the device.

Priority is `last_access` (LRU), or expected benefit (GDSF): `aging + (hits + 1) * cost to
restore a token from the tier below`, where `aging` rises to each device victim's priority.

Invariants kept:
- Locked nodes are never demoted or dropped, and a node leaves the device only when no child is
  on it, so device residency stays prefix-closed.
- A span leaves the tree only through `cache._retire`, which first writes its pages to disk.
- The candidate heaps may hold entries made stale by an earlier victim; each pop re-checks.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglite.runtime.cache.tiered_cache import TieredRadixCache
    from sglite.runtime.cache.tree_node import TreeNode


def evict_device(cache: TieredRadixCache, num_tokens: int) -> int:
    """Free at least `num_tokens` device slots if possible, demoting spans to the host tier
    (or dropping them, written to disk, when there is none or it cannot take them)."""
    if num_tokens <= 0:
        return 0
    heap = [(_priority(cache, n, "device"), n.serial, n) for n in cache._evictable_leaves]
    heapq.heapify(heap)
    freed = 0
    while freed < num_tokens and heap:
        key, _, node = heapq.heappop(heap)
        if node.parent is None or not cache._is_evictable_leaf(node):
            continue  # dropped or changed by an earlier demotion in this loop
        parent = node.parent
        cache._aging = max(cache._aging, key) if cache.config.eviction_policy == "benefit" else 0
        freed += _demote(cache, node)
        if parent is not cache.root and cache._is_evictable_leaf(parent):
            heapq.heappush(heap, (_priority(cache, parent, "device"), parent.serial, parent))
    cache.stats.evicted_tokens += freed
    cache.tier_stats["device"].evicted_tokens += freed
    return freed


def _demote(cache: TieredRadixCache, node: TreeNode) -> int:
    """Take `node` (an evictable device leaf) off the device; returns the slots freed."""
    n = len(node.slots)
    host = cache.tier_stats["host"]
    if node.host_slots is None and cache.host is not None:
        host_slots = host_alloc(cache, n)
        if host_slots is not None:
            cache.io.to_host(node.slots, host_slots)
            node.host_slots = host_slots
    if node.host_slots is None:
        _drop_subtree(cache, node)  # no tier can keep it: it (and its tail) leaves the tree
        return n
    host.demotions += 1
    cache.pool.free(node.slots)
    node.slots = []
    cache._evictable -= n
    cache._refresh(node)
    cache._refresh(node.parent)
    return n


def host_alloc(cache: TieredRadixCache, n: int, make_room: bool = True) -> list[int] | None:
    """`n` host slots, or None. With `make_room`, host-only leaves leave the tree (to disk)
    first, then host copies of spans that are also on the device are dropped."""
    assert cache.host is not None
    if n > cache.host.capacity:
        return None
    if cache.host.num_free < n and make_room:
        _evict_host(cache, n - cache.host.num_free)
        if cache.host.num_free < n:
            _drop_host_copies(cache, n - cache.host.num_free)
    return cache.host.alloc(n)


def _drop_host_copies(cache: TieredRadixCache, num_tokens: int) -> None:
    """Free host copies of spans that are on the device too (lowest priority first): they
    only save a copy at eviction time, while a demoted span has no other fast copy."""
    assert cache.host is not None
    copies = [n for n in cache._iter_nodes() if n.slots and n.host_slots is not None]
    copies.sort(key=lambda n: (_priority(cache, n, "host"), n.serial))
    freed = 0
    for node in copies:
        if freed >= num_tokens:
            break
        cache.host.free(node.host_slots)
        freed += len(node.host_slots)
        cache.tier_stats["host"].evicted_tokens += len(node.host_slots)
        node.host_slots = None
        cache._refresh(node)


def _evict_host(cache: TieredRadixCache, num_tokens: int) -> None:
    """Drop host-only leaves (lowest priority first) until `num_tokens` host slots are free."""
    heap = [(_priority(cache, n, "host"), n.serial, n) for n in cache._host_leaves]
    heapq.heapify(heap)
    freed = 0
    while freed < num_tokens and heap:
        _, _, node = heapq.heappop(heap)
        if node not in cache._host_leaves:
            continue
        parent = node.parent
        freed += len(node.key)
        cache._retire(node)
        if parent in cache._host_leaves:
            heapq.heappush(heap, (_priority(cache, parent, "host"), parent.serial, parent))


def _drop_subtree(cache: TieredRadixCache, node: TreeNode) -> None:
    """Remove `node` and its descendants (children first), persisting their pages."""
    order: list[TreeNode] = []
    stack = [node]
    while stack:
        walk = stack.pop()
        order.append(walk)
        stack.extend(walk.children.values())
    for walk in reversed(order):  # every node is a leaf when its turn comes
        cache._retire(walk)


def _priority(cache: TieredRadixCache, node: TreeNode, tier: str) -> float:
    """Eviction order within a tier: lowest first. LRU, or expected benefit (GDSF): hits
    times what a token costs to restore from the tier below, plus an aging term."""
    if cache.config.eviction_policy == "lru":
        return node.last_access
    if tier == "device":
        backed = "host" if cache.host is not None else ("disk" if cache.disk else None)
    else:
        backed = "disk" if cache.disk is not None else None
    return cache._aging + (node.hit_count + 1) * cache.costs.miss_cost_per_token(backed)
