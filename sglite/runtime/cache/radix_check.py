"""Invariant checks of the plain radix tree: the rules listed in radix_cache.py's docstring.

Kept apart from the cache so the checks read as a list of the rules they enforce. They recompute
the cache's incremental bookkeeping (`_evictable`, `_protected`, `_evictable_leaves`) from the
tree and compare, so they read those private fields on purpose. The tiered cache runs these, then
its own (tier_check.py); its per-node span rule comes in through `cache._check_node_spans`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglite.runtime.cache.radix_cache import RadixCache
    from sglite.runtime.cache.tree_node import TreeNode


def check_radix_tree(cache: RadixCache) -> None:
    """Raise AssertionError naming the first broken invariant of `cache`'s tree."""
    root = cache.root
    assert not root.key and not root.slots, "root must have an empty key"
    assert root.parent is None, "root must have no parent"
    assert root.lock_ref == 0, f"root lock_ref is {root.lock_ref}, must stay 0"
    seen: set[int] = set()
    evictable = protected = 0
    leaves: set[TreeNode] = set()
    for node in cache._iter_nodes():
        assert node.key, "non-root node with an empty key"
        cache._check_node_spans(node)
        parent = node.parent
        assert parent is not None, f"node {node.key[:8]} has no parent"
        assert parent.children.get(node.key[0]) is node, (
            f"node {node.key[:8]} is not its parent's child under its first token"
        )
        assert node.lock_ref >= 0, f"negative lock_ref at {node.key[:8]}"
        child_locks = sum(c.lock_ref for c in node.children.values())
        assert node.lock_ref >= child_locks, (
            f"lock_ref {node.lock_ref} < children's total {child_locks} at {node.key[:8]}"
        )
        assert node.last_access <= parent.last_access, (
            f"child {node.key[:8]} accessed more recently than its parent"
        )
        dup = seen.intersection(node.slots)
        assert not dup and len(set(node.slots)) == len(node.slots), (
            f"slots {sorted(dup)[:8] or node.slots[:8]} appear twice in the tree"
        )
        seen.update(node.slots)
        if node.lock_ref > 0:
            protected += len(node.slots)
        else:
            evictable += len(node.slots)
            if cache._is_evictable_leaf(node):
                leaves.add(node)
    assert 0 not in seen, "reserved slot 0 is in the tree"
    assert all(1 <= s <= cache.pool.capacity for s in seen), "tree slot outside the pool"
    freed = seen & cache.pool.free_slot_set()
    assert not freed, f"tree slots {sorted(freed)[:8]} are also in the pool's free list"
    assert evictable == cache._evictable, (
        f"evictable_size {cache._evictable} != recomputed {evictable}"
    )
    assert protected == cache._protected, (
        f"protected_size {cache._protected} != recomputed {protected}"
    )
    assert evictable + protected == cache.total_size() == len(seen), "size totals disagree"
    assert leaves == cache._evictable_leaves, "evictable-leaf set is stale"
