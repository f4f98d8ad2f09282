"""Writing spans of the radix tree to the disk tier as pages.

A page is `page_size` tokens at a page-aligned position of a whole prefix, named by the chain
hash of the prefix it ends (disk_store.py), so whether a page can be written depends on the path
from the root, not only on the node. The tiered cache calls this for a span that reaches the
device under write-through, and for every span that leaves the tree.

Invariants:
- A page is written by the node that holds its last token (pages ending higher up belong to an
  ancestor), so walking a path writes each of its pages once; a trailing partial page is never
  stored.
- Pages already on disk are not rewritten; the first failed write ends the span's writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglite.runtime.cache.disk_store import DiskKVStore
    from sglite.runtime.cache.tier_io import TierIO
    from sglite.runtime.cache.tree_node import TreeNode


def persist_pages(disk: DiskKVStore, io: TierIO, path: list[TreeNode]) -> None:
    """Write the disk pages that end inside the span of `path[-1]`, the last node of the
    root-to-node `path` (pages ending higher up belong to an ancestor; a trailing partial page
    is not stored)."""
    size = disk.page_size
    end = sum(len(p.key) for p in path)
    begin = end - len(path[-1].key)
    page_ends = range((begin // size + 1) * size, end + 1, size)
    if not page_ends:
        return
    ids = [t for p in path for t in p.key]
    hashes = disk.page_hashes(ids[: page_ends[-1]])
    missing = [e for e in page_ends if not disk.has(hashes[e // size - 1])]
    if not missing:
        return
    # One gather for every missing page (per-layer copies cost per call, not per token).
    lo, hi = missing[0] - size, missing[-1]
    kv = io.gather(_segments(path, lo, hi))
    for page_end in missing:
        page = kv[:, :, page_end - size - lo : page_end - lo]
        tokens = ids[page_end - size : page_end]
        if not io.write_page(hashes[page_end // size - 1], tokens, page):
            return


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
