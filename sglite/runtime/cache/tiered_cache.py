"""The radix cache over a memory hierarchy: device pool, host tier and disk pages (HiCache).

A node's span can be on the device (`slots`), in the host tier (`host_slots`), or both. Evicting
from the pool demotes a span to the host tier instead of forgetting it (write-back), or only
drops the device copy when one was written through at insert. When the host tier is full its
least valuable spans leave the tree, written to the disk tier as pages. `load_prefix` promotes
what a request matches back into the pool before its extend: host spans by copy, then further
tokens from disk pages found by their content hash (which also serves the pages a previous run
left behind). Each load happens only if it beats recomputing (`TierCostModel`).

Slot ownership is the plain cache's (radix_cache.py): `insert` returns `n`, the tokens already
cached ON THE DEVICE, and takes `slots[n:]`; host-only nodes on the inserted path adopt the
caller's slots (the host copy is refreshed from them so both copies agree).

Invariants added to the plain cache's (verified by `check_invariants`, see tier_check.py):
- Every node holds its span in at least one tier; `slots` is `[]` or one slot per token, and so
  is `host_slots` (or None).
- Device residency is prefix-closed: a node on the device has its parent on the device, so a
  match is device tokens then host-only tokens, never interleaved.
- Host slots: each owned by one node, none free; `host.used` equals their number.
- A node with both copies holds the same K/V in both (within quantization error if quantized).
- `lock_ref` also protects host-only nodes (a promotion locks its path while it allocates).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from sglite.runtime.cache.cost_model import TierCostModel
from sglite.runtime.cache.disk_store import DiskKVStore
from sglite.runtime.cache.host_pool import HostKVPool
from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.cache.radix_cache import MatchResult, RadixCache, TreeNode, _common_prefix_len
from sglite.runtime.cache.tier_check import check_tiers
from sglite.runtime.cache.tier_config import TIERS, HiCacheConfig, TierStats
from sglite.runtime.cache.tier_io import TierIO


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


class TieredRadixCache(RadixCache):
    """RadixCache whose spans also live in a host tier and disk pages (module docstring)."""

    def __init__(
        self,
        pool: KVPool,
        config: HiCacheConfig,
        host: HostKVPool | None,
        disk: DiskKVStore | None,
        costs: TierCostModel,
    ) -> None:
        super().__init__(pool)
        self.config = config
        self.host = host
        self.disk = disk
        self.costs = costs
        self.tier_stats = {tier: TierStats() for tier in TIERS}
        self.io = TierIO(pool, host, disk, costs, self.tier_stats)
        # Host-only, unlocked, childless nodes: what host eviction may take.
        self._host_leaves: set[TreeNode] = set()
        self._aging = 0.0  # benefit policy: priority of the last victim (GDSF aging)

    # ------------------------------------------------------------------ lookup / insert
    def match_prefix(self, ids: Sequence[int]) -> MatchResult:
        """Longest cached prefix in any tier; `slots`/`node` cover its device part, `host_len`
        tokens follow in host-only nodes down to `last_node`. Moves no data."""
        ids = ids if isinstance(ids, list) else list(ids)
        now = self._tick()
        node = device_node = self.root
        node.last_access = now
        slots: list[int] = []
        pos = host_len = 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = _common_prefix_len(child.key, ids, pos)
            partial = n < len(child.key)
            if partial:
                child = self._split(child, n)
            child.last_access = now
            if child.slots:
                slots.extend(child.slots)
                device_node = child
            else:
                host_len += n
            node = child
            pos += n
            if partial:
                break
        return MatchResult(slots=slots, node=device_node, last_node=node, host_len=host_len)

    def insert(self, ids: Sequence[int], slots: Sequence[int]) -> int:
        """Add `ids` with KV in `slots`; returns the tokens already cached on the device (the
        tree takes `slots[n:]`, adopting them for host-only nodes on the path too)."""
        if len(ids) != len(slots):
            raise ValueError(f"insert: {len(ids)} ids but {len(slots)} slots")
        ids = ids if isinstance(ids, list) else list(ids)
        now = self._tick()
        node = self.root
        node.last_access = now
        pos = 0
        device_len: int | None = None
        gained: list[TreeNode] = []  # nodes that took the caller's slots
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                device_len = pos if device_len is None else device_len
                gained.append(self._new_leaf(node, ids[pos:], list(slots[pos:]), now))
                pos = len(ids)
                break
            n = _common_prefix_len(child.key, ids, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            if not child.slots:
                device_len = pos if device_len is None else device_len
                self._adopt(child, list(slots[pos : pos + n]))
                gained.append(child)
            node = child
            pos += n
        device_len = len(ids) if device_len is None else device_len
        self.stats.inserted_tokens += len(ids) - device_len
        if self.config.write_policy == "write_through":
            for gained_node in gained:
                self._write_through(gained_node)
        return device_len

    # ------------------------------------------------------------------ promotion
    def load_prefix(self, ids: Sequence[int]) -> TierMatch:
        """Match `ids` and bring the matched span onto the device: host spans first, then disk
        pages past the tree. Each tier's span is loaded only if that beats recomputing it and
        there is pool room; the result is what the caller can lock and use."""
        ids = ids if isinstance(ids, list) else list(ids)
        match = self.match_prefix(ids)
        found = TierMatch(slots=list(match.slots), node=match.node, device=len(match.slots))
        if match.host_len:
            if self._worth_loading("host", match.host_len):
                self._promote_host(match, found)
            else:
                self.tier_stats["host"].skipped_loads += 1
        if self.disk is not None and found.node is match.last_node and len(found.slots) < len(ids):
            self._promote_disk(ids, found)
        return found

    def record_hits(self, node: TreeNode, split: dict[str, int]) -> None:
        """Count one admission: per-tier hit tokens, and a hit on every node of its prefix."""
        for tier, tokens in split.items():
            self.tier_stats[tier].hit_tokens += tokens
        for path_node in self._path_to_root(node):
            path_node.hit_count += 1

    def _worth_loading(self, tier: str, tokens: int) -> bool:
        if self.config.load_policy != "auto":
            return self.config.load_policy == "always"
        return self.costs.should_load(tier, tokens)

    def _promote_host(self, match: MatchResult, found: TierMatch) -> None:
        """Copy the host-only nodes of `match` into the pool, top down, while room lasts."""
        path: list[TreeNode] = []
        walk = match.last_node
        while walk is not match.node:
            path.append(walk)
            walk = walk.parent
        self.lock(match.last_node)  # nothing on the path may be demoted or dropped meanwhile
        try:
            for node in reversed(path):
                n = len(node.key)
                if self.pool.num_free + self.evictable_size() < n:
                    break
                device_slots = self._alloc_device(n)
                self.io.from_host(node.host_slots, device_slots)
                node.slots = device_slots
                self._protected += n  # locked by this promotion until the unlock below
                self._refresh(node)
                self._refresh(node.parent)
                found.slots.extend(device_slots)
                found.host += n
                found.node = node
        finally:
            self.unlock(match.last_node)

    def _promote_disk(self, ids: list[int], found: TierMatch) -> None:
        """Load the disk pages that continue the device match, then insert them into the tree."""
        assert self.disk is not None
        size = self.disk.page_size
        start = len(found.slots)
        hashes = self.disk.page_hashes(ids)
        first = start // size
        count = 0
        while first + count < len(hashes) and self.disk.has(hashes[first + count]):
            count += 1
        if not count:
            return
        if not self._worth_loading("disk", (first + count) * size - start):
            self.tier_stats["disk"].skipped_loads += 1
            return
        self.lock(found.node)
        try:
            room = self.pool.num_free + self.evictable_size()
            while count and (first + count) * size - start > room:
                count -= 1
            if not count:
                return
            device_slots = self._alloc_device((first + count) * size - start)
            loaded = self.io.load_pages(ids, hashes, first, count, start, device_slots)
        finally:
            self.unlock(found.node)
        self.pool.free(device_slots[loaded:])
        if not loaded:
            return
        end = start + loaded
        self.insert(ids[:end], found.slots + device_slots[:loaded])
        found.node = self.match_prefix(ids[:end]).node
        found.slots.extend(device_slots[:loaded])
        found.disk = loaded

    # ------------------------------------------------------------------ locking
    def lock(self, node: TreeNode) -> None:
        """As RadixCache.lock; every node on the path may change evictability here."""
        super().lock(node)
        for path_node in self._path_to_root(node):
            self._refresh(path_node)

    def unlock(self, node: TreeNode) -> None:
        """As RadixCache.unlock."""
        super().unlock(node)
        for path_node in self._path_to_root(node):
            self._refresh(path_node)

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device slots if possible, demoting spans to the host tier
        (or dropping them, written to disk, when there is none or it cannot take them)."""
        if num_tokens <= 0:
            return 0
        heap = [(self._priority(n, "device"), n.serial, n) for n in self._evictable_leaves]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            key, _, node = heapq.heappop(heap)
            if node.parent is None or not self._is_evictable_leaf(node):
                continue  # dropped or changed by an earlier demotion in this loop
            parent = node.parent
            self._aging = max(self._aging, key) if self.config.eviction_policy == "benefit" else 0
            freed += self._demote(node)
            if parent is not self.root and self._is_evictable_leaf(parent):
                heapq.heappush(heap, (self._priority(parent, "device"), parent.serial, parent))
        self.stats.evicted_tokens += freed
        self.tier_stats["device"].evicted_tokens += freed
        return freed

    def _demote(self, node: TreeNode) -> int:
        """Take `node` (an evictable device leaf) off the device; returns the slots freed."""
        n = len(node.slots)
        host = self.tier_stats["host"]
        if node.host_slots is None and self.host is not None:
            host_slots = self._host_alloc(n)
            if host_slots is not None:
                self.io.to_host(node.slots, host_slots)
                node.host_slots = host_slots
        if node.host_slots is None:
            self._drop_subtree(node)  # no tier can keep it: it (and its tail) leaves the tree
            return n
        host.demotions += 1
        self.pool.free(node.slots)
        node.slots = []
        self._evictable -= n
        self._refresh(node)
        self._refresh(node.parent)
        return n

    def _host_alloc(self, n: int, make_room: bool = True) -> list[int] | None:
        """`n` host slots, or None. With `make_room`, host-only leaves leave the tree (to disk)
        first, then host copies of spans that are also on the device are dropped."""
        assert self.host is not None
        if n > self.host.capacity:
            return None
        if self.host.num_free < n and make_room:
            self._evict_host(n - self.host.num_free)
            if self.host.num_free < n:
                self._drop_host_copies(n - self.host.num_free)
        return self.host.alloc(n)

    def _drop_host_copies(self, num_tokens: int) -> None:
        """Free host copies of spans that are on the device too (lowest priority first): they
        only save a copy at eviction time, while a demoted span has no other fast copy."""
        assert self.host is not None
        copies = [n for n in self._iter_nodes() if n.slots and n.host_slots is not None]
        copies.sort(key=lambda n: (self._priority(n, "host"), n.serial))
        freed = 0
        for node in copies:
            if freed >= num_tokens:
                break
            self.host.free(node.host_slots)
            freed += len(node.host_slots)
            self.tier_stats["host"].evicted_tokens += len(node.host_slots)
            node.host_slots = None
            self._refresh(node)

    def _evict_host(self, num_tokens: int) -> None:
        """Drop host-only leaves (lowest priority first) until `num_tokens` host slots are free."""
        heap = [(self._priority(n, "host"), n.serial, n) for n in self._host_leaves]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if node not in self._host_leaves:
                continue
            parent = node.parent
            freed += len(node.key)
            self._retire(node)
            if parent in self._host_leaves:
                heapq.heappush(heap, (self._priority(parent, "host"), parent.serial, parent))

    def _drop_subtree(self, node: TreeNode) -> None:
        """Remove `node` and its descendants (children first), persisting their pages."""
        order: list[TreeNode] = []
        stack = [node]
        while stack:
            walk = stack.pop()
            order.append(walk)
            stack.extend(walk.children.values())
        for walk in reversed(order):  # every node is a leaf when its turn comes
            self._retire(walk)

    def _retire(self, node: TreeNode) -> None:
        """Remove an unlocked leaf from the tree, after writing its pages to the disk tier."""
        assert not node.children and node.lock_ref == 0
        self._persist(node)
        parent = node.parent
        assert parent is not None
        if node.slots:
            self.pool.free(node.slots)
            self._evictable -= len(node.slots)
        if node.host_slots is not None:
            assert self.host is not None
            self.host.free(node.host_slots)
            self.tier_stats["host"].evicted_tokens += len(node.host_slots)
        del parent.children[node.key[0]]
        node.parent = None
        self._evictable_leaves.discard(node)
        self._host_leaves.discard(node)
        self._refresh(parent)

    def _priority(self, node: TreeNode, tier: str) -> float:
        """Eviction order within a tier: lowest first. LRU, or expected benefit (GDSF): hits
        times what a token costs to restore from the tier below, plus an aging term."""
        if self.config.eviction_policy == "lru":
            return node.last_access
        if tier == "device":
            backed = "host" if self.host is not None else ("disk" if self.disk else None)
        else:
            backed = "disk" if self.disk is not None else None
        return self._aging + (node.hit_count + 1) * self.costs.miss_cost_per_token(backed)

    # ------------------------------------------------------------------ write-through / disk
    def _write_through(self, node: TreeNode) -> None:
        """Copy a span that just reached the device to the lower tiers."""
        if self.host is not None and node.host_slots is None:
            # Free host room only: evicting to make room for a span that is on the device
            # anyway would trade a copy that saves a recompute for one that saves a copy.
            host_slots = self._host_alloc(len(node.slots), make_room=False)
            if host_slots is not None:
                self.io.to_host(node.slots, host_slots)
                node.host_slots = host_slots
                self._refresh(node)
        self._persist(node)

    def _persist(self, node: TreeNode) -> None:
        """Write the disk pages that end inside `node`'s span (pages ending higher up belong to
        an ancestor; a trailing partial page is not stored)."""
        if self.disk is None:
            return
        size = self.disk.page_size
        path = self._path_to_root(node)[::-1]
        end = sum(len(p.key) for p in path)
        begin = end - len(node.key)
        page_ends = range((begin // size + 1) * size, end + 1, size)
        if not page_ends:
            return
        ids = [t for p in path for t in p.key]
        hashes = self.disk.page_hashes(ids[: page_ends[-1]])
        missing = [e for e in page_ends if not self.disk.has(hashes[e // size - 1])]
        if not missing:
            return
        # One gather for every missing page (per-layer copies cost per call, not per token).
        lo, hi = missing[0] - size, missing[-1]
        kv = self.io.gather(_segments(path, lo, hi))
        for page_end in missing:
            page = kv[:, :, page_end - size - lo : page_end - lo]
            tokens = ids[page_end - size : page_end]
            if not self.io.write_page(hashes[page_end // size - 1], tokens, page):
                return

    # ------------------------------------------------------------------ flush / sizes / checks
    def flush(self) -> None:
        """Empty the device and host tiers (disk pages stay: they are valid for this model)."""
        if self._protected > 0:
            raise RuntimeError("cannot flush the radix cache while nodes are locked")
        if self.host is not None:
            for node in self._iter_nodes():
                if node.host_slots is not None:
                    self.host.free(node.host_slots)
                    node.host_slots = None
        self._host_leaves.clear()
        super().flush()

    def host_size(self) -> int:
        """Tokens held in the host tier."""
        return self.host.used if self.host is not None else 0

    def tier_info(self) -> dict[str, dict]:
        """Per-tier sizes and counters, for get_server_info and /metrics."""
        info: dict[str, dict] = {
            "device": {"tokens": self.total_size(), **self.tier_stats["device"].as_dict()}
        }
        if self.host is not None:
            info["host"] = {
                "tokens": self.host.used,
                "capacity_tokens": self.host.capacity,
                "bytes": self.host.used * self.host.bytes_per_token(),
                "quantized": self.host.quantize,
                **self.tier_stats["host"].as_dict(),
            }
        if self.disk is not None:
            stats = self.disk.stats
            info["disk"] = {
                "pages": self.disk.num_pages,
                "tokens": self.disk.num_pages * self.disk.page_size,
                "bytes": self.disk.num_bytes,
                "pages_written": stats.pages_written,
                "pages_read": stats.pages_read,
                "corrupt_pages": stats.corrupt_pages,
                **self.tier_stats["disk"].as_dict(),
            }
        return info

    def check_invariants(self, check_data: bool = True) -> None:
        """The plain cache's invariants plus the tiers' (see tier_check.py)."""
        super().check_invariants()
        check_tiers(self, check_data)

    # ------------------------------------------------------------------ internals
    def _check_node_spans(self, node: TreeNode) -> None:
        assert len(node.slots) in (0, len(node.key)), (
            f"node {node.key[:8]} has {len(node.slots)} device slots for {len(node.key)} tokens"
        )

    def _is_host_leaf(self, node: TreeNode) -> bool:
        return (
            node is not self.root
            and not node.slots
            and node.host_slots is not None
            and not node.children
            and node.lock_ref == 0
        )

    def _refresh(self, node: TreeNode | None) -> None:
        """Recompute `node`'s membership in both eviction candidate sets."""
        if node is None or node is self.root:
            return
        self._refresh_leaf(node)
        if self._is_host_leaf(node):
            self._host_leaves.add(node)
        else:
            self._host_leaves.discard(node)

    def _new_leaf(self, parent: TreeNode, key: list[int], slots: list[int], now: int) -> TreeNode:
        leaf = TreeNode(key=key, slots=slots, parent=parent, last_access=now)
        parent.children[key[0]] = leaf
        self._evictable += len(slots)
        self._refresh(leaf)
        self._refresh(parent)
        return leaf

    def _adopt(self, node: TreeNode, slots: list[int]) -> None:
        """A host-only node takes the caller's device slots; its host copy is refreshed from
        them, because a recomputed span can differ from the stored one in its last bits."""
        node.slots = slots
        if node.lock_ref > 0:
            self._protected += len(slots)
        else:
            self._evictable += len(slots)
        if node.host_slots is not None:
            self.io.to_host(slots, node.host_slots)
        self._refresh(node)
        self._refresh(node.parent)

    def _alloc_device(self, n: int) -> list[int]:
        if self.pool.num_free < n:
            self.evict(n - self.pool.num_free)
        return self.pool.alloc(n)


def _segments(path: list[TreeNode], start: int, end: int) -> list[tuple[TreeNode, int, int]]:
    """The (node, lo, hi) pieces of positions [start, end) along a root-to-node path."""
    out = []
    offset = 0
    for node in path:
        lo, hi = max(start, offset), min(end, offset + len(node.key))
        if lo < hi:
            out.append((node, lo - offset, hi - offset))
        offset += len(node.key)
    return out
