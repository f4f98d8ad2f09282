"""A bounded snapshot of the radix tree for people to look at (the web UI's cache view).

The scheduler builds it between steps, so its cost is paid by every request in flight: the walk
visits at most `max_nodes` nodes, looks at no more than `max_nodes` children of any one node,
and decodes at most `text_tokens` tokens per node. Whatever the walk leaves out is counted as
hidden children on the node above it, never silently dropped.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the HTTP process imports this module without torch
    from sglite.runtime.cache.radix_cache import RadixCache
    from sglite.runtime.cache.tree_node import TreeNode

# Bounds a caller may ask for (the HTTP route checks them; larger asks are refused).
MAX_DEPTH = 64
MAX_NODES = 2000
MAX_TEXT_TOKENS = 256


@dataclass
class NodeView:
    """One node as the page draws it: its token span (and the start of its text), the size of
    the span, how often requests passed through it, whether a running request holds it, and
    the tier its KV lives in."""

    id: int
    parent: int | None
    depth: int
    tokens: int
    text: str
    text_truncated: bool
    hits: int
    lock_ref: int
    tier: str
    children: int  # all of its children in the tree
    hidden_children: int  # those not in this snapshot (bounds on depth and node count)


def snapshot_tree(
    cache: RadixCache,
    decode: Callable[[list[int]], str],
    *,
    depth: int,
    max_nodes: int,
    text_tokens: int,
    highlight: TreeNode | None = None,
) -> dict[str, Any]:
    """The tree breadth first from the root (the first node, tier "root"), most-hit children
    first, within the bounds.

    `highlight` is a node whose path from the root is listed as `highlight` (node ids, the root
    first); empty when the node has since left the tree (evicted)."""
    check_bounds(depth, max_nodes, text_tokens)
    nodes: list[NodeView] = []
    queue: deque[tuple[TreeNode, int]] = deque([(cache.root, 0)])
    while queue and len(nodes) < max_nodes:
        node, level = queue.popleft()
        room = max_nodes - len(nodes) - len(queue) - 1
        shown = _children_to_show(node, room if level < depth else 0)
        queue.extend((child, level + 1) for child in shown)
        nodes.append(_view(node, level, decode, text_tokens, len(shown)))
    # Children are queued only while nodes + queue fit in max_nodes, so the queue drains.
    return {
        "nodes": [dict(vars(n)) for n in nodes],
        "truncated": any(n.hidden_children for n in nodes),
        "highlight": path_ids(cache, highlight),
    }


def check_bounds(depth: int, max_nodes: int, text_tokens: int) -> None:
    """Raise ValueError naming the bound a snapshot request breaks."""
    for name, value, high in (
        ("depth", depth, MAX_DEPTH),
        ("max_nodes", max_nodes, MAX_NODES),
        ("text_tokens", text_tokens, MAX_TEXT_TOKENS),
    ):
        if not 1 <= value <= high:
            raise ValueError(f"{name} must be between 1 and {high}, got {value}")


def path_ids(cache: RadixCache, node: TreeNode | None) -> list[int]:
    """Ids of the nodes from the root down to `node`; empty when it is no longer in the tree."""
    path: list[int] = []
    while node is not None and node is not cache.root:
        parent = node.parent
        if parent is None or not node.key or parent.children.get(node.key[0]) is not node:
            return []
        path.append(node.serial)
        node = parent
    if node is None:
        return []
    path.append(cache.root.serial)
    return path[::-1]


def _children_to_show(node: TreeNode, room: int) -> list[TreeNode]:
    """Up to `room` of the node's children, most hits first, looking at no more than
    MAX_NODES of them (a node with a huge fan-out must not make the walk slow)."""
    if room <= 0 or not node.children:
        return []
    candidates = itertools.islice(node.children.values(), MAX_NODES)
    return heapq.nlargest(room, candidates, key=lambda c: (c.hit_count, -c.serial))


def _view(
    node: TreeNode, level: int, decode: Callable[[list[int]], str], text_tokens: int, shown: int
) -> NodeView:
    return NodeView(
        id=node.serial,
        parent=node.parent.serial if node.parent is not None else None,
        depth=level,
        tokens=len(node.key),
        text=decode(node.key[:text_tokens]) if node.key else "",
        text_truncated=len(node.key) > text_tokens,
        hits=node.hit_count,
        lock_ref=node.lock_ref,
        tier=node.tier.value if node.parent is not None else "root",
        children=len(node.children),
        hidden_children=len(node.children) - shown,
    )
