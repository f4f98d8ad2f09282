"""Moves a request's KV slots between the pool, the radix cache and the request itself.

Invariants kept here:
- `req.kv_slots[:req.cached_len]` are owned by the cache and locked through `req.last_node`;
  `req.kv_slots[req.cached_len:]` are owned by the request.
- free + cached + owned by requests == pool capacity (`check_invariants`).
With the radix cache disabled nothing is ever cached: `cached_len` stays 0 and a request's slots
return to the pool when it leaves. With `min_cached_prefix = N`, sequences shorter than N tokens
are not inserted (their slots return to the pool).
With a tiered cache (`TieredRadixCache`), the match also promotes host and disk spans into the
pool before it is locked, and `req.match_split` says how many tokens came from which tier.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.cache.radix_cache import RadixCache
from sglite.runtime.cache.tiered_cache import TieredRadixCache
from sglite.runtime.cache.tree_node import TreeNode
from sglite.runtime.scheduler.request import Req


@dataclass(frozen=True)
class Admission:
    """A request's first admission as the web UI's cache view shows it. `node` is a reference
    only: it may leave the tree later. `segments`: the request's reused / recomputed /
    computed prompt tokens when it reused cached segments, else None."""

    rid: str
    node: TreeNode | None
    cached_tokens: int
    prompt_tokens: int
    segments: dict[str, int] | None


class RequestKVManager:
    """Slot bookkeeping for requests on top of `KVPool` and `RadixCache`."""

    def __init__(
        self, pool: KVPool, cache: RadixCache, cache_enabled: bool, min_cached_prefix: int = 0
    ) -> None:
        self.pool = pool
        self.cache = cache
        self.cache_enabled = cache_enabled
        self.min_cached_prefix = min_cached_prefix
        self.tiered = cache if isinstance(cache, TieredRadixCache) and cache_enabled else None
        self.last_admission: Admission | None = None  # the latest, for the web UI

    def match_and_lock(self, req: Req) -> int:
        """Attach the longest usable cached prefix to `req` and lock it. Returns its length.

        At most `len(fill) - 1` tokens (the last token's logits must be computed) and at most
        `logprob_start_len` when input logprobs are still wanted (their logits are needed too).
        """
        req.kv_slots, req.cached_len, req.last_node = [], 0, None
        req.match_split = {"device": 0, "host": 0, "disk": 0}
        if not self.cache_enabled:
            return 0
        limit = req.num_fill - 1
        if req.pooling is not None and req.pooling.mode == "mean":
            limit = 0  # every prompt token's hidden state is needed
        if req.wants_input_logprobs:
            limit = min(limit, req.logprob_start_len)
        if self.tiered is not None:
            found = self.tiered.load_prefix(req.fill_ids[:limit])
            slots, node = found.slots, found.node
            req.match_split = found.details()
        else:
            match = self.cache.match_prefix(req.fill_ids[:limit])
            slots, node = match.slots, match.node
            req.match_split["device"] = len(slots)
        self.cache.lock(node)
        req.kv_slots = list(slots)
        req.cached_len = len(slots)
        req.last_node = node
        return req.cached_len

    def record_admission(self, req: Req) -> None:
        """Count a request's first admission: its cache hit per tier."""
        req.cached_tokens_details = dict(req.match_split)
        self.last_admission = Admission(
            req.rid, req.last_node, req.cached_len, len(req.prompt_ids), req.segment_counts
        )
        if self.tiered is not None and req.last_node is not None:
            self.tiered.record_hits(req.last_node, req.match_split)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Feed a prefill pass's cost per token to the tiered cache's cost model."""
        if self.tiered is not None:
            self.tiered.costs.observe_prefill(tokens, seconds)

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
        (prompt and output, so later turns and forks reuse them), duplicates are freed. KV past
        `req.exact_len` (assembled from segments, approximate) is freed, never cached."""
        computed = len(req.kv_slots)
        exact = computed if req.exact_len is None else min(computed, req.exact_len)
        if exact and self.cache_enabled and exact >= self.min_cached_prefix:
            already = self.cache.insert(req.fill_ids[:exact], req.kv_slots[:exact])
            self.pool.free(req.kv_slots[req.cached_len : already])
            self.pool.free(req.kv_slots[max(exact, req.cached_len) :])  # approximate KV
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
        computed = len(req.kv_slots)
        if not self.cache_enabled or computed < self.min_cached_prefix:
            return
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
        out = {"free": free, "cached": cached, "held_by_requests": own}
        if self.tiered is not None:
            out["host_cached"] = self.tiered.host_size()
            if self.tiered.host is not None:
                out["host_free"] = self.tiered.host.num_free
        return out
