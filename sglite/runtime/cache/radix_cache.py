"""RadixAttention's prefix cache: a radix tree of token ids whose nodes own KV pool slots.

Each non-root node (`TreeNode`, tree_node.py) holds `key` (the token ids on the edge into it) and
`slots` (the KV pool slot of each of those tokens, page size 1). The path from the root to a node
spells a token prefix, and the concatenated `slots` along that path are the KV entries of exactly
that prefix, so any request whose prompt starts with the prefix can attend over those slots
instead of recomputing them.

Slot ownership contract (the part callers most often get wrong):
- The tree owns every slot stored in it; it frees slots only in `evict` and `flush`.
- `insert(ids, slots)` returns `n`, the number of leading tokens of `ids` that were ALREADY in the
  tree. The tree takes ownership of `slots[n:]` and of nothing else. It never frees anything.
- The caller still owns `slots[:n]`. A request that matched (and locked) a cached prefix of length
  `m` built `slots[:m]` from the tree's own slots, so it must free exactly its private duplicates
  `slots[m:n]` (an empty range when `n <= m`) and then re-read the tree's slots with
  `match_prefix` if it keeps running.
- Hence, at any time: `pool.num_free + total_size() + slots held privately by requests ==
  pool.capacity`.

Invariants (verified by `check_invariants`, see radix_check.py):
- The root has an empty key and is never locked or evicted; every other node has a non-empty key
  and `len(key) == len(slots)`; `parent.children[child.key[0]] is child`.
- No slot appears twice in the tree and no tree slot is in the pool's free list.
- `lock_ref(node) >= sum(lock_ref(child) for child in children)`: a lock on a node also counts on
  every ancestor, so a locked node's whole path is protected from eviction.
- `evictable_size() + protected_size() == total_size()`, where protected means `lock_ref > 0`.
- `parent.last_access >= child.last_access`, so evicting leaves in LRU order and then their
  parents as they become leaves never frees a more recently used node before an older one.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.cache.radix_check import check_radix_tree
from sglite.runtime.cache.tree_node import TreeNode, _common_prefix_len, split_node


@dataclass
class MatchResult:
    """Result of `RadixCache.match_prefix`.

    `slots` are the KV slots of the matched prefix (owned by the tree; valid while `node` is locked
    or until the next eviction). `node` is the deepest matched node, covering exactly the matched
    prefix; it is the root when nothing matched.

    The tiered cache also matches spans that are off the device: `slots`/`node` then cover the
    device part only, and `host_len` more tokens follow in host-only nodes down to `last_node`
    (`last_node is node` and `host_len == 0` in the plain cache).
    """

    slots: list[int]
    node: TreeNode
    last_node: TreeNode | None = None
    host_len: int = 0

    def __post_init__(self) -> None:
        if self.last_node is None:
            self.last_node = self.node


@dataclass
class CacheStats:
    """Cumulative counters. Queries are recorded by the scheduler, not by `match_prefix`."""

    matched_tokens: int = 0
    queried_tokens: int = 0
    inserted_tokens: int = 0
    evicted_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of queried prompt tokens that were served from the cache."""
        return self.matched_tokens / self.queried_tokens if self.queried_tokens else 0.0


