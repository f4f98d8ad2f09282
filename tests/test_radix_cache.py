"""Unit and property tests for the radix prefix cache (fast, no model)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.cache.radix_cache import MatchResult, RadixCache
from sglite.runtime.cache.tree_node import TreeNode


def make_cache(capacity: int = 64) -> tuple[KVPool, RadixCache]:
    """A tiny pool (one layer, one head, dim 1): only the slot allocator matters here."""
    pool = KVPool(capacity, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
    return pool, RadixCache(pool)


def path_tokens(node: TreeNode) -> list[int]:
    """The token prefix spelled by the path from the root to `node`."""
    parts: list[list[int]] = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def assert_conserved(pool: KVPool, cache: RadixCache, held: int = 0) -> None:
    """Every slot is free, in the tree, or held privately by the test."""
    cache.check_invariants()
    assert pool.num_free + len(cache.owned_slots()) + held == pool.capacity
    assert len(cache.owned_slots()) == cache.total_size()


def insert_fresh(pool: KVPool, cache: RadixCache, ids: list[int]) -> tuple[int, list[int]]:
    """Insert `ids` with newly allocated slots, freeing the duplicates as the contract says."""
    slots = pool.alloc(len(ids))
    already = cache.insert(ids, slots)
    pool.free(slots[:already])
    return already, slots


# ---------------------------------------------------------------------- unit tests
def test_match_on_empty_tree() -> None:
    pool, cache = make_cache()
    res = cache.match_prefix([1, 2, 3])
    assert res.slots == [] and res.node is cache.root
    assert cache.match_prefix([]).node is cache.root
    assert cache.total_size() == 0
    assert_conserved(pool, cache)


def test_insert_and_match_split_partial_nodes() -> None:
    pool, cache = make_cache()
    already, slots = insert_fresh(pool, cache, [1, 2, 3, 4])
    assert already == 0

    res = cache.match_prefix([1, 2, 9])
    assert res.slots == slots[:2]
    assert res.node.key == [1, 2] and res.node.parent is cache.root
    assert list(res.node.children) == [3] and res.node.children[3].key == [3, 4]

    full = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert full.slots == slots and path_tokens(full.node) == [1, 2, 3, 4]
    assert cache.match_prefix([7]).node is cache.root
    assert cache.total_size() == 4
    assert_conserved(pool, cache)


def test_insert_ending_inside_an_edge_is_fully_cached() -> None:
    pool, cache = make_cache()
    _, slots = insert_fresh(pool, cache, [1, 2, 3, 4])
    already, _ = insert_fresh(pool, cache, [1, 2])
    assert already == 2
    # The split leaves the untouched tail [3, 4] with its older access time.
    upper = cache.root.children[1]
    assert upper.key == [1, 2] and upper.children[3].key == [3, 4]
    assert upper.last_access > upper.children[3].last_access
    assert cache.match_prefix([1, 2, 3, 4]).slots == slots
    assert_conserved(pool, cache)


def test_insert_rejects_length_mismatch() -> None:
    _, cache = make_cache()
    with pytest.raises(ValueError):
        cache.insert([1, 2], [5])


def test_shared_prefix_insert_and_caller_frees_contract() -> None:
    pool, cache = make_cache(capacity=32)
    _, a_slots = insert_fresh(pool, cache, [1, 2, 3, 4])

    # A sequence computed from scratch that shares 3 tokens: the tree keeps only its new part.
    b_slots = pool.alloc(5)
    assert cache.insert([1, 2, 3, 9, 9], b_slots) == 3
    assert_conserved(pool, cache, held=3)  # b_slots[:3] are still the caller's
    pool.free(b_slots[:3])
    assert_conserved(pool, cache)
    assert cache.match_prefix([1, 2, 3, 9, 9]).slots == a_slots[:3] + b_slots[3:]

    # A running request reuses a locked prefix of 4 and computes one more token privately...
    ids = [1, 2, 3, 4, 7]
    match = cache.match_prefix(ids[:-1])
    cache.lock(match.node)
    m = len(match.slots)
    assert m == 4
    req_slots = list(match.slots) + pool.alloc(1)
    assert_conserved(pool, cache, held=1)
    # ...while another request caches the same token first.
    insert_fresh(pool, cache, ids)
    assert_conserved(pool, cache, held=1)
    already = cache.insert(ids, req_slots)
    assert already == 5
    pool.free(req_slots[m:already])
    cache.unlock(match.node)
    assert_conserved(pool, cache)


def test_locks_prevent_eviction_and_protect_ancestors() -> None:
    pool, cache = make_cache()
    insert_fresh(pool, cache, [1, 2, 3])
    insert_fresh(pool, cache, [1, 2, 4])
    node = cache.match_prefix([1, 2, 3]).node
    assert node.key == [3] and node.parent is not None and node.parent.key == [1, 2]
    cache.lock(node)
    assert node.lock_ref == 1 and node.parent.lock_ref == 1
    assert cache.protected_size() == 3 and cache.evictable_size() == 1

    assert cache.evict(100) == 1  # only the unlocked sibling [4] can go
    assert len(cache.match_prefix([1, 2, 3]).slots) == 3
    assert cache.match_prefix([1, 2, 4]).node is node.parent
    assert_conserved(pool, cache)

    cache.unlock(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 3
    assert cache.evict(100) == 3
    assert cache.total_size() == 0
    assert pool.num_free == pool.capacity
    assert_conserved(pool, cache)


def test_unlock_below_zero_raises_and_root_lock_is_noop() -> None:
    pool, cache = make_cache()
    insert_fresh(pool, cache, [5, 6])
    node = cache.match_prefix([5, 6]).node
    with pytest.raises(RuntimeError):
        cache.unlock(node)
    assert node.lock_ref == 0
    cache.lock(cache.root)
    cache.unlock(cache.root)
    assert cache.root.lock_ref == 0
    assert_conserved(pool, cache)


def test_lock_of_evicted_node_raises() -> None:
    pool, cache = make_cache()
    insert_fresh(pool, cache, [5, 6])
    node = cache.match_prefix([5, 6]).node
    cache.evict(2)
    with pytest.raises(ValueError):
        cache.lock(node)
    assert_conserved(pool, cache)


def test_eviction_is_lru_and_cascades_to_parents() -> None:
    pool, cache = make_cache()
    insert_fresh(pool, cache, [1, 2, 3])  # A
    insert_fresh(pool, cache, [1, 4, 5])  # B: splits A into [1] -> {[2, 3], [4, 5]}
    insert_fresh(pool, cache, [6, 7])  # C
    cache.match_prefix([1, 2, 3])  # A is now the most recently used
    # Leaves by age: B [4, 5], C [6, 7], A [2, 3]; [1] becomes a leaf only after A and B go.

    def present(ids: list[int]) -> bool:
        return len(cache.match_prefix(ids).slots) == len(ids)

    assert cache.evict(2) == 2
    assert not present([1, 4, 5]) and present([6, 7]) and present([1, 2, 3])
    assert cache.evict(1) == 2  # whole nodes: C goes entirely
    assert not present([6, 7]) and present([1, 2, 3])
    assert_conserved(pool, cache)

    # Cascade: one call frees A's leaf and then its now-childless parent [1].
    assert cache.evict(3) == 3
    assert cache.total_size() == 0 and not cache.root.children
    assert cache.evict(1) == 0
    assert_conserved(pool, cache)


def test_match_refresh_changes_victim() -> None:
    pool, cache = make_cache()
    insert_fresh(pool, cache, [1, 1])
    insert_fresh(pool, cache, [2, 2])
    cache.match_prefix([1, 1])  # [2, 2] is now the older one
    cache.evict(1)
    assert len(cache.match_prefix([1, 1]).slots) == 2
    assert cache.match_prefix([2, 2]).slots == []
    assert_conserved(pool, cache)


def test_flush_refuses_while_locked_then_frees_everything() -> None:
    pool, cache = make_cache()
    insert_fresh(pool, cache, [1, 2, 3])
    insert_fresh(pool, cache, [1, 9])
    node = cache.match_prefix([1, 2]).node
    cache.lock(node)
    with pytest.raises(RuntimeError):
        cache.flush()
    assert cache.total_size() == 4
    cache.unlock(node)
    cache.flush()
    assert cache.total_size() == 0 and cache.evictable_size() == 0
    assert pool.num_free == pool.capacity
    assert cache.match_prefix([1, 2, 3]).node is cache.root
    assert_conserved(pool, cache)


def test_sizes_track_nested_locks_and_splits() -> None:
    pool, cache = make_cache()
    insert_fresh(pool, cache, [1, 2, 3, 4, 5])
    leaf = cache.match_prefix([1, 2, 3, 4, 5]).node
    cache.lock(leaf)
    cache.lock(leaf)
    assert cache.protected_size() == 5 and cache.evictable_size() == 0

    # Splitting a locked node keeps the whole path protected; the lower part keeps its identity.
    mid = cache.match_prefix([1, 2, 7]).node
    assert mid.key == [1, 2] and mid.lock_ref == 2 and leaf.key == [3, 4, 5]
    assert cache.protected_size() == 5
    cache.lock(mid)
    assert mid.lock_ref == 3 and leaf.lock_ref == 2

    insert_fresh(pool, cache, [1, 2, 8, 8])  # an unlocked branch under a locked node
    assert cache.protected_size() == 5 and cache.evictable_size() == 2
    cache.unlock(leaf)
    cache.unlock(leaf)
    assert cache.protected_size() == 2 and cache.evictable_size() == 5
    assert cache.evict(100) == 5
    cache.unlock(mid)
    assert cache.protected_size() == 0 and cache.evictable_size() == 2
    assert_conserved(pool, cache)


def test_record_query_counts_but_match_does_not() -> None:
    pool, cache = make_cache()
    insert_fresh(pool, cache, [1, 2, 3])
    cache.match_prefix([1, 2, 3])
    assert cache.stats.queried_tokens == 0 and cache.stats.hit_rate == 0.0
    cache.record_query(4, 3)
    cache.record_query(4, 0)
    assert cache.stats.queried_tokens == 8 and cache.stats.matched_tokens == 3
    assert cache.stats.hit_rate == pytest.approx(3 / 8)
    with pytest.raises(ValueError):
        cache.record_query(2, 3)


def test_check_invariants_detects_a_freed_tree_slot() -> None:
    pool, cache = make_cache()
    _, slots = insert_fresh(pool, cache, [1, 2])
    pool.free([slots[0]])  # simulate a caller wrongly freeing a slot the tree owns
    with pytest.raises(AssertionError, match="free list"):
        cache.check_invariants()


def test_pretty_lists_every_edge() -> None:
    pool, cache = make_cache()
    insert_fresh(pool, cache, [1, 2, 3])
    insert_fresh(pool, cache, [1, 4])
    text = cache.pretty()
    assert "[1]" in text and "[2 3]" in text and "[4]" in text


def test_deep_tree_has_no_recursion_limit() -> None:
    pool, cache = make_cache(capacity=3000)
    ids: list[int] = []
    # Each insert extends the previous one: a chain of 1-token edges deeper than Python's default
    # recursion limit, so any recursive walk would fail here.
    for i in range(1500):
        ids = ids + [i % 3]
        insert_fresh(pool, cache, ids)
    cache.check_invariants()
    assert cache.evict(10**9) == 1500
    assert pool.num_free == pool.capacity


# ---------------------------------------------------------------------- property test
tokens = st.lists(st.integers(min_value=0, max_value=2), min_size=1, max_size=8)


@dataclass
class RunningReq:
    """A simulated request: `slots[:matched]` come from the tree, the rest are its own."""

    ids: list[int]
    node: TreeNode
    matched: int
    slots: list[int]


class RadixMachine(RuleBasedStateMachine):
    """Random insert/match/lock/unlock/evict/flush against an exact reference model.

    The model maps every token prefix the tree currently represents to the slot that was inserted
    for its last token the first time it was cached, and to the logical time it was last touched
    (one tick per match_prefix/insert call, the tree's own clock rule). Evictions are the tree's
    choice, so the model learns which prefixes disappeared and checks that this was legal
    (unlocked, oldest first, enough freed, exactly those slots returned to the pool).
    """

    CAPACITY = 40

    def __init__(self) -> None:
        super().__init__()
        self.pool, self.cache = make_cache(self.CAPACITY)
        self.model: dict[tuple[int, ...], int] = {}
        self.touched: dict[tuple[int, ...], int] = {}
        self.clock = 0
        self.locks: list[tuple[TreeNode, tuple[int, ...]]] = []
        self.requests: list[RunningReq] = []

    # -- reference helpers
    def cached_len(self, ids: list[int]) -> int:
        n = 0
        while n < len(ids) and tuple(ids[: n + 1]) in self.model:
            n += 1
        return n

    def touch(self, ids: list[int]) -> None:
        for j in range(1, len(ids) + 1):
            self.touched[tuple(ids[:j])] = self.clock

    def do_match(self, ids: list[int]) -> MatchResult:
        """match_prefix, checked against the model."""
        self.clock += 1
        res = self.cache.match_prefix(ids)
        n = self.cached_len(ids)
        assert len(res.slots) == n
        assert res.slots == [self.model[tuple(ids[: j + 1])] for j in range(n)]
        assert path_tokens(res.node) == ids[:n]
        self.touch(ids[:n])
        return res

    def do_insert(self, ids: list[int], slots: list[int]) -> int:
        """insert, checked against the model (which then records the new prefixes)."""
        self.clock += 1
        already = self.cache.insert(ids, slots)
        assert already == self.cached_len(ids), "insert's return disagrees with the model"
        for j in range(already, len(ids)):
            self.model[tuple(ids[: j + 1])] = slots[j]
        self.touch(ids)
        return already

    def snapshot(self) -> dict[tuple[int, ...], tuple[int, float]]:
        """prefix -> (slot, node last_access) for every prefix the tree represents."""
        prefixes: dict[tuple[int, ...], tuple[int, float]] = {}
        stack: list[tuple[TreeNode, tuple[int, ...]]] = [
            (c, ()) for c in self.cache.root.children.values()
        ]
        while stack:
            node, prefix = stack.pop()
            for tok, slot in zip(node.key, node.slots, strict=True):
                prefix = prefix + (tok,)
                prefixes[prefix] = (slot, node.last_access)
            stack.extend((c, prefix) for c in node.children.values())
        return prefixes

    def locked_prefixes(self) -> set[tuple[int, ...]]:
        paths = [p for _, p in self.locks] + [tuple(r.ids[: r.matched]) for r in self.requests]
        return {p[:i] for p in paths for i in range(1, len(p) + 1)}

    def unlocked_leaf_times(self) -> list[int]:
        """Touch times of represented prefixes with no represented extension and no lock."""
        inner = {p[:-1] for p in self.model}
        locked = self.locked_prefixes()
        return [self.touched[p] for p in self.model if p not in inner and p not in locked]

    def held_slots(self) -> int:
        return sum(len(r.slots) - r.matched for r in self.requests)

    def checked_evict(self, n: int) -> int:
        before = set(self.model)
        evictable = self.cache.evictable_size()
        free_before = self.pool.free_slot_set()
        freed = self.cache.evict(n)
        after = set(self.snapshot())

        assert after <= before
        removed = before - after
        assert freed == len(removed)
        if evictable >= n:
            assert freed >= max(n, 0)
        else:
            assert freed == evictable, "evict stopped while unlocked nodes remained"
        assert not removed & self.locked_prefixes(), "a locked prefix was evicted"
        assert self.pool.free_slot_set() - free_before == {self.model[p] for p in removed}
        newest_victim = max((self.touched[p] for p in removed), default=0)
        for p in removed:
            del self.model[p]
            del self.touched[p]
        assert newest_victim <= min(self.unlocked_leaf_times(), default=newest_victim), (
            "evicted a more recently used prefix while an older leaf remained"
        )
        return freed

    def alloc(self, n: int) -> list[int] | None:
        if self.pool.num_free < n:
            self.checked_evict(n - self.pool.num_free)
        if self.pool.num_free < n:
            return None
        return self.pool.alloc(n)

    # -- rules
    @rule(ids=tokens)
    def insert_fresh(self, ids: list[int]) -> None:
        slots = self.alloc(len(ids))
        if slots is None:
            return
        already = self.do_insert(ids, slots)
        self.pool.free(slots[:already])

    @rule(ids=tokens)
    def match(self, ids: list[int]) -> None:
        self.do_match(ids)

    @rule(ids=tokens)
    def lock_match(self, ids: list[int]) -> None:
        res = self.do_match(ids)
        self.cache.lock(res.node)
        self.locks.append((res.node, tuple(ids[: len(res.slots)])))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.unlock(node)

    @rule(ids=tokens)
    def start_request(self, ids: list[int]) -> None:
        res = self.do_match(ids[:-1])
        self.cache.lock(res.node)
        matched = len(res.slots)
        own = self.alloc(len(ids) - matched)
        if own is None:
            self.cache.unlock(res.node)
            return
        self.requests.append(RunningReq(ids, res.node, matched, list(res.slots) + own))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        req = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        already = self.do_insert(req.ids, req.slots)
        assert already >= req.matched, "a locked prefix went missing"
        self.pool.free(req.slots[req.matched : already])
        self.cache.unlock(req.node)

    @rule(n=st.integers(min_value=0, max_value=20))
    def evict(self, n: int) -> None:
        self.checked_evict(n)

    @rule()
    def flush(self) -> None:
        if self.locked_prefixes():  # locks taken on the root (empty match) protect nothing
            with pytest.raises(RuntimeError):
                self.cache.flush()
            return
        self.cache.flush()
        self.model.clear()
        self.touched.clear()
        assert self.pool.num_free + self.held_slots() == self.CAPACITY

    # -- invariants
    @invariant()
    def tree_is_consistent(self) -> None:
        self.cache.check_invariants()

    @invariant()
    def slots_are_conserved(self) -> None:
        owned = len(self.cache.owned_slots())
        assert self.pool.num_free + owned + self.held_slots() == self.CAPACITY

    @invariant()
    def tree_matches_model(self) -> None:
        tree = self.snapshot()
        assert {p: slot for p, (slot, _) in tree.items()} == self.model
        assert {p: t for p, (_, t) in tree.items()} == self.touched, "last_access is not exact"

    @invariant()
    def protected_size_is_exact(self) -> None:
        assert self.cache.protected_size() == len(self.locked_prefixes())


RadixMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixMachine = RadixMachine.TestCase
