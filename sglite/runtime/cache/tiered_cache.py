"""The radix cache over a memory hierarchy: device pool, host tier and disk pages (HiCache).

A node's span can be on the device (`slots`), in the host tier (`host_slots`), or both. Evicting
from the pool demotes a span to the host tier instead of forgetting it (write-back), or only
drops the device copy when one was written through at insert. When the host tier is full its
least valuable spans leave the tree, written to the disk tier as pages. `load_prefix` promotes
what a request matches back into the pool before its extend: host spans by copy, then further
tokens from disk pages found by their content hash (which also serves the pages a previous run
left behind). Each load happens only if it beats recomputing (`TierCostModel`).

This module keeps the tree and its tier bookkeeping: match and insert across tiers, locks, the
eviction candidate sets, sizes and counters. Deciding what leaves a tier is in tier_eviction.py,
loading spans back onto the device in tier_promotion.py, writing disk pages in tier_persist.py.

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

from collections.abc import Sequence

from sglite.runtime.cache.cost_model import TierCostModel
from sglite.runtime.cache.disk_store import DiskKVStore
from sglite.runtime.cache.host_pool import HostKVPool
from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.cache.radix_cache import MatchResult, RadixCache
from sglite.runtime.cache.tier_check import check_tiers
from sglite.runtime.cache.tier_config import TIERS, HiCacheConfig, TierStats
from sglite.runtime.cache.tier_eviction import evict_device, host_alloc
from sglite.runtime.cache.tier_io import TierIO
from sglite.runtime.cache.tier_persist import persist_pages
from sglite.runtime.cache.tier_promotion import TierMatch, promote_prefix
from sglite.runtime.cache.tree_node import TreeNode, _common_prefix_len, split_node


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
                child = split_node(child, n)
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
                child = split_node(child, n)
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
        """Match `ids` and bring the matched span onto the device (tier_promotion.py)."""
        return promote_prefix(self, ids)

    def record_hits(self, node: TreeNode, split: dict[str, int]) -> None:
        """Count one admission: per-tier hit tokens, and a hit on every node of its prefix."""
        for tier, tokens in split.items():
            self.tier_stats[tier].hit_tokens += tokens
        for path_node in self._path_to_root(node):
            path_node.hit_count += 1

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
        (or dropping them, written to disk, when there is none or it cannot take them); the
        choice of victims is in tier_eviction.py."""
        return evict_device(self, num_tokens)

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

    # ------------------------------------------------------------------ write-through / disk
    def _write_through(self, node: TreeNode) -> None:
        """Copy a span that just reached the device to the lower tiers."""
        if self.host is not None and node.host_slots is None:
            # Free host room only: evicting to make room for a span that is on the device
            # anyway would trade a copy that saves a recompute for one that saves a copy.
            host_slots = host_alloc(self, len(node.slots), make_room=False)
            if host_slots is not None:
                self.io.to_host(node.slots, host_slots)
                node.host_slots = host_slots
                self._refresh(node)
        self._persist(node)

    def _persist(self, node: TreeNode) -> None:
        """Write the disk pages that end inside `node`'s span (tier_persist.py)."""
        if self.disk is not None:
            persist_pages(self.disk, self.io, self._path_to_root(node)[::-1])

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
