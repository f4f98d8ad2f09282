"""Property-based test of the radix cache against a token-level reference model (hypothesis).

The model forgets the tree's shape: it is the set of cached token prefixes (prefix-closed, each
with the KV slot of its last token and the logical time it was last touched) plus who owns every
pool slot: free, the cache (one cached token each), or one simulated request. Random sequences
of insert / match / lock / unlock / evict / flush, and requests that follow the scheduler's slot
protocol (`scheduler/kv_manager.py`: match and lock a prefix, allocate the rest, cache the
computed tokens while running, release at the end), must keep the tree in agreement with the
model and `check_invariants` true after every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.cache.radix_cache import RadixCache
from sglite.runtime.cache.tree_node import TreeNode

Prefix = tuple[int, ...]

CAPACITY = 48  # small, so allocation regularly has to evict
# Four token values and sequences up to 12 long: enough sharing for deep splits and branching.
sequences = st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=12)


@dataclass
class SimRequest:
    """A request as the scheduler holds it: `slots[:cached_len]` belong to the tree and are
    locked through `node`; `slots[cached_len:]` are its own."""

    rid: int
    ids: list[int]  # prompt + output tokens whose KV entries are computed
    slots: list[int]
    cached_len: int
    node: TreeNode
    locked: Prefix  # the prefix `node` spells (what the lock protects)


@dataclass
class Lock:
    """A plain `lock(match.node)` held by the test."""

    node: TreeNode
    prefix: Prefix


@dataclass
class Model:
    """What the cache must hold, without its tree."""

    slot_of: dict[Prefix, int] = field(default_factory=dict)  # cached prefix -> its last slot
    touched: dict[Prefix, int] = field(default_factory=dict)  # cached prefix -> last access
    clock: int = 0  # one tick per match_prefix / insert call, as the tree counts

    def longest_cached(self, ids: list[int]) -> int:
        n = 0
        while n < len(ids) and tuple(ids[: n + 1]) in self.slot_of:
            n += 1
        return n

    def touch(self, ids: list[int]) -> None:
        for j in range(1, len(ids) + 1):
            self.touched[tuple(ids[:j])] = self.clock


def tree_prefixes(cache: RadixCache) -> dict[Prefix, tuple[int, int, int]]:
    """Every prefix the tree represents -> (slot, node last_access, id of its node)."""
    out: dict[Prefix, tuple[int, int, int]] = {}
    stack: list[tuple[TreeNode, Prefix]] = [(c, ()) for c in cache.root.children.values()]
    while stack:
        node, prefix = stack.pop()
        for tok, slot in zip(node.key, node.slots, strict=True):
            prefix = prefix + (tok,)
            out[prefix] = (slot, int(node.last_access), id(node))
        stack.extend((child, prefix) for child in node.children.values())
    return out


def spelled(node: TreeNode) -> Prefix:
    """The token prefix from the root to `node`."""
    parts: list[list[int]] = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)


class RadixCacheModelMachine(RuleBasedStateMachine):
    """The cache under random operations, checked against `Model` after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = KVPool(CAPACITY, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
        self.cache = RadixCache(self.pool)
        self.model = Model()
        self.locks: list[Lock] = []
        self.requests: list[SimRequest] = []
        self.next_rid = 0

    # ------------------------------------------------------------------ checked primitives
    def match(self, ids: list[int]) -> tuple[list[int], TreeNode]:
        """match_prefix: the longest cached prefix per the model, with the model's slots."""
        self.model.clock += 1
        res = self.cache.match_prefix(ids)
        n = self.model.longest_cached(ids)
        assert len(res.slots) == n, f"matched {len(res.slots)} tokens, the model caches {n}"
        assert res.slots == [self.model.slot_of[tuple(ids[: j + 1])] for j in range(n)]
        assert spelled(res.node) == tuple(ids[:n]), "the node does not end the matched prefix"
        self.model.touch(ids[:n])
        return res.slots, res.node

    def insert(self, ids: list[int], slots: list[int]) -> int:
        """insert: returns what the model already cached; the tree takes the rest."""
        self.model.clock += 1
        already = self.cache.insert(ids, slots)
        assert already == self.model.longest_cached(ids)
        for j in range(already, len(ids)):
            self.model.slot_of[tuple(ids[: j + 1])] = slots[j]
        self.model.touch(ids)
        return already

    def protected(self) -> set[Prefix]:
        """Every prefix some lock protects (a lock covers its node's whole path)."""
        held = [lock.prefix for lock in self.locks] + [r.locked for r in self.requests]
        return {p[:i] for p in held for i in range(1, len(p) + 1)}

    def evict(self, n: int) -> int:
        """evict: frees unlocked prefixes only, oldest first, enough and not much more."""
        before = tree_prefixes(self.cache)
        evictable = self.cache.evictable_size()
        free_before = self.pool.free_slot_set()
        freed = self.cache.evict(n)
        after = tree_prefixes(self.cache)
        removed = set(before) - set(after)

        assert set(after) <= set(before), "evict added prefixes"
        assert freed == len(removed), f"evict reported {freed}, removed {len(removed)} tokens"
        assert self.pool.free_slot_set() - free_before == {before[p][0] for p in removed}
        if n <= 0:
            assert freed == 0
        elif evictable >= n:
            assert freed >= n, f"asked {n}, freed only {freed} of {evictable} evictable"
            # Whole nodes go, in order, until enough is freed: without its last victim node
            # the total was still short, so no victim node is superfluous.
            sizes: dict[int, int] = {}
            for p in removed:
                sizes[before[p][2]] = sizes.get(before[p][2], 0) + 1
            assert freed - max(sizes.values()) < n, f"asked {n}, evicted {freed}: too many"
        else:
            assert freed == evictable, "evict stopped while unlocked tokens remained"
        assert not removed & self.protected(), "a locked prefix was evicted"
        # LRU: no evicted prefix was touched after a surviving unlocked leaf.
        inner = {p[:-1] for p in after}
        survivors = [
            self.model.touched[p] for p in after if p not in inner and p not in self.protected()
        ]
        newest = max((self.model.touched[p] for p in removed), default=0)
        assert newest <= min(survivors, default=newest), "evicted a more recent prefix first"
        for p in removed:
            del self.model.slot_of[p]
            del self.model.touched[p]
        return freed

    def alloc(self, n: int) -> list[int] | None:
        """n slots, evicting like the scheduler does; None when even eviction cannot help."""
        if self.pool.num_free + self.cache.evictable_size() < n:
            return None
        if self.pool.num_free < n:
            self.evict(n - self.pool.num_free)
        return self.pool.alloc(n)

    # ------------------------------------------------------------------ rules: the cache API
    @rule(ids=sequences)
    def insert_new_sequence(self, ids: list[int]) -> None:
        slots = self.alloc(len(ids))
        if slots is None:
            return
        already = self.insert(ids, slots)
        self.pool.free(slots[:already])  # the caller's duplicates of cached tokens

    @rule(ids=sequences)
    def match_prefix(self, ids: list[int]) -> None:
        self.match(ids)

    @rule(ids=sequences)
    def lock_match(self, ids: list[int]) -> None:
        _, node = self.match(ids)
        self.cache.lock(node)
        self.locks.append(Lock(node, spelled(node)))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        lock = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1), label="lock"))
        self.cache.unlock(lock.node)

    @rule(n=st.integers(min_value=-2, max_value=CAPACITY + 4))
    def evict_tokens(self, n: int) -> None:
        self.evict(n)

    @rule()
    def flush(self) -> None:
        if self.protected():
            with pytest.raises(RuntimeError):
                self.cache.flush()
            return
        self.cache.flush()
        self.model.slot_of.clear()
        self.model.touched.clear()

    @rule(data=st.data())
    def unlock_without_lock_is_refused(self, data: st.DataObject) -> None:
        """Unlocking an unlocked node raises and changes nothing (counts never go negative)."""
        unlocked = [
            node
            for node in self.cache._iter_nodes()  # reading the tree is the point here
            if node.lock_ref == 0
        ]
        if not unlocked:
            return
        node = data.draw(st.sampled_from(unlocked), label="node")
        with pytest.raises(RuntimeError):
            self.cache.unlock(node)

    # ------------------------------------------------------------------ rules: requests
    @rule(ids=sequences)
    def start_request(self, ids: list[int]) -> None:
        """Admission: match at most len - 1 tokens (the last one's logits are computed), lock
        that prefix, allocate slots for the rest."""
        matched, node = self.match(ids[:-1])
        self.cache.lock(node)
        own = self.alloc(len(ids) - len(matched))
        if own is None:
            self.cache.unlock(node)
            return
        self.next_rid += 1
        self.requests.append(
            SimRequest(self.next_rid, list(ids), matched + own, len(matched), node, spelled(node))
        )

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), new=sequences)
    def decode_and_cache_unfinished(self, data: st.DataObject, new: list[int]) -> None:
        """A running request computes more tokens, then puts everything computed so far into
        the cache and moves its lock to the new end (so others share it at once)."""
        req = data.draw(st.sampled_from(self.requests), label="request")
        own = self.alloc(len(new))
        if own is None:
            return
        req.ids += new
        req.slots += own
        already = self.insert(req.ids, req.slots)
        assert already >= req.cached_len, "the request's locked prefix went missing"
        self.pool.free(req.slots[req.cached_len : already])
        slots, node = self.match(req.ids)
        assert len(slots) == len(req.ids), "a just-inserted sequence is not fully cached"
        self.cache.lock(node)
        self.cache.unlock(req.node)
        req.slots, req.cached_len, req.node, req.locked = slots, len(req.ids), node, spelled(node)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        """Release: the computed tokens go into the cache, duplicates are freed, lock dropped."""
        req = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1), label="req"))
        already = self.insert(req.ids, req.slots)
        assert already >= req.cached_len, "the request's locked prefix went missing"
        self.pool.free(req.slots[req.cached_len : already])
        self.cache.unlock(req.node)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def tree_invariants_hold(self) -> None:
        self.cache.check_invariants()

    @invariant()
    def tree_agrees_with_model(self) -> None:
        tree = tree_prefixes(self.cache)
        assert {p: v[0] for p, v in tree.items()} == self.model.slot_of
        assert {p: v[1] for p, v in tree.items()} == self.model.touched, "last_access differs"

    @invariant()
    def every_slot_has_exactly_one_owner(self) -> None:
        """Each slot 1..capacity is free, one cached token's, or one request's own."""
        owners: dict[int, list[str]] = {s: [] for s in range(1, CAPACITY + 1)}
        for s in self.pool.free_slot_set():
            owners[s].append("free")
        for prefix, slot in self.model.slot_of.items():
            owners[slot].append(f"cache{list(prefix)}")
        for req in self.requests:
            # The request's cached part must be exactly the tree's slots for that prefix.
            for j in range(req.cached_len):
                assert self.model.slot_of[tuple(req.ids[: j + 1])] == req.slots[j]
            for s in req.slots[req.cached_len :]:
                owners[s].append(f"request{req.rid}")
        bad = {s: o for s, o in owners.items() if len(o) != 1}
        assert not bad, f"slots without exactly one owner: {bad}"
        assert self.pool.num_free == len(self.pool.free_slot_set()), "a slot is free twice"

    @invariant()
    def sizes_match_locks(self) -> None:
        protected = self.protected()
        assert protected <= set(self.model.slot_of), "a locked prefix is not cached"
        assert self.cache.protected_size() == len(protected)
        assert self.cache.evictable_size() == len(self.model.slot_of) - len(protected)
        assert self.cache.total_size() == len(self.model.slot_of)


RadixCacheModelMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestRadixCacheModel = RadixCacheModelMachine.TestCase
