"""Cache-aware ordering of the waiting queue.

- `fcfs`: arrival order.
- `lpm`: longest cached prefix first, so cache hits are used before eviction can take them.
- `dfs-weight`: walk the radix tree depth-first, heavier subtrees (more waiting requests) first, so
  requests that share a prefix run back to back.
Every policy puts requests that waited longer than the starvation bound first (SGLang's lpm can
starve a request with no cache hit forever; this bound fixes it). `shares_with_batch` defers a
request whose uncached prefix another request of the same prefill computes.
"""

from __future__ import annotations

from collections import defaultdict

from sglite.runtime.cache.radix_cache import RadixCache
from sglite.runtime.cache.tree_node import TreeNode
from sglite.runtime.scheduler.request import Req

# Matching every waiting request costs a tree walk each; past this queue length the gain of a
# cache-aware order does not pay for it and the policy falls back to fcfs (as SGLang does).
MAX_QUEUE_FOR_CACHE_AWARE = 128

# Requests sharing at least this many uncached tokens with one admitted in the same step wait one
# step, so they hit the cache instead of computing the shared part again.
IN_BATCH_SHARING_MIN_TOKENS = 32


def order_waiting(
    waiting: list[Req],
    policy: str,
    cache: RadixCache | None,
    now: float,
    starvation_timeout: float,
) -> list[Req]:
    """Return the waiting requests in the order the scheduler should try to admit them."""
    starved = [r for r in waiting if now - r.arrival_time > starvation_timeout]
    rest = [r for r in waiting if now - r.arrival_time <= starvation_timeout]
    starved.sort(key=lambda r: r.arrival_time)
    if cache is None or policy == "fcfs" or len(rest) > MAX_QUEUE_FOR_CACHE_AWARE:
        rest.sort(key=lambda r: r.arrival_time)
    elif policy == "lpm":
        rest = _longest_prefix_first(rest, cache)
    elif policy == "dfs-weight":
        rest = _dfs_weight(rest, cache)
    else:
        raise ValueError(f"unknown schedule policy {policy!r}")
    return starved + rest


def _probe(cache: RadixCache, req: Req) -> tuple[int, TreeNode]:
    fill = req.fill_ids
    match = cache.match_prefix(fill[: len(fill) - 1])
    return len(match.slots), match.node


def _longest_prefix_first(reqs: list[Req], cache: RadixCache) -> list[Req]:
    lengths = {id(r): _probe(cache, r)[0] for r in reqs}
    return sorted(reqs, key=lambda r: (-lengths[id(r)], r.arrival_time))


def _dfs_weight(reqs: list[Req], cache: RadixCache) -> list[Req]:
    at_node: dict[int, list[Req]] = defaultdict(list)
    weight: dict[int, int] = defaultdict(int)
    for req in reqs:
        _, node = _probe(cache, req)
        at_node[id(node)].append(req)
        walk: TreeNode | None = node
        while walk is not None:
            weight[id(walk)] += 1
            walk = walk.parent
    ordered: list[Req] = []
    stack: list[TreeNode] = [cache.root]
    while stack:  # iterative: conversation trees can be deeper than Python's recursion limit
        node = stack.pop()
        ordered.extend(sorted(at_node.get(id(node), []), key=lambda r: r.arrival_time))
        children = [c for c in node.children.values() if weight.get(id(c), 0) > 0]
        stack.extend(sorted(children, key=lambda c: weight[id(c)]))  # heaviest popped first
    return ordered


def shares_with_batch(req: Req, matched: int, batch: list[tuple[Req, int]]) -> bool:
    """Whether `req`, with `matched` tokens cached, should wait for a prefix that a request of
    this prefill `batch` computes (its next IN_BATCH_SHARING_MIN_TOKENS tokens are the same)."""
    span = IN_BATCH_SHARING_MIN_TOKENS
    if req.num_fill - matched <= span:
        return False
    window = req.fill_ids[matched : matched + span]
    for other, _ in batch:
        if other.cached_len <= matched and other.fill_ids[matched : matched + span] == window:
            return True
    return False
