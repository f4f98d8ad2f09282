"""Promotion: bringing a matched prefix back onto the device from the host tier and disk pages.

`promote_prefix` (`TieredRadixCache.load_prefix`) runs at admission, before the request's
extend: it matches the request in every tier, copies the matched host-only spans into newly
allocated pool slots, then reads the disk pages that continue a match that is wholly on the
device (found by content hash, so pages a previous run left behind serve too) and inserts them
into the tree. Each tier's span is loaded only if that beats recomputing it (`TierCostModel`, or
a forced `load_policy`) and the pool has room.

Invariants kept:
- A promotion locks the path it fills while it allocates, so making room in the pool never
  demotes or drops what it is loading.
- Device residency stays prefix-closed: host spans are promoted top down, stopping at the first
  that does not fit, and disk pages are loaded only below a match that is all on the device.
- A `TierMatch`'s `node` covers exactly its `slots`, and `device + host + disk == len(slots)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sglite.runtime.cache.tree_node import TreeNode

if TYPE_CHECKING:
    from sglite.runtime.cache.radix_cache import MatchResult
    from sglite.runtime.cache.tiered_cache import TieredRadixCache


@dataclass
class TierMatch:
    """A prefix made ready on the device: `slots`/`node` as in `MatchResult` (all on the device
    now), and where its tokens came from (`device + host + disk == len(slots)`)."""

    slots: list[int]
    node: TreeNode
    device: int = 0
    host: int = 0
    disk: int = 0

    def details(self) -> dict[str, int]:
        """The split reported as `meta_info.cached_tokens_details`."""
        return {"device": self.device, "host": self.host, "disk": self.disk}


def promote_prefix(cache: TieredRadixCache, ids: Sequence[int]) -> TierMatch:
    """Match `ids` and bring the matched span onto the device: host spans first, then disk
    pages past the tree. Each tier's span is loaded only if that beats recomputing it and
    there is pool room; the result is what the caller can lock and use."""
    ids = ids if isinstance(ids, list) else list(ids)
    match = cache.match_prefix(ids)
    found = TierMatch(slots=list(match.slots), node=match.node, device=len(match.slots))
    if match.host_len:
        if _worth_loading(cache, "host", match.host_len):
            _promote_host(cache, match, found)
        else:
            cache.tier_stats["host"].skipped_loads += 1
    if cache.disk is not None and found.node is match.last_node and len(found.slots) < len(ids):
        _promote_disk(cache, ids, found)
    return found


def _worth_loading(cache: TieredRadixCache, tier: str, tokens: int) -> bool:
    if cache.config.load_policy != "auto":
        return cache.config.load_policy == "always"
    return cache.costs.should_load(tier, tokens)


def _promote_host(cache: TieredRadixCache, match: MatchResult, found: TierMatch) -> None:
    """Copy the host-only nodes of `match` into the pool, top down, while room lasts."""
    path: list[TreeNode] = []
    walk = match.last_node
    while walk is not match.node:
        path.append(walk)
        walk = walk.parent
    cache.lock(match.last_node)  # nothing on the path may be demoted or dropped meanwhile
    try:
        for node in reversed(path):
            n = len(node.key)
            if cache.pool.num_free + cache.evictable_size() < n:
                break
            device_slots = _alloc_device(cache, n)
            cache.io.from_host(node.host_slots, device_slots)
            node.slots = device_slots
            cache._protected += n  # locked by this promotion until the unlock below
            cache._refresh(node)
            cache._refresh(node.parent)
            found.slots.extend(device_slots)
            found.host += n
            found.node = node
    finally:
        cache.unlock(match.last_node)


def _promote_disk(cache: TieredRadixCache, ids: list[int], found: TierMatch) -> None:
    """Load the disk pages that continue the device match, then insert them into the tree."""
    assert cache.disk is not None
    size = cache.disk.page_size
    start = len(found.slots)
    hashes = cache.disk.page_hashes(ids)
    first = start // size
    count = 0
    while first + count < len(hashes) and cache.disk.has(hashes[first + count]):
        count += 1
    if not count:
        return
    if not _worth_loading(cache, "disk", (first + count) * size - start):
        cache.tier_stats["disk"].skipped_loads += 1
        return
    cache.lock(found.node)
    try:
        room = cache.pool.num_free + cache.evictable_size()
        while count and (first + count) * size - start > room:
            count -= 1
        if not count:
            return
        device_slots = _alloc_device(cache, (first + count) * size - start)
        loaded = cache.io.load_pages(ids, hashes, first, count, start, device_slots)
    finally:
        cache.unlock(found.node)
    cache.pool.free(device_slots[loaded:])
    if not loaded:
        return
    end = start + loaded
    cache.insert(ids[:end], found.slots + device_slots[:loaded])
    found.node = cache.match_prefix(ids[:end]).node
    found.slots.extend(device_slots[:loaded])
    found.disk = loaded


def _alloc_device(cache: TieredRadixCache, n: int) -> list[int]:
    if cache.pool.num_free < n:
        cache.evict(n - cache.pool.num_free)
    return cache.pool.alloc(n)
