"""Property-based test of the tiered cache (hypothesis): random requests, evictions, flushes,
restarts and corrupted pages under random tier settings must keep every invariant and never
serve K/V that was not computed for exactly the matched prefix.

Each token's K/V encodes its whole prefix (tests/hicache_helpers.py), so "the data is right"
is checked directly wherever it lives: device slots, host slots, and what a match loads.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

import torch
from hicache_helpers import (
    assert_kv,
    make_tiered,
    prefix_value,
    write_kv,
)
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sglite.runtime.cache.tree_node import TreeNode

CAPACITY = 28  # small, so requests regularly push spans down the tiers
sequences = st.lists(st.integers(min_value=0, max_value=3), min_size=2, max_size=14)


@dataclass
class SimRequest:
    """`slots[:cached_len]` belong to the tree (locked through `node`), the rest to the request."""

    ids: list[int]
    slots: list[int]
    cached_len: int
    node: TreeNode


class TieredCacheMachine(RuleBasedStateMachine):
    """The tiered cache under random operations and settings."""

    @initialize(
        host_tokens=st.sampled_from([0, 8, 24, 64, 64]),
        use_disk=st.booleans(),
        write_policy=st.sampled_from(["write_through", "write_back"]),
        eviction_policy=st.sampled_from(["lru", "benefit"]),
        page_size=st.sampled_from([1, 3, 4]),
    )
    def setup(self, host_tokens, use_disk, write_policy, eviction_policy, page_size) -> None:
        self.dir = tempfile.mkdtemp(prefix="hicache-prop-") if use_disk else None
        self.settings = dict(
            capacity=CAPACITY,
            host_tokens=host_tokens,
            disk_dir=self.dir,
            page_size=page_size,
            write_policy=write_policy,
            eviction_policy=eviction_policy,
        )
        self.pool, self.cache = make_tiered(**self.settings)
        self.requests: list[SimRequest] = []
        self.history: list[list[int]] = []  # sequences seen, so later requests share them

    def teardown(self) -> None:
        if getattr(self, "dir", None):
            shutil.rmtree(self.dir, ignore_errors=True)

    def alloc(self, n: int) -> list[int] | None:
        if self.pool.num_free + self.cache.evictable_size() < n:
            return None
        if self.pool.num_free < n:
            self.cache.evict(n - self.pool.num_free)
        return self.pool.alloc(n)

    # ------------------------------------------------------------------ rules
    @rule(ids=sequences)
    def start_request(self, ids: list[int]) -> None:
        """Admission: load the cached prefix from any tier, check it, lock it, compute the rest."""
        self._admit(ids)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 3), max_size=4))
    def repeat_request(self, data: st.DataObject, tail: list[int]) -> None:
        """A later turn: an earlier sequence (often evicted to a lower tier by now) plus more."""
        earlier = data.draw(st.sampled_from(self.history), label="earlier")
        self._admit(earlier + tail + [0])

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def evict_then_repeat(self, data: st.DataObject) -> None:
        """Pressure on the pool, then an earlier sequence again: a lower-tier hit if kept."""
        self.cache.evict(self.cache.evictable_size())
        self._admit(data.draw(st.sampled_from(self.history), label="earlier") + [1])

    def _admit(self, ids: list[int]) -> None:
        """As the scheduler admits and prefills: the prompt enters the tree at once, and short
        requests (every other one) finish right away, so the pool does not stay full."""
        found = self.cache.load_prefix(ids[:-1])
        assert found.device + found.host + found.disk == len(found.slots)
        assert_kv(self.pool, ids, found.slots)  # never a wrong answer
        event(f"match from host: {found.host > 0}, from disk: {found.disk > 0}")
        self.cache.lock(found.node)
        own = self.alloc(len(ids) - len(found.slots))
        if own is None:
            self.cache.unlock(found.node)
            return
        slots = found.slots + own
        write_kv(self.pool, ids, slots, start=len(found.slots))
        self.history.append(list(ids))
        req = SimRequest(list(ids), slots, len(found.slots), found.node)
        self.requests.append(req)
        self._cache_unfinished(req)
        if len(self.history) % 2:
            self.requests.remove(req)
            self._finish(req)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), new=sequences)
    def decode_and_cache_unfinished(self, data: st.DataObject, new: list[int]) -> None:
        req = data.draw(st.sampled_from(self.requests), label="request")
        own = self.alloc(len(new))
        if own is None:
            return
        start = len(req.ids)
        req.ids += new
        req.slots += own
        write_kv(self.pool, req.ids, req.slots, start=start)
        self._cache_unfinished(req)

    def _cache_unfinished(self, req: SimRequest) -> None:
        already = self.cache.insert(req.ids, req.slots)
        assert already >= req.cached_len, "the request's locked prefix left the device"
        self.pool.free(req.slots[req.cached_len : already])
        match = self.cache.match_prefix(req.ids)
        assert len(match.slots) == len(req.ids) and match.host_len == 0
        self.cache.lock(match.node)
        self.cache.unlock(req.node)
        req.slots, req.cached_len, req.node = list(match.slots), len(req.ids), match.node

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        self._finish(self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1))))

    def _finish(self, req: SimRequest) -> None:
        already = self.cache.insert(req.ids, req.slots)
        assert already >= req.cached_len
        self.pool.free(req.slots[req.cached_len : already])
        self.cache.unlock(req.node)

    @rule(ids=sequences)
    def probe(self, ids: list[int]) -> None:
        match = self.cache.match_prefix(ids)
        assert_kv(self.pool, ids, match.slots)

    @rule(n=st.integers(min_value=0, max_value=CAPACITY + 4))
    def evict(self, n: int) -> None:
        evictable = self.cache.evictable_size()
        freed = self.cache.evict(n)
        assert freed >= min(n, evictable)

    @rule()
    def memory_pressure(self) -> None:
        """Everything unlocked leaves the pool (down to the host tier, disk, or nowhere)."""
        self.cache.evict(self.cache.evictable_size())
        assert self.cache.evictable_size() == 0

    @precondition(lambda self: not self.requests)
    @rule()
    def flush(self) -> None:
        self.cache.flush()
        assert self.pool.num_free == self.pool.capacity

    @precondition(lambda self: not self.requests and self.dir is not None)
    @rule()
    def restart(self) -> None:
        """A new process: empty pool and host tier, the same disk directory."""
        self.pool, self.cache = make_tiered(**self.settings)

    @precondition(lambda self: self.dir is not None)
    @rule(data=st.data())
    def corrupt_a_page(self, data: st.DataObject) -> None:
        pages = sorted(self.cache.disk._pages)
        if not pages:
            return
        path = self.cache.disk._path(data.draw(st.sampled_from(pages), label="page"))
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.seek(data.draw(st.integers(0, size - 1), label="offset"))
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x5A]))

    # ------------------------------------------------------------------ invariants
    @invariant()
    def invariants_hold(self) -> None:
        self.cache.check_invariants()

    @invariant()
    def every_slot_has_one_owner(self) -> None:
        own = sum(len(r.slots) - r.cached_len for r in self.requests)
        assert self.pool.num_free + self.cache.total_size() + own == self.pool.capacity

    @invariant()
    def every_copy_holds_its_prefix(self) -> None:
        host = self.cache.host
        stack = [(c, []) for c in self.cache.root.children.values()]
        while stack:
            node, prefix = stack.pop()
            ids = prefix + node.key
            host_k = host.read(node.host_slots)[0] if node.host_slots is not None else None
            for j in range(len(node.key)):
                expected = prefix_value(ids[: len(prefix) + j + 1])
                if node.slots:
                    device_k = self.pool.k[1][node.slots[j]]
                    assert torch.all(device_k == expected + 1), "device slot of another prefix"
                if host_k is not None:
                    assert torch.all(host_k[1][j] == expected + 1), "host copy of another prefix"
            stack.extend((c, ids) for c in node.children.values())


TieredCacheMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestTieredCache = TieredCacheMachine.TestCase
