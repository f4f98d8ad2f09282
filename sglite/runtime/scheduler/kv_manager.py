"""Moves a request's KV slots between the pool, the radix cache and the request itself.

Invariants kept here:
- `req.kv_slots[:req.cached_len]` are owned by the cache and locked through `req.last_node`;
  `req.kv_slots[req.cached_len:]` are owned by the request.
- free + cached + owned by requests == pool capacity (`check_invariants`).
With the radix cache disabled nothing is ever cached: `cached_len` stays 0 and a request's slots
return to the pool when it leaves.
"""

from __future__ import annotations

from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.cache.radix_cache import RadixCache
from sglite.runtime.scheduler.request import Req


class RequestKVManager:
    """Slot bookkeeping for requests on top of `KVPool` and `RadixCache`."""

    def __init__(self, pool: KVPool, cache: RadixCache, cache_enabled: bool) -> None:
        self.pool = pool
        self.cache = cache
        self.cache_enabled = cache_enabled

    def match_and_lock(self, req: Req) -> int:
        """Attach the longest usable cached prefix to `req` and lock it. Returns its length.

        At most `len(fill) - 1` tokens (the last token's logits must be computed) and at most
        `logprob_start_len` when input logprobs are still wanted (their logits are needed too).
        """
        req.kv_slots, req.cached_len, req.last_node = [], 0, None
        if not self.cache_enabled:
            return 0
        limit = req.num_fill - 1
        if req.wants_input_logprobs:
            limit = min(limit, req.logprob_start_len)
        match = self.cache.match_prefix(req.fill_ids[:limit])
        self.cache.lock(match.node)
        req.kv_slots = list(match.slots)
        req.cached_len = len(match.slots)
        req.last_node = match.node
        return req.cached_len

    def unlock(self, req: Req) -> None:
        """Drop the request's hold on its cached prefix (its own slots must be gone already)."""
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        req.kv_slots, req.cached_len, req.last_node = [], 0, None

    def can_fit(self, need_now: int, reserve: int) -> bool:
        """Whether `need_now` slots plus a `reserve` can be had, evicting unlocked cache."""
        return self.pool.num_free + self.cache.evictable_size() >= need_now + reserve

    def alloc(self, n: int) -> list[int]:
        """Take n slots, evicting LRU cache leaves first when the pool is short."""
        if self.pool.num_free < n:
            self.cache.evict(n - self.pool.num_free)
        return self.pool.alloc(n)

    def release(self, req: Req) -> None:
        """The request leaves (finished or retracted): its computed tokens go to the cache
        (prompt and output, so later turns and forks reuse them), duplicates are freed."""
        computed = len(req.kv_slots)
        if computed and self.cache_enabled:
            already = self.cache.insert(req.fill_ids[:computed], req.kv_slots)
            self.pool.free(req.kv_slots[req.cached_len : already])
        elif computed:
            self.pool.free(req.kv_slots[req.cached_len :])
        self.unlock(req)

    def discard(self, req: Req) -> None:
        """The request leaves after a failed step: its own slots may hold KV that was never
        written, so they go back to the pool uncached (a later match must never read them)."""
        self.pool.free(req.kv_slots[req.cached_len :])
        self.unlock(req)

    def cache_unfinished(self, req: Req) -> None:
        """Insert a running request's computed tokens now so others can share them at once."""
        if not self.cache_enabled:
            return
        computed = len(req.kv_slots)
        fill = req.fill_ids[:computed]
        already = self.cache.insert(fill, req.kv_slots)
        self.pool.free(req.kv_slots[req.cached_len : already])
        match = self.cache.match_prefix(fill)
        self.cache.lock(match.node)
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        req.kv_slots, req.cached_len, req.last_node = list(match.slots), computed, match.node

    def check_invariants(self, holders: list[Req]) -> dict[str, int]:
        """Verify slot accounting given the requests holding slots; AssertionError on a leak."""
        self.cache.check_invariants()
        own = sum(len(r.kv_slots) - r.cached_len for r in holders)
        cached = self.cache.total_size()
        free = self.pool.num_free
        if free + cached + own != self.pool.capacity:
            raise AssertionError(
                f"slot leak: free {free} + cached {cached} + requests {own} "
                f"!= capacity {self.pool.capacity}"
            )
        return {"free": free, "cached": cached, "held_by_requests": own}