class RadixCache:
    """A radix tree of token prefixes owning KV pool slots; see the module docstring."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.root = TreeNode()
        self.stats = CacheStats()
        self._clock = itertools.count(1)
        self._evictable = 0
        self._protected = 0
        # Unlocked non-root leaves, maintained incrementally so `evict` need not walk the tree.
        self._evictable_leaves: set[TreeNode] = set()

    # ------------------------------------------------------------------ lookup / insert
    def match_prefix(self, ids: Sequence[int]) -> MatchResult:
        """Find the longest cached prefix of `ids`.

        Splits a node when the match ends inside its key, so the returned node covers exactly the
        matched prefix, and refreshes `last_access` along the matched path. The length is not
        limited: a caller that must compute the last token passes `ids[: len(ids) - 1]`. Does not
        touch `stats` (the scheduler also calls this to probe); use `record_query` for that.
        """
        ids = ids if isinstance(ids, list) else list(ids)
        now = self._tick()
        node = self.root
        node.last_access = now
        slots: list[int] = []
        pos = 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = _common_prefix_len(child.key, ids, pos)
            partial = n < len(child.key)
            if partial:
                child = split_node(child, n)
            child.last_access = now
            child.hit_count += 1
            slots.extend(child.slots)
            node = child
            pos += n
            if partial:
                break
        return MatchResult(slots=slots, node=node)

    def insert(self, ids: Sequence[int], slots: Sequence[int]) -> int:
        """Add the sequence `ids` whose KV entries live in `slots` (one slot per token).

        Returns `n`, the number of leading tokens that were ALREADY cached. The tree takes
        ownership of `slots[n:]` only and never frees anything here: the caller frees its own
        duplicates in `slots[own_start:n]`, where `own_start` is where its private slots begin
        (its matched prefix length). Refreshes `last_access` along the path, splitting a node
        where `ids` diverges from or ends inside its key, like `match_prefix`.
        """
        if len(ids) != len(slots):
            raise ValueError(f"insert: {len(ids)} ids but {len(slots)} slots")
        ids = ids if isinstance(ids, list) else list(ids)
        now = self._tick()
        node = self.root
        node.last_access = now
        pos = 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                self._add_leaf(node, ids[pos:], list(slots[pos:]), now)
                self.stats.inserted_tokens += len(ids) - pos
                return pos
            n = _common_prefix_len(child.key, ids, pos)
            if n < len(child.key):
                # Also when `ids` ends inside this edge: splitting keeps `last_access` exact per
                # token (the untouched tail keeps its older time) and the next loop step then
                # either stops or hangs the new tail off the split point.
                child = split_node(child, n)
            child.last_access = now
            node = child
            pos += n
        return pos

    def record_query(self, queried: int, matched: int) -> None:
        """Count one request admission: `queried` prompt tokens, of which `matched` were cached."""
        if not 0 <= matched <= queried:
            raise ValueError(f"record_query: matched={matched} outside [0, queried={queried}]")
        self.stats.queried_tokens += queried
        self.stats.matched_tokens += matched

    # ------------------------------------------------------------------ locking
    def lock(self, node: TreeNode) -> None:
        """Protect `node` and all its ancestors from eviction (reference counted).

        Locking the root is a no-op, so callers may lock whatever `match_prefix` returned.
        """
        path = self._path_to_root(node)
        for n in path:
            if n.lock_ref == 0:
                self._evictable -= len(n.slots)
                self._protected += len(n.slots)
            n.lock_ref += 1
        if path:
            self._refresh_leaf(path[0])

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`. Raises RuntimeError (changing nothing) if `node` is not locked."""
        path = self._path_to_root(node)
        # Ancestors' counts are >= node's (invariant), so checking the node alone suffices.
        if path and path[0].lock_ref <= 0:
            raise RuntimeError("unlock of a node that is not locked")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._protected -= len(n.slots)
                self._evictable += len(n.slots)
        if path:
            self._refresh_leaf(path[0])

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots if possible; returns how many were freed.

        Whole nodes are freed, so the result can exceed `num_tokens`; it is smaller only when
        everything evictable has been freed. Victims are unlocked leaves in LRU order, and parents
        join the candidates as their last child goes.
        """
        if num_tokens <= 0:
            return 0
        seq = itertools.count()  # tie-breaker so the heap never compares nodes
        heap = [(n.last_access, next(seq), n) for n in self._evictable_leaves]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            self.pool.free(node.slots)
            freed += len(node.slots)
            self._evictable -= len(node.slots)
            self._evictable_leaves.discard(node)
            del parent.children[node.key[0]]
            node.parent = None  # detached: lock() on it now fails loudly
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                self._evictable_leaves.add(parent)
                heapq.heappush(heap, (parent.last_access, next(seq), parent))
        self.stats.evicted_tokens += freed
        return freed

    def flush(self) -> None:
        """Free every slot in the tree. Raises RuntimeError if any node is locked."""
        # Non-root keys are non-empty, so any locked node makes protected_size positive.
        if self._protected > 0:
            raise RuntimeError("cannot flush the radix cache while nodes are locked")
        self.pool.free(self.owned_slots())
        for node in self._iter_nodes():
            node.parent = None
        self.root.children = {}
        self._evictable = 0
        self._evictable_leaves.clear()

    # ------------------------------------------------------------------ sizes
    def evictable_size(self) -> int:
        """Slots in unlocked nodes (what `evict` could free now)."""
        return self._evictable

    def protected_size(self) -> int:
        """Slots in locked nodes."""
        return self._protected

    def total_size(self) -> int:
        """All slots owned by the tree."""
        return self._evictable + self._protected

    # ------------------------------------------------------------------ debugging / checks
    def owned_slots(self) -> list[int]:
        """Every slot the tree owns (walks the tree; for tests and invariant checks)."""
        out: list[int] = []
        for node in self._iter_nodes():
            out.extend(node.slots)
        return out

    def check_invariants(self) -> None:
        """Verify the module-level invariants; raises AssertionError naming the first violation."""
        check_radix_tree(self)

    def pretty(self) -> str:
        """A multi-line indented rendering of the tree, for debugging."""
        lines = [
            f"<root> total={self.total_size()} evictable={self._evictable} "
            f"protected={self._protected}"
        ]
        # Children are pushed in reverse token order so they print in ascending order.
        stack: list[tuple[TreeNode, int]] = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            kids = sorted(node.children.values(), key=lambda c: c.key[0], reverse=True)
            stack.extend((c, depth + 1) for c in kids)
            if node is self.root:
                continue
            key = " ".join(map(str, node.key[:12])) + (" ..." if len(node.key) > 12 else "")
            slots = " ".join(map(str, node.slots[:12])) + (" ..." if len(node.slots) > 12 else "")
            lines.append(
                f"{'  ' * depth}[{key}] len={len(node.key)} slots=[{slots}] "
                f"lock={node.lock_ref} t={node.last_access:g} hits={node.hit_count}"
            )
        return "\n".join(lines)

    # ------------------------------------------------------------------ internals
    def _tick(self) -> int:
        return next(self._clock)

    def _iter_nodes(self) -> Iterator[TreeNode]:
        """All non-root nodes, parents before children; iterative (trees can be very deep)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _path_to_root(self, node: TreeNode) -> list[TreeNode]:
        """`node` and its ancestors, excluding the root. Raises if `node` is not in this tree."""
        path: list[TreeNode] = []
        walk = node
        while walk is not self.root:
            if walk.parent is None:
                raise ValueError("node is not in this radix tree (evicted or flushed?)")
            path.append(walk)
            walk = walk.parent
        return path

    def _check_node_spans(self, node: TreeNode) -> None:
        """Per-node span check of `check_invariants` (the tiered cache allows host-only nodes)."""
        assert len(node.key) == len(node.slots), (
            f"key/slots length mismatch {len(node.key)} != {len(node.slots)} at {node.key[:8]}"
        )

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        """Whether `evict` may take `node` now: unlocked, on the device, no child on the device
        (in the plain cache every node is on the device, so: an unlocked leaf)."""
        if node is self.root or node.lock_ref != 0 or not node.slots:
            return False
        return not any(child.slots for child in node.children.values())

    def _refresh_leaf(self, node: TreeNode) -> None:
        if self._is_evictable_leaf(node):
            self._evictable_leaves.add(node)
        else:
            self._evictable_leaves.discard(node)

    def _add_leaf(self, parent: TreeNode, key: list[int], slots: list[int], now: int) -> None:
        leaf = TreeNode(key=key, slots=slots, parent=parent, last_access=now)
        parent.children[key[0]] = leaf
        self._evictable += len(slots)
        self._evictable_leaves.add(leaf)
        self._evictable_leaves.discard(parent)
