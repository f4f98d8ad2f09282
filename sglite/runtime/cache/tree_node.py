"""One node of the radix tree (`TreeNode`), the memory tier its KV lives in, and the two edge
operations every lookup uses: comparing an edge key with a query, and splitting an edge.

A non-root node's `key` is the token ids on the edge into it, so the path from the root to a node
spells the prefix that node ends. Invariants every cache keeps per node (the first two are
verified by `check_invariants`, in radix_check.py and tier_check.py):
- The root has an empty key; every other node a non-empty one, with
  `parent.children[node.key[0]] is node`.
- `slots` holds one device slot per token of `key` (the tiered cache also allows `[]`: off the
  device); `host_slots` is None or one host slot per token.
- Identity is stable for the prefix a node ends: a split creates a new upper node and keeps the
  lower part in the existing object, so holders of a node keep pointing at the same prefix.
- `serial` is unique and grows with creation order, so heaps and views order nodes
  deterministically.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

_SERIALS = itertools.count()


class MemoryTier(enum.Enum):
    """Where a node's KV entries live: the device pool, the host tier, or disk page files.

    The plain `RadixCache` keeps everything on DEVICE; `TieredRadixCache` (tiered_cache.py)
    also keeps spans in HOST memory, and DISK pages outside the tree (content-addressed).
    """

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


@dataclass(eq=False)
class TreeNode:
    """One edge of the radix tree and the KV slots of its token span.

    Node identity is stable for the prefix it ends: when a match or insert splits a node, a new
    node is created for the upper part and the existing object keeps the lower part, so a request
    holding (and locking) a node keeps pointing at the same full prefix.
    """

    key: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    children: dict[int, TreeNode] = field(default_factory=dict, repr=False)
    parent: TreeNode | None = field(default=None, repr=False)
    lock_ref: int = 0
    # A logical clock value (one tick per match_prefix/insert call), not wall time: order is
    # deterministic, which keeps eviction order testable. Every token of a node was last touched
    # at this time, because lookups split nodes at the end of what they touched.
    last_access: float = 0.0
    # Number of match_prefix walks that passed through this node, scheduler probes included
    # (the tiered cache counts admissions only).
    hit_count: int = 0
    # Host-tier copy of the span (TieredRadixCache only): one host slot per token, or None.
    # A node off the device has `slots == []` and a host copy; the plain cache never sets it.
    host_slots: list[int] | None = None
    # Creation order: a deterministic tie-breaker for eviction heaps (set order is not).
    serial: int = field(default_factory=lambda: next(_SERIALS), repr=False)

    @property
    def is_leaf(self) -> bool:
        """True when the node has no children."""
        return not self.children

    @property
    def on_device(self) -> bool:
        """True when the span's KV is in the device pool (always, in the plain cache)."""
        return bool(self.slots)

    @property
    def tier(self) -> MemoryTier:
        """The fastest tier holding this span's KV."""
        return MemoryTier.DEVICE if self.slots else MemoryTier.HOST


def _common_prefix_len(key: list[int], ids: Sequence[int], start: int) -> int:
    """Length of the common prefix of `key` and `ids[start:]`."""
    end = start + len(key)
    # Whole-edge matches dominate (long shared system prompts); list equality runs in C.
    if ids[start:end] == key:
        return len(key)
    limit = min(len(key), len(ids) - start)
    i = 0
    while i < limit and key[i] == ids[start + i]:
        i += 1
    return i


def split_node(node: TreeNode, n: int) -> TreeNode:
    """Cut `node`'s edge after `n` tokens; returns the new upper node.

    The existing object keeps the lower part so holders of `node` still refer to the same
    prefix. The upper node inherits the lock count: every lock through `node` passes through
    it, and it has no other child yet. Sizes and leaf status are unchanged.
    """
    parent = node.parent
    assert parent is not None and 0 < n < len(node.key)
    upper = TreeNode(
        key=node.key[:n],
        slots=node.slots[:n],
        parent=parent,
        lock_ref=node.lock_ref,
        last_access=node.last_access,
        hit_count=node.hit_count,
        host_slots=None if node.host_slots is None else node.host_slots[:n],
    )
    parent.children[upper.key[0]] = upper
    node.key = node.key[n:]
    node.slots = node.slots[n:]
    if node.host_slots is not None:
        node.host_slots = node.host_slots[n:]
    node.parent = upper
    upper.children[node.key[0]] = node
    return upper
