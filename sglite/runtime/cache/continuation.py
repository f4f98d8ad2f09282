"""What follows a token sequence in the radix cache, read without touching the tree: the
continuation an n-gram proposer drafts when a request repeats a cached sequence."""

from __future__ import annotations

from sglite.runtime.cache.radix_cache import RadixCache
from sglite.runtime.cache.tree_node import TreeNode


def cached_continuation(cache: RadixCache, tokens: list[int], limit: int) -> list[int]:
    """Up to `limit` tokens that follow `tokens` in `cache`, when the whole of `tokens` is a
    cached prefix; empty otherwise. Where the tree branches, the most recently used branch is
    followed. Reads the tree only: no split, no LRU refresh, no hit count."""
    node, pos, offset = cache.root, 0, 0  # tokens[:pos] matched; `offset` into node.key
    while pos < len(tokens):
        child = node.children.get(tokens[pos])
        if child is None:
            return []
        n = min(len(child.key), len(tokens) - pos)
        if child.key[:n] != tokens[pos : pos + n]:
            return []
        node, pos, offset = child, pos + n, n
    out = node.key[offset : offset + limit]
    while len(out) < limit and node.children:
        node = max(node.children.values(), key=_recency)
        out.extend(node.key[: limit - len(out)])
    return out


def _recency(node: TreeNode) -> tuple[float, int]:
    return (node.last_access, node.serial)
