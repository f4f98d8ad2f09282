"""An approximate radix tree: which worker has probably cached which request prefix.

A balancer never sees the workers' KV caches, so it remembers what it sent to each worker and
assumes the worker still holds it: the router remembers *text* (characters, not tokens:
tokenizing in the router would cost more than it saves), data parallelism token ids. One
tree is shared by all workers; each node records the workers that hold its edge and when each
last touched it. Per worker the marks are prefix-closed: a worker marking a node also marks
every ancestor, and eviction only removes a worker's mark from nodes where it marks no child.
So a worker's match is simply the deepest marked node on the query path.

Keys are any sequence of hashable items: a `str` for text and a `tuple[int, ...]` for token ids
(`input_ids` requests). The two never share an edge, as a character never equals an int.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from itertools import count

Key = Sequence[Hashable]


@dataclass(eq=False)
class _Node:
    """One edge of the tree: `key` is the label from the parent; `workers` maps each worker
    holding this prefix to its last access tick."""

    key: Key
    parent: _Node | None
    children: dict[Hashable, _Node] = field(default_factory=dict)
    workers: dict[str, int] = field(default_factory=dict)


def common_prefix_len(a: Key, b: Key) -> int:
    """Length of the longest common prefix of two sequences."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (a cached edge fully matched), at C speed
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: bisect on slice equality
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class ApproxRadixTree:
    """Shared prefix tree of the requests routed to each worker.

    Invariants: for every worker, the set of nodes it marks is closed under parents;
    `size(w)` equals the summed edge lengths of the nodes `w` marks; a node marked by no worker
    is removed (the root excepted). Not thread-safe: callers use it from one thread (the router's
    event loop) or under a lock.
    """

    def __init__(self) -> None:
        self._root = _Node(key=(), parent=None)
        self._sizes: dict[str, int] = {}
        self._clock = count(1)  # a logical clock: LRU order is exact even within one timer tick

    def size(self, worker: str) -> int:
        """Characters (or ids) of prefixes the tree attributes to `worker`."""
        return self._sizes.get(worker, 0)

    def workers(self) -> list[str]:
        """Workers holding anything in the tree."""
        return [w for w, n in self._sizes.items() if n > 0]

    def insert(self, key: Key, worker: str) -> None:
        """Record that `worker` now holds `key` (and so all its prefixes); touches the path."""
        tick = next(self._clock)
        node = self._root
        rest = key
        while rest:
            child = node.children.get(rest[0])
            if child is None:
                child = _Node(key=rest, parent=node)
                node.children[rest[0]] = child
            else:
                shared = common_prefix_len(child.key, rest)
                if shared < len(child.key):
                    child = self._split(child, shared)
            if worker not in child.workers:
                self._sizes[worker] = self._sizes.get(worker, 0) + len(child.key)
            child.workers[worker] = tick
            rest = rest[len(child.key) :]
            node = child

    def match(self, key: Key) -> dict[str, int]:
        """For every worker, how many leading items of `key` it holds (only workers with > 0).

        Read-only: matching does not count as an access (the chosen worker's insert does).
        """
        matched: dict[str, int] = {}
        node = self._root
        depth = 0
        rest = key
        while rest:
            child = node.children.get(rest[0])
            if child is None:
                break
            shared = common_prefix_len(child.key, rest)
            depth += shared
            for worker in child.workers:
                matched[worker] = depth  # deeper nodes overwrite: the deepest mark wins
            if shared < len(child.key):
                break
            rest = rest[shared:]
            node = child
        return matched

    def evict(self, worker: str, max_size: int) -> int:
        """Drop `worker`'s least recently used leaves until it holds at most `max_size` items;
        returns how many items were dropped."""
        excess = self.size(worker) - max_size
        if excess <= 0:
            return 0
        heap = [
            (n.workers[worker], id(n), n)
            for n in self._nodes_of(worker)
            if self._is_leaf_of(n, worker)
        ]
        heapq.heapify(heap)
        dropped = 0
        while heap and dropped < excess:
            _, _, node = heapq.heappop(heap)
            dropped += self._unmark(node, worker)
            parent = node.parent
            if parent is not self._root and parent is not None and self._is_leaf_of(parent, worker):
                heapq.heappush(heap, (parent.workers[worker], id(parent), parent))
        return dropped

    def remove_worker(self, worker: str) -> None:
        """Forget everything `worker` holds (it went down, was removed, or restarted empty)."""
        # Children first, so each node is a leaf of the worker when it is unmarked.
        for node in reversed(list(self._nodes_of(worker))):
            self._unmark(node, worker)
        self._sizes.pop(worker, None)

    # ------------------------------------------------------------------ internals
    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node`'s edge after `at` items; returns the new upper half (same marks)."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key)
        upper = _Node(key=node.key[:at], parent=parent, workers=dict(node.workers))
        parent.children[upper.key[0]] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    def _nodes_of(self, worker: str) -> list[_Node]:
        """Nodes marked by `worker`, parents before children."""
        out: list[_Node] = []
        stack = [c for c in self._root.children.values() if worker in c.workers]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(c for c in node.children.values() if worker in c.workers)
        return out

    @staticmethod
    def _is_leaf_of(node: _Node, worker: str) -> bool:
        return worker in node.workers and not any(
            worker in c.workers for c in node.children.values()
        )

    def _unmark(self, node: _Node, worker: str) -> int:
        """Remove `worker`'s mark from `node` (one of its leaves); returns the items freed."""
        del node.workers[worker]
        self._sizes[worker] -= len(node.key)
        if not node.workers:
            # Prefix-closure: an unmarked node has no marked children, so none at all.
            assert not node.children and node.parent is not None
            del node.parent.children[node.key[0]]
        return len(node.key)
